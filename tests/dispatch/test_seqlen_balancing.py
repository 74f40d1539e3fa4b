"""dispatch.seqlen_balancing: verl's documented semantics, plus our guarantees (cap, balance, equal DP counts)."""
from __future__ import annotations

import importlib.util
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from tensordict import TensorDict

from dispatch.seqlen_balancing import (
    SeqlenBalancingError,
    TokenCapError,
    calculate_workload,
    ceildiv,
    get_group_balanced_partitions,
    get_reverse_idx,
    get_seqlen_balanced_partitions,
    greedy_partition,
    karmarkar_karp,
    log_seqlen_unbalance,
    prepare_dynamic_batch,
    rearrange_micro_batches,
    restore_dynamic_batch,
    roundup_divisible,
)
from protocol.batch.dataproto import DataProto

_spec = importlib.util.spec_from_file_location("seqlen_verl_reference", Path(__file__).with_name("verl_reference.py"))
REF = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(REF)


def _jagged_batch(lengths):
    ids = torch.nested.as_nested_tensor([torch.arange(int(s)) for s in lengths], layout=torch.jagged)
    return TensorDict({"input_ids": ids, "pos": torch.arange(len(lengths))}, batch_size=[len(lengths)])


def _padded_batch(lengths, width=None):
    width = width or max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, s in enumerate(lengths):
        mask[i, :s] = 1
    return TensorDict({"input_ids": torch.ones(len(lengths), width, dtype=torch.long), "attention_mask": mask,
                       "pos": torch.arange(len(lengths))}, batch_size=[len(lengths)])


def _covers(parts, n):
    return sorted(i for p in parts for i in p) == list(range(n))


# ------------------------------------------------------------------------------------------- verl's examples
def test_arithmetic_helpers_match_verls_docstrings():
    assert ceildiv(7, 3) == 3 and ceildiv(6, 3) == 2
    assert roundup_divisible(7, 4) == 8 and roundup_divisible(8, 4) == 8
    s = torch.tensor([0, 1, 100, 4096])
    assert calculate_workload(s).tolist() == [24576 * x + x * x for x in s.tolist()]
    assert calculate_workload([3]).tolist() == [24576 * 3 + 9]


def test_greedy_partition_follows_input_order():
    # items in the given order, each to the partition with the smallest sum (the first one on ties)
    assert greedy_partition([3, 1, 2], 2, equal_size=False) == [[0], [1, 2]]
    parts = greedy_partition([9, 9, 9, 1, 1, 1], 3, equal_size=True)  # the bias deals items out evenly
    assert sorted(len(p) for p in parts) == [2, 2, 2] and _covers(parts, 6)


def test_log_seqlen_unbalance_reports_before_and_after():
    seq = [10, 10, 1, 1]
    m = log_seqlen_unbalance(seq, [[0, 2], [1, 3]], prefix="x")
    assert m == {"x/min": 2, "x/max": 20, "x/minmax_diff": 18, "x/balanced_min": 11, "x/balanced_max": 11,
                 "x/mean": 11.0}


def test_errors_are_assertion_errors_too():
    with pytest.raises(AssertionError, match=r"number of items \[2\] < k_partitions \[3\]"):
        get_seqlen_balanced_partitions([1, 2], 3, equal_size=False)
    with pytest.raises(ValueError, match="divisible by k_partitions; got 5 items for 2"):
        get_seqlen_balanced_partitions([1, 2, 3, 4, 5], 2, equal_size=True)
    with pytest.raises(SeqlenBalancingError, match="position 1 holds -1"):
        karmarkar_karp([1, -1], 1, equal_size=False)
    with pytest.raises(AssertionError, match="permutation"):
        get_reverse_idx([0, 0])


# ------------------------------------------------------------------------------------------- partitions
@st.composite
def partition_inputs(draw):
    k = draw(st.integers(1, 12))
    equal = draw(st.booleans())
    n = k * draw(st.integers(1, 8)) if equal else draw(st.integers(k, 4 * k + 4))
    if draw(st.booleans()):
        seq = draw(st.lists(st.integers(1, 16384), min_size=n, max_size=n))
        vals = [REF.verl_workload(s) for s in seq]
    else:
        vals = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    return vals, k, equal


