"""The built-in character tokenizer and load_tokenizer."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from protocol.rollout.tokenizer import ROLES, CharTokenizer, ChatTemplateError, TokenIdError, load_tokenizer

TOK = CharTokenizer()
table_text = st.text(alphabet=st.sampled_from([chr(c) for c in range(32, 127)] + ["\n", "\t"]), max_size=60)


def test_vocab_layout():
    assert TOK.vocab_size == 128 and len(TOK) == 128
    assert (TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id, TOK.unk_token_id) == (0, 1, 2, 3)
    ids = TOK.encode("".join(chr(c) for c in range(32, 127)) + "\n\t")
    assert len(set(ids)) == 97 and max(ids) < TOK.vocab_size
    assert not set(ids) & TOK.special_token_ids
    assert set(TOK.role_token_ids) == set(ROLES)


@settings(max_examples=200, deadline=None)
@given(text=table_text)
def test_round_trip_on_table_characters(text):
    ids = TOK.encode(text)
    assert len(ids) == len(text)
    assert TOK.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40))
def test_unknown_characters_map_to_unk_never_dropped(text):
    ids = TOK.encode(text)
    assert len(ids) == len(text)
    out = TOK.decode(ids)
    assert len(out) == len(text)
    for c, i, o in zip(text, ids, out):
        known = c in "\n\t" or 32 <= ord(c) < 127
        assert (i == TOK.unk_token_id) != known
        assert o == (c if known else "\ufffd")


def test_decode_specials_and_errors():
    ids = [1, 5, *TOK.encode("a"), 2, 120, 0]
    assert TOK.decode(ids) == "a"
    assert TOK.decode(ids, skip_special=False) == "<|bos|><|user|>a<|eos|><|reserved_120|><|pad|>"
    assert TOK.decode(torch.tensor(ids)) == "a"
    assert TOK.decode(ids, skip_special_tokens=False) == TOK.decode(ids, skip_special=False)
    with pytest.raises(TokenIdError, match="128"):
        TOK.decode([128])
    with pytest.raises(TokenIdError, match="-1"):
        TOK.decode([-1])
    with pytest.raises(TokenIdError, match="position 1"):
        TOK.decode([5, "a"])
    with pytest.raises(TypeError, match="str"):
        TOK.encode(b"abc")
    assert TOK.encode("<|eos|>") == TOK.encode("<") + TOK.encode("|eos|>")  # literal text, not the token


def test_chat_template():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "q?"}]
    ids = TOK.apply_chat_template(msgs)
    assert ids == [1, 4, *TOK.encode("S"), 2, 5, *TOK.encode("q?"), 2, 6]
    assert TOK.apply_chat_template(msgs, add_generation_prompt=False) == ids[:-1]
    assert TOK.apply_chat_template(msgs, tokenize=False) == "<|bos|><|system|>S<|eos|><|user|>q?<|eos|><|assistant|>"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, "b"]}]
    assert TOK.decode(TOK.apply_chat_template(parts)) == "a<image>b"
    # The template is a prefix-extension: appending a turn only appends tokens.
    more = msgs + [{"role": "assistant", "content": "A"}, {"role": "tool", "content": "obs"}]
    assert TOK.apply_chat_template(more)[:len(ids) - 1] == ids[:-1]


@pytest.mark.parametrize("msgs, fragment", [
    ("hello", "list"), ([{"role": "bot", "content": "x"}], "bot"), ([{"role": "user"}], "content"),
    (["x"], "message 0"), ([{"role": "user", "content": 5}], "content must be"),
    ([{"role": "user", "content": [{"type": "x"}]}], "part 0"),
])
def test_chat_template_errors(msgs, fragment):
    with pytest.raises(ChatTemplateError, match=fragment):
        TOK.apply_chat_template(msgs)


def test_load_tokenizer(tmp_path):
    assert isinstance(load_tokenizer("char"), CharTokenizer)
    assert isinstance(load_tokenizer(None), CharTokenizer)
    assert load_tokenizer(TOK) is TOK
    assert isinstance(load_tokenizer({"name": "char"}), CharTokenizer)
    assert load_tokenizer(TOK.state_dict()) == TOK
    with pytest.raises(ModuleNotFoundError, match="transformers"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="transformers"):
        load_tokenizer({"path": str(tmp_path)})
    with pytest.raises(ValueError, match="gpt9"):
        load_tokenizer("gpt9")
    with pytest.raises(TypeError):
        load_tokenizer(3.5)
