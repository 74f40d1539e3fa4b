"""Post-processing AgentLoopOutputs into trajectory keys, jagged fields and tags."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from protocol.rollout.agent_loop.output import AgentLoopOutput
from protocol.store.keys import check_trajectory_tag, new_uid, parse_trajectory_key
from protocol.rollout.postprocess import (
    MULTI_MODAL_PREFIX, PostprocessError, outputs_to_fields, postprocess_group,
)
from protocol.store import LocalStore


def _out(p: int, r: int, seed: int = 0, logprobs: bool = True, reward: float | None = 1.0, **kw) -> AgentLoopOutput:
    g = torch.Generator().manual_seed(seed)
    return AgentLoopOutput(
        prompt_ids=torch.randint(0, 128, (p,), generator=g), response_ids=torch.randint(0, 128, (r,), generator=g),
        response_mask=torch.randint(0, 2, (r,), generator=g),
        response_logprobs=-torch.rand(r, generator=g) if logprobs else None, reward_score=reward, **kw)


shapes = st.lists(st.tuples(st.integers(1, 12), st.integers(0, 12)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(shapes=shapes, steps=st.integers(0, 50))
def test_fields_and_tags_follow_the_contract(shapes, steps):
    outs = [_out(p, r, seed=i) for i, (p, r) in enumerate(shapes)]
    uid = "u1"
    batch = postprocess_group(uid, {0: outs[:1], 3: outs[1:]}, steps)
    assert len(batch) == len(outs)
    f = batch.fields
    assert f.batch_size == torch.Size([len(outs)])
    for i, (key, tag, o) in enumerate(zip(batch.keys, batch.tags, outs)):
        u, s, idx = parse_trajectory_key(key)
        assert (u, s, idx) == ((uid, 0, 0) if i == 0 else (uid, 3, i - 1))
        check_trajectory_tag(tag, key)
        assert (tag["prompt_len"], tag["response_len"], tag["seq_len"]) == (o.prompt_len, o.response_len, o.seq_len)
        assert tag["global_steps"] == tag["min_global_steps"] == tag["max_global_steps"] == steps
        assert tag["is_padding"] is False and tag["truncated"] is False
        assert torch.equal(f["prompts"][i], o.prompt_ids)
        assert torch.equal(f["responses"][i], o.response_ids)
        assert torch.equal(f["input_ids"][i], torch.cat([o.prompt_ids, o.response_ids]))
        assert torch.equal(f["position_ids"][i], torch.arange(o.seq_len))
        assert torch.equal(f["response_mask"][i], o.response_mask)
        assert torch.equal(f["loss_mask"][i], o.response_mask)
        assert torch.equal(f["rollout_log_probs"][i], o.response_logprobs)
        assert f["reward_score"][i].item() == pytest.approx(1.0)
    for name in ("prompts", "responses", "input_ids", "position_ids", "response_mask", "loss_mask"):
        assert f[name].is_nested and f[name].layout == torch.jagged and f[name].dtype == torch.int64
    assert f["rollout_log_probs"].dtype == torch.float32 and f["reward_score"].dtype == torch.float32
    assert not f["reward_score"].is_nested


def test_optional_fields_all_or_none():
    assert "rollout_log_probs" not in outputs_to_fields([_out(2, 3, logprobs=False), _out(1, 1, logprobs=False)])
    assert "reward_score" not in outputs_to_fields([_out(2, 3, reward=None)])
    with pytest.raises(PostprocessError, match="response_logprobs.*1 of 2.*\\[1\\]"):
        outputs_to_fields([_out(2, 3), _out(2, 3, logprobs=False)])
    with pytest.raises(PostprocessError, match="reward_score"):
        outputs_to_fields([_out(2, 3, reward=None), _out(2, 3)])
    with pytest.raises(PostprocessError, match="at least one"):
        outputs_to_fields([])


def test_multi_modal_inputs_and_versions():
    a = _out(2, 2, multi_modal_inputs={"pixel_values": torch.ones(3, 4)},
             extra_fields={"min_global_steps": 2, "max_global_steps": 5, "truncated": True}, num_turns=3)
    b = _out(2, 2, multi_modal_inputs={"pixel_values": torch.zeros(1, 4)})
    batch = postprocess_group("u", {0: [a, b]}, 5)
    pv = batch.fields[MULTI_MODAL_PREFIX + "pixel_values"]
    assert pv.is_nested and [t.shape[0] for t in pv.unbind()] == [3, 1]
    assert batch.tags[0]["min_global_steps"] == 2 and batch.tags[0]["num_turns"] == 3 and batch.tags[0]["truncated"]
    c = _out(2, 2, multi_modal_inputs={"other": torch.ones(1)})
    with pytest.raises(PostprocessError, match="keys"):
        outputs_to_fields([a, c])


def test_postprocess_errors():
    with pytest.raises(PostprocessError, match="session ids"):
        postprocess_group("u", {-1: [_out(1, 1)]}, 0)
    with pytest.raises(PostprocessError, match="expected AgentLoopOutput"):
        postprocess_group("u", {0: ["nope"]}, 0)
    with pytest.raises(ValueError, match="'_'"):
        postprocess_group("u_1", {0: [_out(1, 1)]}, 0)
    empty = postprocess_group("u", {}, 0)
    assert empty.keys == [] and empty.fields is None


def test_a_batch_is_one_put_round_trip():
    store = LocalStore()
    uid = new_uid()
    outs = [_out(3, 5, seed=1), _out(4, 2, seed=2)]
    batch = postprocess_group(uid, {0: outs[:1], 1: outs[1:]}, 7)
    meta = store.kv_batch_put(batch.keys, "train", fields=batch.rows, tags=batch.tags)
    assert meta.keys == batch.keys and meta.tags == batch.tags
    got = store.kv_batch_get(meta.keys, "train", ["input_ids", "response_mask", "rollout_log_probs"])
    for i, o in enumerate(outs):
        assert torch.equal(got["input_ids"][i], torch.cat([o.prompt_ids, o.response_ids]))
        assert torch.equal(got["response_mask"][i], o.response_mask)
    assert store.kv_list("train")["train"][batch.keys[1]]["seq_len"] == 6


@settings(max_examples=30, deadline=None)
@given(shapes=shapes)
def test_rows_are_written_as_they_are_and_match_the_fields(shapes):
    """The put hands the store one plain tensor per key and field (no jagged tensor to build and cut again); what
    the store then returns equals the TensorDict view of the same batch, and no stored value shares memory with an
    output or another field."""
    outs = [_out(p, r, seed=i) for i, (p, r) in enumerate(shapes)]
    batch = postprocess_group("u2", {0: outs}, 3)
    for name, value in batch.rows.items():
        if name == "reward_score":
            assert not value.is_nested and value.shape == (len(outs),)
        else:
            assert len(value) == len(outs) and not any(v.is_nested for v in value), name
    store = LocalStore()
    store.kv_batch_put(batch.keys, "train", fields=batch.rows, tags=batch.tags)
    got = store.kv_batch_get(batch.keys, "train", list(batch.rows), jagged=list(batch.rows)[:-1])
    want = batch.fields
    for name in batch.rows:
        for a, b in zip(got[name].unbind(0), want[name].unbind(0)):
            assert torch.equal(a, b), name
    outs[0].response_mask.fill_(7)  # the store holds copies: editing an output or its loss_mask twin changes nothing
    again = store.kv_batch_get(batch.keys[:1], "train", ["response_mask", "loss_mask"])
    assert not (again["response_mask"] == 7).any() and not (again["loss_mask"] == 7).any()
