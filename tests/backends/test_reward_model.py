"""The discriminative reward model against transformers' own ``*ForSequenceClassification`` on the same folder."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dist"))
import hf_tiny  # noqa: E402

from backends.model.reward_model import (RewardModelError, last_token_positions, load_reward_model,  # noqa: E402
                                         read_reward_config)

LENS = (7, 3, 11, 1, 5)


def _batch(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g) for n in LENS]  # id 0 is the pad token: never content


def _packed(rows: list[torch.Tensor]):
    ids = torch.cat(rows)
    pos = torch.cat([torch.arange(len(r)) for r in rows])
    cu = torch.tensor([0, *[len(r) for r in rows]]).cumsum(0).to(torch.int32)
    return ids, pos, cu


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_scores_equal_transformers_sequence_classification(tmp_path, arch):
    """Mixed lengths (one of a single token) right-padded for transformers, packed for the project: the score of
    each sequence equals transformers' to fp32 rounding, whether scored together or one at a time."""
    from transformers import AutoModelForSequenceClassification

    folder = hf_tiny.make_checkpoint(tmp_path / arch, arch, classifier=True, tokenizer=False)
    ours = load_reward_model(str(folder))
    theirs = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32,
                                                                attn_implementation="eager").eval()
    rows = _batch(ours.cfg.vocab_size)
    width = max(LENS)
    padded = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        padded[i, : len(r)], mask[i, : len(r)] = r, 1
    with torch.no_grad():
        want = theirs(input_ids=padded, attention_mask=mask).logits[:, 0]
        got = ours(*_packed(rows))
        alone = torch.cat([ours(*_packed([r])) for r in rows])
    assert got.dtype == torch.float32 and got.shape == (len(rows),)
    assert want.abs().max() > 0.1, "the head reads something"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # alone vs together: the same sums in GEMMs of other shapes, rounded differently (as against transformers)
    torch.testing.assert_close(alone, got, rtol=1e-5, atol=1e-5)


def test_last_token_positions_and_empty_sequences():
    assert last_token_positions(torch.tensor([0, 3, 4, 9], dtype=torch.int32)).tolist() == [2, 3, 8]
    with pytest.raises(ValueError, match="non-empty"):
        last_token_positions(torch.tensor([0, 3, 3], dtype=torch.int32))


def test_a_folder_that_is_no_reward_model_is_refused_naming_the_key(tmp_path):
    with pytest.raises(RewardModelError, match=r"reward\.model\.hf_path=.*is not a folder"):
        read_reward_config(str(tmp_path / "missing"))
    causal = hf_tiny.make_checkpoint(tmp_path / "causal", "qwen2", tokenizer=False)
    with pytest.raises(RewardModelError, match=r"reward\.model\.hf_path=.*Qwen2ForCausalLM.*ForSequenceClassification"):
        read_reward_config(str(causal))
    two = hf_tiny.make_checkpoint(tmp_path / "two", "qwen2", classifier=True, tokenizer=False)
    raw = json.loads((two / "config.json").read_text())
    raw.update(num_labels=2, id2label={"0": "a", "1": "b"}, label2id={"a": 0, "b": 1})
    (two / "config.json").write_text(json.dumps(raw))
    with pytest.raises(RewardModelError, match=r"num_labels=2"):
        read_reward_config(str(two))


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp_reward_model_engine_on_two_ranks_scores_as_one_process(torchrun, tmp_path):
    """Sharded folder, DP=2 and Ulysses SP=2, one sample per micro-batch or all in one: the same scores, padding
    samples 0, each score at the last policy token of its ``rm_scores`` row."""
    folder = hf_tiny.make_checkpoint(tmp_path / "rm", "qwen2", classifier=True, tokenizer=False,
                                     max_shard_size="40KB")
    out = torchrun(Path(__file__).resolve().parent.parent / "dist" / "reward_model_worker.py", 2, str(folder),
                   timeout=300)
    for check in ("dp=2 sp=1", "dp=1 sp=2"):
        assert f"OK reward model {check}" in out, out[-3000:]


def test_reward_model_config_errors_are_one_line_naming_the_key_at_load(tmp_path):
    """Before any collective: a missing folder, a causal LM, a vocabulary that is not the policy's, a backend that
    does not run it, and bad values of the section's own keys."""
    from rldispatch.config import ConfigError, load_config

    good = hf_tiny.make_checkpoint(tmp_path / "rm", "qwen2", classifier=True, tokenizer=False, vocab_size=128)
    wrong_vocab = hf_tiny.make_checkpoint(tmp_path / "rm320", "qwen2", classifier=True, tokenizer=False)
    causal = hf_tiny.make_checkpoint(tmp_path / "lm", "qwen2", tokenizer=False, vocab_size=128)
    cases = [
        ([f"reward.model.hf_path={tmp_path}/none"], "reward.model.hf_path", "is not a folder"),
        ([f"reward.model.hf_path={causal}"], "reward.model.hf_path", "not a *ForSequenceClassification"),
        ([f"reward.model.hf_path={wrong_vocab}"], "reward.model.hf_path", "vocab_size=320, the policy"),
        ([f"reward.model.hf_path={wrong_vocab}"], "reward.model.retokenize=true", "own chat template"),
        ([f"reward.model.hf_path={wrong_vocab}", "reward.model.retokenize=true"], "reward.model.retokenize",
         "has no tokenizer files"),
        ([f"reward.model.hf_path={good}", "actor.backend=megatron"], "actor.backend=megatron",
         "the reward model runs on the FSDP engine only"),
        ([f"reward.model.hf_path={good}", "reward.model.max_length=100000"], "reward.model.max_length",
         "exceeds the reward model's max_position_embeddings=256"),
        (["reward.model.weight=.inf"], "reward.model.weight", "must be a finite number"),
        (["reward.model.micro_batch_size=0"], "reward.model.micro_batch_size", "positive integer"),
        (["reward.model.truncation=right"], "reward.model.truncation", "must be one of ['error', 'left']"),
    ]
    for overrides, key, text in cases:
        with pytest.raises(ConfigError) as info:
            load_config("grpo_tiny", overrides)
        message = str(info.value)
        assert key in message and text in message and "\n" not in message, (overrides, message)
    assert load_config("grpo_tiny", [f"reward.model.hf_path={good}"]).reward.model.enabled
    own = hf_tiny.make_checkpoint(tmp_path / "own", "qwen2", classifier=True, tokenizer=True)  # its own vocabulary
    assert load_config("grpo_tiny", [f"reward.model.hf_path={own}", "reward.model.retokenize=true"]).reward.model.retokenize