@settings(max_examples=250, deadline=None)
@given(partition_inputs())
def test_partitions_are_verls_contract_and_never_worse_than_verls_kk(inst):
    vals, k, equal = inst
    assert karmarkar_karp(vals, k, equal) == REF.verl_karmarkar_karp(vals, k, equal)
    ours = get_seqlen_balanced_partitions(vals, k, equal)
    assert len(ours) == k and _covers(ours, len(vals)) and all(p == sorted(p) and p for p in ours)
    if equal:
        assert {len(p) for p in ours} == {len(vals) // k}
    verl_max = max(sum(vals[i] for i in p) for p in REF.verl_karmarkar_karp(vals, k, equal))
    assert max(sum(vals[i] for i in p) for p in ours) <= verl_max  # integer sums below 2**53: exact


def test_group_balanced_partitions_keep_uid_runs_whole():
    seq = [100, 120, 5, 7, 300, 310, 40, 60]
    uid = ["a", "a", "b", "b", "c", "c", "d", "d"]
    parts = get_group_balanced_partitions(seq, uid, 2)
    assert _covers(parts, 8) and sorted(len(p) for p in parts) == [4, 4]  # two runs per partition
    for p in parts:
        assert all(uid.index(u) in p and uid.index(u) + 1 in p for u in {uid[i] for i in p})
    work = {u: sum(24576 * s + s * s for s, v in zip(seq, uid) if v == u) for u in "abcd"}
    best = min(max(work[x] + work[y], sum(work.values()) - work[x] - work[y]) for x, y in [("a", "b"), ("a", "c"),
                                                                                       ("a", "d")])
    assert max(sum(24576 * seq[i] + seq[i] ** 2 for i in p) for p in parts) == best
    with pytest.raises(AssertionError, match=r"number of uid groups \(2\) must be >= k_partitions \(3\)"):
        get_group_balanced_partitions([1, 1, 1], ["x", "y", "y"], 3)


# ------------------------------------------------------------------------------------------- micro-batches
@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=30), st.integers(200, 600), st.sampled_from([1, 2, 3]),
       st.booleans())
def test_micro_batches_never_exceed_the_cap_and_cover_every_sample(lengths, cap, vpp, padded):
    td = _padded_batch(lengths) if padded else _jagged_batch(lengths)
    try:
        micro, idx = rearrange_micro_batches(td, cap, num_batches_divided_by=vpp)
    except SeqlenBalancingError as exc:  # only when rounding to the VPP multiple asks for more than the samples
        assert vpp > 1 and "micro-batches are needed" in str(exc)
        return
    assert _covers(idx, len(lengths)) and all(p == sorted(p) and p for p in idx)
    assert all(sum(lengths[i] for i in p) <= cap for p in idx)  # the hard cap, on actual tokens
    assert len(idx) % vpp == 0 and len(idx) >= math.ceil(sum(lengths) / cap)
    for m, p in zip(micro, idx):
        assert m["pos"].tolist() == p
    out = torch.cat([m["pos"] for m in micro])
    assert restore_dynamic_batch(out, idx).tolist() == list(range(len(lengths)))


def test_verls_count_can_exceed_the_cap_ours_cannot():
    lengths = [90, 60, 60, 60, 30]  # 300 tokens, cap 100: verl takes ceil(300/100) = 3 and balances workloads
    verl = REF.verl_micro_batches(lengths, 100)
    assert max(sum(lengths[i] for i in p) for p in verl) > 100
    _, idx = rearrange_micro_batches(_jagged_batch(lengths), 100)
    assert max(sum(lengths[i] for i in p) for p in idx) <= 100 and len(idx) == 4


def test_over_cap_sample_is_an_error_naming_index_and_length():
    with pytest.raises(TokenCapError, match="sample 2 has 150 tokens > max_token_len 100"):
        rearrange_micro_batches(_jagged_batch([10, 20, 150]), 100)
    with pytest.raises(AssertionError, match=r"group 1 \(samples 2..3\) has 110 tokens > max_token_len 100"):
        rearrange_micro_batches(_jagged_batch([10, 20, 60, 50]), 100, force_group_size=2)
    with pytest.raises(AssertionError, match="divisible by force_group_size 2"):
        rearrange_micro_batches(_jagged_batch([10, 20, 60]), 100, force_group_size=2)


