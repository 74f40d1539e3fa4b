"""The built-in character tokenizer, Hugging Face tokenizer folders, load_tokenizer and the scorer's decode."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from protocol.algos.reward import RewardInput, make_reward_manager
from protocol.rollout.tokenizer import (ROLES, CharTokenizer, ChatTemplateError, HFTokenizer, TokenIdError,
                                        TokenizerError, VocabularyError, check_vocab_fits, decode_response,
                                        generation_stop_ids, load_tokenizer, resolve_tokenizer, stop_token_ids)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
import hf_tiny  # noqa: E402  (tests/dist helper: offline tiny HF artefacts)

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
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        load_tokenizer({"path": str(tmp_path)})
    with pytest.raises(TokenizerError, match="gpt9"):
        load_tokenizer("gpt9")
    with pytest.raises(TypeError):
        load_tokenizer(3.5)


# ------------------------------------------------------------------------------------------------ Hugging Face


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("chatml")
    hf = hf_tiny.make_chatml_tokenizer(out)
    eos, eot = hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, eot]}))
    return out


def test_resolve_tokenizer_defaults_to_the_checkpoint():
    assert resolve_tokenizer("", "/ckpt") == "/ckpt"
    assert resolve_tokenizer(None, "/ckpt") == "/ckpt"
    assert resolve_tokenizer("", "") == "char"
    assert resolve_tokenizer("char", "/ckpt") == "char"  # an explicit choice wins
    assert resolve_tokenizer("/other", "/ckpt") == "/other"


def test_hf_chat_template_gives_token_ids(hf_dir):
    """transformers 5 returns a BatchEncoding by default; the wrapper always hands back the ids."""
    tok = load_tokenizer(str(hf_dir))
    assert isinstance(tok, HFTokenizer)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "repeat: a3"}]
    ids = tok.apply_chat_template(msgs)
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nrepeat: a3<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids, skip_special=False) == text
    assert ids == tok.hf(text, add_special_tokens=False)["input_ids"]  # the template's text, tokenized
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == ids[:-len(tok.encode("assistant\n")) - 1]
    assert tok.decode(tok.encode("copy: abcd")) == "copy: abcd"
    assert tok.vocab_size == len(tok.hf) and tok.eos_token_id == tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert load_tokenizer(tok.state_dict()).vocab_size == tok.vocab_size


def test_hf_stop_ids_include_generation_config(hf_dir, tmp_path):
    tok = load_tokenizer(str(hf_dir))
    eos, eot = tok.hf.convert_tokens_to_ids("<|im_end|>"), tok.hf.convert_tokens_to_ids("<|endoftext|>")
    assert tok.stop_token_ids == {eos, eot} == stop_token_ids(tok) == generation_stop_ids(hf_dir)
    assert stop_token_ids(CharTokenizer()) == {2}
    assert generation_stop_ids(tmp_path) == frozenset() and generation_stop_ids("") == frozenset()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert generation_stop_ids(tmp_path) == {7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(TokenizerError, match="eos_token_id"):
        generation_stop_ids(tmp_path)
    with pytest.raises(TokenizerError, match=r"outside the tokenizer's \d+ tokens"):
        HFTokenizer(tok.hf, extra_stop_ids=[10**6])


def test_vocabulary_check_both_ways(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    n = len(tok)
    check_vocab_fits(tok, n)
    check_vocab_fits(tok, n + 64)  # a model padded larger than its tokenizer (Qwen2.5 pads to 151936) is fine
    with pytest.raises(VocabularyError, match=f"tokenizer has {n} tokens but the model's embedding has {n - 1} rows"):
        check_vocab_fits(tok, n - 1)
    check_vocab_fits(CharTokenizer(), 128)
    with pytest.raises(VocabularyError, match="128 tokens .* 100 rows"):
        check_vocab_fits(CharTokenizer(), 100)


def _score(tok, ids, target="aaa"):
    manager = make_reward_manager("naive", decode=lambda x: decode_response(tok, x))
    return float(manager([RewardInput(response_ids=ids, data_source="repeat", ground_truth=target)]).scores[0])


def test_an_answer_ending_in_eos_scores_like_the_bare_answer(hf_dir):
    hf = load_tokenizer(str(hf_dir))
    im_end, eot, pad = (hf.hf.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>", "<|pad|>"))
    for tok, stops, pad_id in ((CharTokenizer(), [2], 0), (hf, [im_end, eot], pad)):
        answer = tok.encode("aaa")
        assert _score(tok, answer) == 1.0
        for stop in stops:  # every stop id of the tokenizer and of generation_config.json
            assert _score(tok, answer + [stop]) == 1.0
        # regression: filler special tokens are not hidden from the scorer (only the final stop token is dropped)
        assert _score(tok, answer + [pad_id]) < 1.0
        assert _score(tok, answer + [pad_id, stops[0]]) < 1.0
    assert _score(hf, hf.encode("aaa") + [im_end, im_end]) < 1.0  # only ONE final stop token is dropped
    assert decode_response(hf, hf.encode("aaa") + [im_end]) == "aaa"
    assert decode_response(hf, hf.encode("aaa") + [pad]) == "aaa<|pad|>"


@pytest.fixture(scope="module")
def char_as_hf(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("char_hf")
    CharTokenizer().save_pretrained(out)
    return AutoTokenizer.from_pretrained(str(out))


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40).filter(lambda t: "<|" not in t))
def test_char_tokenizer_in_hugging_face_form_gives_the_same_ids(char_as_hf, text):
    ids = TOK.encode(text)
    assert char_as_hf.encode(text, add_special_tokens=False) == ids  # unknown characters -> <|unk|> in both
    assert char_as_hf.decode(ids, skip_special_tokens=False) == TOK.decode(ids, skip_special=False).replace(
        "\ufffd", "<|unk|>")


def test_char_tokenizer_in_hugging_face_form_chat_template(char_as_hf):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "q?"},
            {"role": "assistant", "content": "A"}, {"role": "tool", "content": "obs"}]
    for gen in (True, False):
        assert char_as_hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True, return_dict=False) \
            == TOK.apply_chat_template(msgs, add_generation_prompt=gen)
    assert len(char_as_hf) == 128 and char_as_hf.eos_token_id == TOK.eos_token_id == 2
    assert (char_as_hf.pad_token_id, char_as_hf.bos_token_id, char_as_hf.unk_token_id) == (0, 1, 3)
    with pytest.raises(Exception, match="unknown role bot"):
        char_as_hf.apply_chat_template([{"role": "bot", "content": "x"}], tokenize=False)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, CharTokenizer().vocab_size - 1), max_size=40), skip=st.booleans())
def test_char_decode_is_the_per_id_rule(ids, skip):
    """decode = each id's token, U+FFFD for unk, specials dropped when skipped (the one-pass table path)."""
    tok = CharTokenizer()
    tokens = tok.convert_ids_to_tokens(ids)
    want = "".join("\ufffd" if i == tok.unk_token_id else ("" if skip and i in tok.special_token_ids else t)
                   for i, t in zip(ids, tokens))
    assert tok.decode(ids, skip_special=skip) == want
    assert tok.decode(torch.tensor(ids, dtype=torch.int64), skip_special=skip) == want