def test_one_rank_reward_model_engine_scores_as_the_model(tmp_path, one_rank_group):
    """The FSDP reward-model engine on a single rank (a sharded folder read whole): the model's scores, a padding
    sample 0, each score at the last policy token of its ``rm_scores`` row."""
    from tensordict import TensorDict

    from backends.base import Share
    from backends.config import EngineConfig
    from backends.fsdp.reward_model import FSDPRewardModelEngine
    from protocol.batch.nested import to_nested

    folder = hf_tiny.make_checkpoint(tmp_path / "rm", "llama", classifier=True, tokenizer=False,
                                     max_shard_size="40KB")
    ref = load_reward_model(str(folder))
    rows = [r if len(r) > 1 else torch.cat([r, r]) for r in _batch(ref.cfg.vocab_size)]  # a prompt token each
    masks = [torch.ones(max(1, len(r) - 2), dtype=torch.long) for r in rows]
    data = TensorDict({"input_ids": to_nested(rows), "response_mask": to_nested(masks),
                       "is_padding": torch.tensor([False, False, True, False, False])}, batch_size=[len(rows)])
    eng = FSDPRewardModelEngine(EngineConfig(model=read_reward_config(str(folder))), micro_batch_size=2)
    out = eng.infer_batch(Share(data, [[0, 1, 2], [3, 4]]))
    with torch.no_grad():
        want = torch.where(data["is_padding"], 0.0, ref(*_packed(rows)))
    torch.testing.assert_close(out["scores"], want, rtol=1e-5, atol=1e-5)
    for row, score in zip(out["rm_scores"].unbind(), out["scores"]):
        assert float(row[-1]) == float(score) and int((row[:-1] != 0).sum()) == 0


def test_retokenized_trajectories_score_as_transformers_reads_them_in_its_chat_template(tmp_path,
                                                                                         one_rank_group):
    """``reward.model.retokenize``: prompt messages + a decoded response rendered in the reward model's own ChatML
    template (a BPE vocabulary the policy's char ids know nothing of) are the ids transformers' tokenizer makes of
    the same conversation, and the one-rank engine fed them scores as transformers' classifier does; each score
    still lands at the last policy token of the policy's response row."""
    from tensordict import TensorDict
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from backends.base import Share
    from backends.config import EngineConfig
    from backends.fsdp.reward_model import FSDPRewardModelEngine
    from backends.model.reward_model import chat_input_ids
    from protocol.batch.nested import to_nested
    from protocol.rollout.tokenizer import CharTokenizer, load_tokenizer

    folder = hf_tiny.make_checkpoint(tmp_path / "rm", "qwen2", classifier=True, tokenizer=True)
    ours_tok, theirs_tok = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    policy = CharTokenizer()
    prompts = [[{"role": "user", "content": "repeat: ab"}], "copy: abcd",
               [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse: dcba"}]]
    responses = ["aabb", "the answer is 42", "abcd"]
    policy_rows, masks, own = [], [], []
    for prompt, response in zip(prompts, responses):
        p_ids = policy.apply_chat_template(prompt if isinstance(prompt, list) else
                                           [{"role": "user", "content": prompt}])
        r_ids = policy.encode(response) + [policy.eos_token_id]
        policy_rows.append(torch.tensor(p_ids + r_ids))
        masks.append(torch.ones(len(r_ids), dtype=torch.long))
        text = policy.decode(r_ids, skip_special=True)
        assert text == response
        ids = chat_input_ids(ours_tok, prompt, text)
        messages = (prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]) + \
            [{"role": "assistant", "content": response}]
        want_ids = theirs_tok.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert ids == list(want_ids)
        own.append(torch.tensor(ids))
    data = TensorDict({"input_ids": to_nested(policy_rows), "response_mask": to_nested(masks)},
                      batch_size=[len(policy_rows)])
    eng = FSDPRewardModelEngine(EngineConfig(model=read_reward_config(str(folder))))
    out = eng.infer_batch(Share(data, [[0, 1], [2]]), input_ids=own)
    theirs = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32,
                                                                attn_implementation="eager").eval()
    with torch.no_grad():
        want = torch.cat([theirs(input_ids=ids[None]).logits[:, 0] for ids in own])
    torch.testing.assert_close(out["scores"], want, rtol=1e-5, atol=1e-5)
    for row, mask, score in zip(out["rm_scores"].unbind(), masks, out["scores"]):
        assert row.shape == mask.shape and float(row[-1]) == float(score) and int((row[:-1] != 0).sum()) == 0
