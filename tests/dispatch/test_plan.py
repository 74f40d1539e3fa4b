"""The dispatch plan: coverage, equal shares, reproducible shuffles, group partition, reverse index, metrics."""
from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from tensordict import TensorDict

from dispatch import (
    BatchSettings,
    DispatchConfigError,
    DispatchPlan,
    PlanError,
    Topology,
    WorkloadModel,
    build_plan,
    make_padding,
    padding_count,
    read_plan_tags,
    restore_order,
    reverse_index,
)
from dispatch.balance import imbalance
from protocol.store.keys import group_of, trajectory_key, trajectory_tag
from protocol.batch.nested import to_nested

MODEL = WorkloadModel.from_hidden_size(64)


def make_batch(num_groups: int, g: int, rng: np.random.Generator, step: int = 3):
    keys, tags = [], []
    for u in range(num_groups):
        uid = f"{u:08x}{rng.integers(1 << 30):08x}"
        for s in range(g):
            p, r = int(rng.integers(1, 40)), int(rng.integers(1, 200))
            keys.append(trajectory_key(uid, s, 0))
            tags.append(trajectory_tag(p, r, step))
    return keys, tags


def padded(keys, tags, topo, st_):
    pad = make_padding(padding_count(len(keys), st_.padding_multiple(topo)), global_steps=3, seed=1)
    return keys + pad.keys, tags + pad.tags, pad


@st.composite
def scenarios(draw):
    dp = draw(st.sampled_from([1, 2, 4]))
    g = draw(st.integers(1, 4))
    group = draw(st.booleans())
    m_prompts = dp * draw(st.integers(1, 3)) if group else draw(st.integers(1, 6))
    if (m_prompts * g) % dp:
        m_prompts = dp * m_prompts
    use_mini = draw(st.booleans())
    mode = draw(st.sampled_from(["tokens", "fixed", "none"]))
    sett = BatchSettings(
        ppo_mini_batch_size=m_prompts if use_mini else None, rollout_n=g, ppo_epochs=draw(st.integers(1, 3)),
        shuffle=draw(st.booleans()), seed=draw(st.integers(0, 5)),
        micro_batch_size_per_gpu=draw(st.integers(1, 3)) if mode == "fixed" else None,
        max_token_len_per_gpu=draw(st.integers(300, 900)) if mode == "tokens" else None,
        group_partition=group, balance=draw(st.booleans()), small_ends=draw(st.booleans()), workload=MODEL)
    num_groups = draw(st.integers(1, 10))
    seed = draw(st.integers(0, 1000))
    return dp, sett, num_groups, seed


