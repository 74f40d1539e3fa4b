"""Field invariants: valid batches pass, every single corruption is reported with its key, field and rule."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tensordict import TensorDict

from protocol.batch.dataproto import DataProto
from protocol.invariants import (BatchView, InvariantViolation, Violation, as_batch_view, assert_invariants,
                                 check_invariants, check_reorder)
from protocol.store.keys import new_uid, trajectory_key, trajectory_tag
from protocol.store.meta import KVBatchMeta
from protocol.batch.nested import jagged_to_padded, to_nested


def make_batch(seed: int, n_groups: int = 2, n_sessions: int = 2, n_padding: int = 1):
    """A valid batch: jagged fields, keys, tags; the last ``n_padding`` rows are dispatch padding samples."""
    g = torch.Generator().manual_seed(seed)
    keys, tags, rows = [], [], []
    uids = [new_uid() for _ in range(n_groups)]
    for uid in uids:
        for s in range(n_sessions):
            keys.append(trajectory_key(uid, s, 0))
            p, r = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
            tags.append(trajectory_tag(p, r, global_steps=3))
            rows.append((p, r, False))
    for _ in range(n_padding):
        keys.append(trajectory_key(new_uid(), 0, 0))
        tags.append(trajectory_tag(2, 3, global_steps=3, is_padding=True))
        rows.append((2, 3, True))
    prompts, responses, masks, adv, rm, old = [], [], [], [], [], []
    for p, r, pad in rows:
        prompts.append(torch.randint(5, 100, (p,), generator=g))
        responses.append(torch.randint(5, 100, (r,), generator=g))
        m = (torch.rand(r, generator=g) < 0.7).long()
        if pad:
            m.zero_()
        elif m.sum() == 0:
            m[0] = 1
        masks.append(m)
        a = torch.randn(r, generator=g) * m
        adv.append(a)
        score = torch.zeros(r)
        if m.any():
            score[int(m.nonzero().max())] = 0.0 if pad else 1.0
        rm.append(score)
        old.append(-torch.rand(r, generator=g))
    fields = {
        "prompts": to_nested(prompts),
        "responses": to_nested(responses),
        "input_ids": to_nested([torch.cat([a, b]) for a, b in zip(prompts, responses)]),
        "position_ids": to_nested([torch.arange(p + r) for p, r, _ in rows]),
        "response_mask": to_nested(masks),
        "loss_mask": to_nested([m.clone() for m in masks]),
        "advantages": to_nested(adv),
        "returns": to_nested([a.clone() for a in adv]),
        "rm_scores": to_nested(rm),
        "old_log_probs": to_nested(old),
        "reward_score": torch.tensor([0.0 if pad else 1.0 for _, _, pad in rows]),
    }
    return TensorDict(fields, batch_size=[len(keys)]), keys, tags


def _set_row(td: TensorDict, name: str, i: int, row: torch.Tensor) -> TensorDict:
    rows = list(td[name].unbind())
    rows[i] = row
    out = td.clone()
    out[name] = to_nested(rows)
    return out


def _triples(violations):
    return {(v.key, v.field, v.rule) for v in violations}


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n_groups=st.integers(1, 3), n_sessions=st.integers(1, 3),
       n_padding=st.integers(0, 2))
def test_valid_batches_pass(seed, n_groups, n_sessions, n_padding):
    td, keys, tags = make_batch(seed, n_groups, n_sessions, n_padding)
    assert check_invariants(td, keys=keys, tags=tags) == []
    assert_invariants(td, keys=keys, tags=tags)
    # reorder keeps (key, uid, tags): no violation, whatever the permutation
    perm = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    after = KVBatchMeta("train", [keys[i] for i in perm], [tags[i] for i in perm])
    assert check_invariants(td[perm], meta=after, before=(keys, tags)) == []


CORRUPTIONS = ["prompt_len", "response_short", "mask_len", "input_ids", "seq_len_tag", "position_ids",
               "loss_mask", "mask_value", "adv_outside_mask", "rm_outside_mask", "padding_mask", "padding_reward",
               "key_format", "duplicate_key", "float_len", "padding_uid"]


@pytest.mark.parametrize("corruption", CORRUPTIONS)
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 10_000), pick=st.integers(0, 100))
def test_each_corruption_is_reported_with_key_and_field(seed, corruption, pick):
    td, keys, tags = make_batch(seed, 2, 2, 1)
    keys, tags = list(keys), copy.deepcopy(tags)
    real = [i for i, t in enumerate(tags) if not t["is_padding"]]
    i = real[pick % len(real)]
    pad = len(keys) - 1
    m = td["response_mask"].unbind()[i]
    r = tags[i]["response_len"]
    expect: set[tuple[str, str, str]]
    if corruption == "prompt_len":
        td = _set_row(td, "prompts", i, torch.cat([td["prompts"].unbind()[i], torch.tensor([7])]))
        expect = {(keys[i], "prompts", "length")}
    elif corruption == "response_short":
        td = _set_row(td, "responses", i, td["responses"].unbind()[i][:-1])
        expect = {(keys[i], "responses", "length")}
    elif corruption == "mask_len":
        td = _set_row(td, "response_mask", i, torch.cat([m, torch.tensor([0])]))
        expect = {(keys[i], "response_mask", "length")}
    elif corruption == "input_ids":
        ids = td["input_ids"].unbind()[i].clone()
        ids[-1] += 1
        td = _set_row(td, "input_ids", i, ids)
        expect = {(keys[i], "input_ids", "content")}
    elif corruption == "seq_len_tag":
        tags[i]["seq_len"] += 1
        expect = {(keys[i], "tag", "tag")}
    elif corruption == "position_ids":
        td = _set_row(td, "position_ids", i, td["position_ids"].unbind()[i] + 1)
        expect = {(keys[i], "position_ids", "content")}
    elif corruption == "loss_mask":
        lm = td["loss_mask"].unbind()[i].clone()
        lm[0] = 1 - lm[0]
        td = _set_row(td, "loss_mask", i, lm)
        expect = {(keys[i], "loss_mask", "content")}
    elif corruption == "mask_value":
        mm = m.clone()
        mm[int(m.nonzero()[0])] = 2
        td = _set_row(td, "response_mask", i, mm)
        expect = {(keys[i], "response_mask", "content")}
    elif corruption in ("adv_outside_mask", "rm_outside_mask"):
        with_off = [j for j in real if bool((td["response_mask"].unbind()[j] == 0).any())]
        if not with_off:
            return
        i = with_off[pick % len(with_off)]
        off = (td["response_mask"].unbind()[i] == 0).nonzero().flatten()
        name = "advantages" if corruption == "adv_outside_mask" else "rm_scores"
        row = td[name].unbind()[i].clone()
        row[int(off[0])] = 0.5
        td = _set_row(td, name, i, row)
        expect = {(keys[i], name, "mask")}
    elif corruption == "padding_mask":
        pm = torch.ones(tags[pad]["response_len"], dtype=torch.long)
        td = _set_row(td, "response_mask", pad, pm)
        td = _set_row(td, "loss_mask", pad, pm.clone())
        expect = {(keys[pad], "response_mask", "padding")}
    elif corruption == "padding_reward":
        td = td.clone()
        td["reward_score"][pad] = 1.0
        expect = {(keys[pad], "reward_score", "padding")}
    elif corruption == "key_format":
        keys[i] = keys[i].replace("_", "-", 1)
        expect = {(keys[i], "key", "key")}
    elif corruption == "duplicate_key":
        j = real[(pick + 1) % len(real)]
        if j == i:
            return
        keys[j] = keys[i]
        tags[j] = copy.deepcopy(tags[i])
        # the duplicated row's fields no longer match the copied tag lengths, so only check the key rule
        got = {t for t in _triples(check_invariants(td, keys=keys, tags=tags)) if t[2] == "key"}
        assert got == {(keys[i], "key", "key")}
        return
    elif corruption == "padding_uid":
        keys[pad] = trajectory_key(keys[i].split("_")[0], 9, 0)
        expect = {(keys[pad], "key", "padding")}
        i = pad
    elif corruption == "float_len":
        td = _set_row(td, "old_log_probs", i, torch.zeros(r + 2))
        expect = {(keys[i], "old_log_probs", "length")}
    got = _triples(check_invariants(td, keys=keys, tags=tags))
    assert got == expect, corruption
    with pytest.raises(InvariantViolation) as exc:
        assert_invariants(td, keys=keys, tags=tags)
    assert keys[i if corruption not in ("padding_mask", "padding_reward") else pad] in str(exc.value)
    assert len(exc.value.violations) == len(expect)
    assert all(isinstance(v, Violation) for v in exc.value.violations)


def test_dataproto_adapter_padded_fields_and_uid_column():
    td, keys, tags = make_batch(1, 2, 2, 1)
    uids = [k.split("_")[0] for k in keys]
    width = max(t["response_len"] for t in tags) + 2
    tensors = {name: (jagged_to_padded(td[name], max_len=width)
                      if name in ("responses", "response_mask", "advantages", "rm_scores") else td[name])
               for name in td.keys()}
    dp = DataProto.from_dict(tensors=tensors, non_tensors={"uid": uids, "key": keys, "tags": tags})
    assert check_invariants(dp) == []
    view = as_batch_view(dp)
    assert {"responses", "response_mask", "advantages", "rm_scores"} <= view.padded
    # a wrong uid column, and a non-zero value in the right padding of a padded mask
    bad_uids = list(uids)
    bad_uids[0] = "f" * 32
    mask = tensors["response_mask"].clone()
    mask[1, width - 1] = 1
    dp2 = DataProto.from_dict(tensors={**tensors, "response_mask": mask},
                              non_tensors={"uid": bad_uids, "key": keys, "tags": tags})
    got = _triples(check_invariants(dp2))
    assert (keys[0], "uid", "key") in got and (keys[1], "response_mask", "padding") in got
    with pytest.raises(ValueError, match="keys and tags"):
        check_invariants(DataProto.from_dict(tensors=tensors, non_tensors={"uid": uids}))


def test_position_ids_multi_dim_and_prompt_len_zero():
    td, keys, tags = make_batch(2, 1, 2, 0)
    pos = [torch.arange(t["seq_len"]).repeat(3, 1).T.contiguous() for t in tags]  # [seq_len, 3] rows
    td2 = td.clone()
    td2["position_ids"] = to_nested(pos)
    assert check_invariants(td2, keys=keys, tags=tags) == []
    bad = copy.deepcopy(tags)
    bad[0].update(prompt_len=0, seq_len=bad[0]["response_len"])
    got = _triples(check_invariants(None, keys=keys, tags=bad))
    assert got == {(keys[0], "prompt_len", "length")}


def test_check_reorder_reports_changed_missing_and_new():
    _, keys, tags = make_batch(3, 2, 1, 0)
    before = (keys, tags)
    assert check_reorder(before, (keys[::-1], tags[::-1])) == []
    changed = copy.deepcopy(tags)
    changed[0]["global_steps"] = 99
    v = check_reorder(before, (keys, changed))
    assert [(x.key, x.field, x.rule) for x in v] == [(keys[0], "tags", "reorder")]
    assert "99" in v[0].message
    v = check_reorder(before, (keys[:1], tags[:1]))
    assert [(x.key, x.field) for x in v] == [(keys[1], "key")] and "missing" in v[0].message
    extra = trajectory_key(new_uid(), 0, 0)
    v = check_reorder(before, (keys + [extra], tags + [tags[0]]))
    assert [(x.key, x.rule) for x in v] == [(extra, "reorder")]
    meta = KVBatchMeta("train", keys, tags)
    assert check_reorder(meta, BatchView(keys[::-1], tags[::-1])) == []


def test_adapter_errors():
    td, keys, tags = make_batch(4, 1, 1, 0)
    with pytest.raises(TypeError, match="TensorDict"):
        check_invariants({"a": 1}, keys=keys, tags=tags)
    with pytest.raises(ValueError, match="one tag per key"):
        check_invariants(td, keys=keys, tags=[])
    with pytest.raises(ValueError, match="batch_size"):
        check_invariants(td, keys=keys * 2, tags=tags * 2)
    v = check_invariants(td.clone().set("reward_score", torch.zeros(1, 2)), keys=keys, tags=tags)
    assert ("<batch>", "reward_score", "length") in _triples(v)


def test_docstring_examples_of_algorithm_modules_run():
    """The runnable examples in the module docstrings of the algorithm modules stay true."""
    import doctest

    import protocol.algos.advantage
    import protocol.invariants
    import protocol.algos.kl
    import protocol.algos.losses
    import protocol.algos.reward

    for mod in (protocol.algos.advantage, protocol.invariants, protocol.algos.kl, protocol.algos.losses, protocol.algos.reward):
        result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0 and result.attempted > 0, mod.__name__