def test_min_count_groups_and_pipeline_order():
    lengths = [10, 10, 20, 20, 30, 30, 40, 40]
    _, idx = rearrange_micro_batches(_jagged_batch(lengths), 1000, min_num_micro_batch=4)
    assert len(idx) == 4
    _, idx = rearrange_micro_batches(_jagged_batch(lengths), 1000, min_num_micro_batch=3, num_batches_divided_by=2)
    assert len(idx) == 4
    _, idx = rearrange_micro_batches(_jagged_batch(lengths), 90, force_group_size=2)
    assert all(len(p) % 2 == 0 and all(p[j] // 2 == p[j + 1] // 2 for j in range(0, len(p), 2)) for p in idx)
    # balance order: the heaviest micro-batch in the middle, the lightest at an end
    _, idx = rearrange_micro_batches(_jagged_batch([5, 50, 10, 40, 20, 30]), 50)
    loads = [sum(24576 * s + s * s for s in (([5, 50, 10, 40, 20, 30][i]) for i in p)) for p in idx]
    assert min(loads) in (loads[0], loads[-1]) and 0 < int(np.argmax(loads)) < len(loads) - 1
    _, plain = rearrange_micro_batches(_jagged_batch([5, 50, 10, 40, 20, 30]), 50, use_dynamic_bsz_balance=False)
    assert [p[0] for p in plain] == sorted(p[0] for p in plain)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 120), min_size=6, max_size=6), min_size=2, max_size=4), st.integers(120, 300))
def test_global_lengths_give_every_rank_the_same_count_without_a_collective(ranks, cap):
    counts = {len(rearrange_micro_batches(_jagged_batch(r), cap, dp_seq_lens=ranks)[1]) for r in ranks}
    assert len(counts) == 1


def test_prepare_dynamic_batch_on_dataproto_and_tensordict():
    lengths = [30, 80, 20, 50, 70, 10]
    data = DataProto(batch=_jagged_batch(lengths), non_tensor_batch={"uid": np.array(list("abcdef"), dtype=object)},
                     meta_info={"temperature": 1.0, "nested": {"k": [1]}})
    micro, idx = prepare_dynamic_batch(data, 100)
    assert all(isinstance(m, DataProto) for m in micro) and _covers(idx, 6)
    for m, p in zip(micro, idx):
        assert m.non_tensor_batch["uid"].tolist() == ["abcdef"[i] for i in p]
        assert m.batch["pos"].tolist() == p and [int(x) for x in m.batch["input_ids"].offsets().diff()] == [
            lengths[i] for i in p]
    micro[0].meta_info["nested"]["k"].append(2)
    assert data.meta_info["nested"]["k"] == [1]  # deep-copied, as verl does
    tds, idx2 = prepare_dynamic_batch(_jagged_batch(lengths), 100)
    assert idx2 == idx and all(isinstance(t, TensorDict) for t in tds)
    # restore on jagged outputs and TensorDicts
    jag = torch.nested.as_nested_tensor([torch.full((lengths[i],), float(i)) for p in idx for i in p],
                                        layout=torch.jagged)
    back = restore_dynamic_batch(jag, idx)
    assert [int(r[0]) for r in back.unbind()] == list(range(6))
    assert restore_dynamic_batch(torch.cat(tds), idx)["pos"].tolist() == list(range(6))
    with pytest.raises(AssertionError, match="covers 6 samples but data holds 5"):
        restore_dynamic_batch(torch.zeros(5), idx)


def test_dp_group_all_reduces_the_count(tmp_path, torchrun):
    # two gloo ranks: rank 0 needs 4 micro-batches, rank 1 needs 1 and takes rank 0's count, all under the cap
    script = tmp_path / "seqlen_dp_worker.py"
    script.write_text(textwrap.dedent('''
        import torch, torch.distributed as dist
        from tensordict import TensorDict
        from dispatch.seqlen_balancing import rearrange_micro_batches
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        lengths = [90, 90, 90, 90] if rank == 0 else [10, 10, 10, 10]
        ids = torch.nested.as_nested_tensor([torch.arange(s) for s in lengths], layout=torch.jagged)
        td = TensorDict({"input_ids": ids}, batch_size=[4])
        _, idx = rearrange_micro_batches(td, 100, dp_group=dist.group.WORLD)
        assert all(sum(lengths[i] for i in p) <= 100 for p in idx)
        _, alone = rearrange_micro_batches(td, 100, dp_group=dist.group.WORLD, same_micro_num_in_dp=False)
        print(f"rank {rank} count {len(idx)} alone {len(alone)}", flush=True)
        dist.destroy_process_group()
    '''))
    out = torchrun(script, 2)
    assert "rank 0 count 4 alone 4" in out and "rank 1 count 4 alone 1" in out, out