@settings(max_examples=120, deadline=None)
@given(scenarios())
def test_plan_invariants(scn):
    dp, sett, num_groups, seed = scn
    topo = Topology.from_config({"backend": "fsdp"}, dp)
    keys, tags = make_batch(num_groups, sett.rollout_n, np.random.default_rng(seed))
    if sett.micro_batch_size_per_gpu is not None and sett.mini_batch_samples is not None and \
            sett.micro_batch_size_per_gpu > sett.mini_batch_samples // dp:
        with pytest.raises(DispatchConfigError, match="micro_batch_size_per_gpu"):
            sett.check(topo)
        return
    n_real = len(keys)
    keys, tags, pad = padded(keys, tags, topo, sett)
    multiple = sett.padding_multiple(topo)
    assert len(pad) < multiple and len(keys) % multiple == 0  # padding bound
    before = sorted((group_of(k), k, tuple(sorted(t.items()))) for k, t in zip(keys, tags))
    snapshot = copy.deepcopy(tags)
    plan = build_plan(tags, topo, sett, keys=keys)
    assert tags == snapshot  # planning never edits tags
    again = build_plan(read_plan_tags(tags, keys, need_groups=sett.group_partition), topo, sett)  # read once, reused
    assert [r.mini_batches for r in again.ranks] == [r.mini_batches for r in plan.ranks]
    assert again.metrics == plan.metrics
    work = sett.workload(np.array([t["seq_len"] for t in tags]))
    micro = [mb for r in plan.ranks for s in r.mini_batches for mb in s.micro_batch_indices]
    assert plan.metrics["dispatch/max_micro_batch_tokens"] == max(sum(tags[i]["seq_len"] for i in mb) for mb in micro)
    bal = [imbalance([float(work[mb].sum()) for mb in s.micro_batch_indices]) for r in plan.ranks
           for s in r.mini_batches]
    assert plan.metrics["dispatch/micro_batch_balance"] == pytest.approx(float(np.mean(bal)), rel=1e-12)
    n = len(keys)
    per_epoch = plan.num_mini_batches // sett.ppo_epochs
    assert plan.num_mini_batches == sett.ppo_epochs * per_epoch
    for k in range(plan.num_mini_batches):
        shares = [r.mini_batches[k] for r in plan.ranks]
        assert len({len(s.indices) for s in shares}) == 1  # equal sample counts
        assert len({len(s.micro_batches) for s in shares}) == 1  # equal micro-batch counts
        assert all(s.epoch == k // per_epoch and s.index == k % per_epoch for s in shares)
        for s in shares:
            assert sorted(p for mb in s.micro_batches for p in mb) == list(range(len(s.indices)))
            if sett.max_token_len_per_gpu is not None:
                assert all(sum(tags[i]["seq_len"] for i in mb) <= sett.max_token_len_per_gpu
                           for mb in s.micro_batch_indices)
            if sett.micro_batch_size_per_gpu is not None:
                assert all(len(mb) <= sett.micro_batch_size_per_gpu for mb in s.micro_batches)
            assert s.tokens == sum(tags[i]["seq_len"] for i in s.indices)
            assert s.padding == sum(tags[i]["is_padding"] for i in s.indices)
        # reordering changes only order: the (uid, key, tag) set of a full epoch is the input's
    for e in range(sett.ppo_epochs):
        got = [i for k in range(e * per_epoch, (e + 1) * per_epoch) for r in plan.ranks
               for i in r.mini_batches[k].indices]
        assert sorted(got) == list(range(n))  # every sample exactly once per epoch
        moved = sorted((group_of(keys[i]), keys[i], tuple(sorted(tags[i].items()))) for i in got)
        assert moved == before
    if sett.group_partition:
        for r in plan.ranks:
            for mb in r.mini_batches:
                for i in mb.indices:
                    if not tags[i]["is_padding"]:
                        home = [d for d, rr in enumerate(plan.ranks) for j in rr.mini_batches[mb.epoch * per_epoch
                                + mb.index].indices if group_of(keys[j]) == group_of(keys[i])]
                        assert set(home) == {r.dp_rank}  # whole group on one rank
    # reverse index restores input order of per-sample outputs (one mini-batch = inference)
    if plan.num_mini_batches == 1:
        outputs = [torch.tensor(plan.select(list(range(n)), d)) for d in range(dp)]
        assert plan.restore_order(outputs).tolist() == list(range(n))
        assert plan.restore_order([plan.select(keys, d) for d in range(dp)])[:n_real] == keys[:n_real]
    assert plan.metrics["dispatch/padding"] == len(pad)
    assert plan.metrics["dispatch/balance_after"] >= 1.0 - 1e-12
    if sett.balance:
        assert plan.metrics["dispatch/balance_after_max"] <= plan.metrics["dispatch/balance_before_max"] + 1e-9


def test_shuffle_is_reproducible_and_differs_between_epochs():
    topo = Topology.from_config({"backend": "fsdp"}, 2)
    keys, tags = make_batch(8, 4, np.random.default_rng(0))
    s = BatchSettings(ppo_mini_batch_size=2, rollout_n=4, ppo_epochs=2, shuffle=True, seed=7, workload=MODEL)
    a, b = build_plan(tags, topo, s, keys=keys), build_plan(tags, topo, s, keys=keys)
    assert [r.mini_batches for r in a.ranks] == [r.mini_batches for r in b.ranks]
    c = build_plan(tags, topo, BatchSettings(**{**s.__dict__, "seed": 8}), keys=keys)
    assert [r.mini_batches for r in a.ranks] != [r.mini_batches for r in c.ranks]
    first = {i for r in a.ranks for i in r.mini_batches[0].indices}
    second_epoch = {i for r in a.ranks for i in r.mini_batches[4].indices}
    assert first != second_epoch
    plain = build_plan(tags, topo, BatchSettings(ppo_mini_batch_size=2, rollout_n=4, workload=MODEL), keys=keys)
    assert {i for r in plain.ranks for i in r.mini_batches[0].indices} == set(range(8))


def test_share_and_jagged_outputs_round_trip():
    from backends.base import Share

    topo = Topology.from_config({"backend": "megatron", "tp": 2, "pp": 2, "vpp": 2}, 8)
    keys, tags = make_batch(6, 2, np.random.default_rng(1))
    s = BatchSettings(rollout_n=2, max_token_len_per_gpu=250, workload=MODEL)
    keys, tags, pad = padded(keys, tags, topo, s)
    plan = build_plan(tags, topo, s, keys=keys)
    resp = to_nested([torch.arange(t["response_len"], dtype=torch.float32) + 1000 * i for i, t in enumerate(tags)])
    data = TensorDict({"old_log_probs": resp}, batch_size=[len(tags)])
    outs = []
    for d in range(topo.dp_size):
        mb = plan.ranks[d].mini_batches[0]
        share = Share(data[torch.tensor(mb.indices)], mb.micro_batches)
        assert len(share.micro_batches) % topo.pp == 0  # VPP: a multiple of pp
        outs.append(share.data)
    back = plan.restore_order(outs)
    for i in range(len(tags)):
        assert torch.equal(back["old_log_probs"][i], resp[i])
    for rank in range(8):
        assert plan.for_rank(rank) is plan.ranks[topo.dp_rank(rank)]


def test_errors_name_the_numbers():
    topo = Topology.from_config({"backend": "fsdp"}, 4)
    keys, tags = make_batch(3, 2, np.random.default_rng(0))
    with pytest.raises(PlanError, match="6 samples, not a multiple of 4 .* add 2 padding samples"):
        build_plan(tags, topo, BatchSettings(rollout_n=2), keys=keys)
    with pytest.raises(DispatchConfigError, match="ppo_mini_batch_size \\(3\\) x rollout_n \\(2\\) = 6 .* DP size 4"):
        build_plan(tags, topo, BatchSettings(ppo_mini_batch_size=3, rollout_n=2))
    with pytest.raises(DispatchConfigError, match="ppo_mini_batch_size \\(2 prompts\\) must be divisible by .* 4"):
        BatchSettings(ppo_mini_batch_size=2, rollout_n=2, group_partition=True).check(topo)
    with pytest.raises(PlanError, match="lacks 'seq_len'"):
        build_plan([{"prompt_len": 1}] * 4, topo)
    with pytest.raises(PlanError, match="seq_len 5 != prompt_len 1 \\+ response_len 1"):
        build_plan([{"seq_len": 5, "prompt_len": 1, "response_len": 1}] * 4, topo)
    with pytest.raises(PlanError, match="seq_len must be >= 1"):
        build_plan([{"seq_len": 0}] * 4, topo)
    with pytest.raises(PlanError, match="is_padding must be a bool"):
        build_plan([{"seq_len": 3, "is_padding": 1}] * 4, topo)
    with pytest.raises(PlanError, match="empty batch"):
        build_plan([], topo)
    two = Topology.from_config({"backend": "fsdp"}, 2)
    with pytest.raises(PlanError, match="group 'g0' holds 1"):
        build_plan([{"seq_len": 3, "uid": "g0"}, {"seq_len": 3, "uid": "g1"}, {"seq_len": 3, "uid": "g1"},
                    {"seq_len": 3, "uid": "g2"}], two, BatchSettings(rollout_n=2, group_partition=True))
    with pytest.raises(PlanError, match="sample 'big_0_0' has seq_len 999"):
        build_plan([{"seq_len": 999}, {"seq_len": 3}], two, BatchSettings(max_token_len_per_gpu=100),
                   keys=["big_0_0", "small_0_0"])
    with pytest.raises(PlanError, match="one key per tag"):
        build_plan([{"seq_len": 3}] * 2, two, keys=["a_0_0"])


def test_reverse_index_and_restore_helpers():
    order = [3, 0, 2, 1]
    rev = reverse_index(order)
    assert [order[j] for j in rev] == [0, 1, 2, 3]
    assert restore_order([[30, 0], [20, 10]], order) == [0, 10, 20, 30]
    assert restore_order([np.array([30, 0]), np.array([20, 10])], order).tolist() == [0, 10, 20, 30]
    with pytest.raises(PlanError, match="distinct"):
        reverse_index([0, 0])
    with pytest.raises(PlanError, match="outputs hold 3 samples but the plan gathers 4"):
        restore_order([[1, 2], [3]], order)


def test_restore_order_on_bare_jagged_tensors_lists_and_tensordicts_alike():
    # regression: torch.cat cannot join jagged tensors on dim 0, so bare jagged outputs used to fail
    from tensordict import TensorDict

    order = [3, 0, 2, 1]  # rank 0 computed samples 3, 0; rank 1 computed 2, 1
    rows = [torch.arange(i + 1, dtype=torch.float32) + 10 * i for i in range(4)]  # sample i has i + 1 tokens

    def jag(ids):
        return torch.nested.as_nested_tensor([rows[i] for i in ids], layout=torch.jagged)

    back = restore_order([jag([3, 0]), jag([2, 1])], order)
    assert back.is_nested and [r.tolist() for r in back.unbind()] == [r.tolist() for r in rows]
    tds = [TensorDict({"x": jag(ids), "y": torch.tensor(ids)}, batch_size=[2]) for ids in ([3, 0], [2, 1])]
    td = restore_order(tds, order)
    assert td["y"].tolist() == [0, 1, 2, 3]
    assert [r.tolist() for r in td["x"].unbind()] == [r.tolist() for r in rows]
    assert restore_order([["d", "a"], ("c", "b")], order) == ["a", "b", "c", "d"]
    with pytest.raises(PlanError, match="same kind of output"):
        restore_order([jag([3, 0]), torch.zeros(2, 1)], order)


def test_balanced_plan_beats_contiguous_and_table_prints():
    topo = Topology.from_config({"backend": "megatron", "tp": 2}, 16)
    rng = np.random.default_rng(3)
    tags = [trajectory_tag(int(rng.integers(10, 200)), int(np.clip(rng.lognormal(6, 1), 1, 8000)), 0)
            for _ in range(256)]
    s = BatchSettings(ppo_mini_batch_size=16, rollout_n=8, max_token_len_per_gpu=9000)
    plan = DispatchPlan.build(tags, topo, s)
    m = plan.metrics
    assert m["dispatch/balance_after"] <= 1.01 < m["dispatch/balance_before"]
    assert m["dispatch/num_mini_batches"] == 2 and m["dispatch/max_micro_batch_tokens"] <= 9000
    table = plan.table()
    assert table.splitlines()[0].split() == ["dp", "samples", "padding", "tokens", "workload", "before",
                                             "micro_batches"]
    assert len(table.splitlines()) == 8 + 2 and "after" in table
    unbalanced = build_plan(tags, topo, BatchSettings(**{**s.__dict__, "balance": False}))
    assert unbalanced.metrics["dispatch/balance_after"] == pytest.approx(m["dispatch/balance_before"])
    with pytest.raises(PlanError, match="mini_batch must be an int in \\[0, 2\\)"):
        plan.gather_order(2)


_TAG_EDITS = [  # (field, bad value): each makes one tag ill-formed in a way the per-tag reader names
    ("seq_len", 0), ("seq_len", True), ("seq_len", 2.0), ("prompt_len", -1), ("response_len", "3"),
    ("seq_len", 10 ** 30), ("is_padding", 1), ("prompt_len", np.int64(3)),
]


@settings(max_examples=80, deadline=None)
@given(num_groups=st.integers(0, 6), g=st.integers(1, 3), seed=st.integers(0, 1000), need_groups=st.booleans(),
       with_uid=st.booleans(), edit=st.one_of(st.none(), st.sampled_from(_TAG_EDITS)), where=st.integers(0, 99))
def test_column_tag_reader_matches_the_per_tag_reader(num_groups, g, seed, need_groups, with_uid, edit, where):
    """The fast column reader gives exactly what the per-tag reader gives, and on any ill-formed tag steps aside
    (returns None) so the error still comes from the reader that names the tag."""
    from dispatch.plan import _read_tags, _read_tags_each, _read_tags_fast

    keys, tags = make_batch(num_groups, g, np.random.default_rng(seed))
    pad = make_padding(2, global_steps=3, seed=seed)
    keys, tags = keys + pad.keys, tags + [dict(t) for t in pad.tags]
    if with_uid:
        for k, t in zip(keys, tags):
            if not t.get("is_padding"):
                t["uid"] = group_of(k)
    if edit is not None:
        tags[where % len(tags)][edit[0]] = edit[1]
    fast = _read_tags_fast(tags, keys, need_groups)
    try:
        each = _read_tags_each(tags, keys, need_groups)
    except PlanError as exc:
        assert fast is None
        with pytest.raises(PlanError, match=re.escape(str(exc))):
            _read_tags(tags, keys, need_groups)
        return
    if fast is None:  # a legal rare form (numpy ints) the fast path leaves to the per-tag reader
        assert edit is not None
        return
    for a, b in zip(fast, each):
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        else:
            assert a == b


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.randoms(use_true_random=False))
def test_plan_pieces_computed_apart_assemble_to_the_same_plan(scn, rnd):
    """Each mini-batch planned on its own, in any order and after a pickle round trip (as ranks exchange them),
    assembles to exactly :func:`build_plan`'s plan."""
    import pickle

    from dispatch import PlanJob

    dp, sett, num_groups, seed = scn
    topo = Topology.from_config({"backend": "fsdp"}, dp)
    keys, tags = make_batch(num_groups, sett.rollout_n, np.random.default_rng(seed))
    try:
        sett.check(topo)
        keys, tags, _ = padded(keys, tags, topo, sett)
        want = build_plan(tags, topo, sett, keys=keys)
    except (DispatchConfigError, PlanError, ValueError) as exc:  # the same refusal from the job's pieces
        with pytest.raises(type(exc)):
            job = PlanJob(tags, topo, sett, keys=keys)
            [job.run(i) for i in range(len(job))]
        return
    job = PlanJob(tags, topo, sett, keys=keys)
    assert len(job) == want.num_mini_batches and sum(job.cost(i) for i in range(len(job))) == \
        len(keys) * sett.ppo_epochs
    order = list(range(len(job)))
    rnd.shuffle(order)
    done = {i: pickle.loads(pickle.dumps(job.run(i))) for i in order}
    got = job.assemble([done[i] for i in range(len(job))])
    assert got.ranks == want.ranks and got.metrics == want.metrics
    assert got.baseline_workload == want.baseline_workload and got.num_padding == want.num_padding
    with pytest.raises(PlanError, match=f"needs {len(job)} planned mini-batches, got {len(job) - 1}"):
        job.assemble([done[i] for i in range(len(job) - 1)])
