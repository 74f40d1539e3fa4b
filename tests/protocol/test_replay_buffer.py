"""ReplayBuffer: terminal groups only, oldest first, failure policy, staleness drop / wait (verl V1's rules and
boundaries), refill, real concurrent writers."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from protocol.rollout.agent_loop import AgentLoop, AgentLoopOutput, SingleTurnAgentLoop, register_prompts, run_group
from protocol.store.keys import new_uid, parse_trajectory_key, prompt_tag, trajectory_key, trajectory_tag
from protocol.store.replay_buffer import (
    ReplayBuffer, ReplayBufferConfig, ReplayBufferError, SampleTimeoutError, snapshot, span, version_metrics,
)
from protocol.store import LocalStore
from protocol.rollout.tokenizer import CharTokenizer

TOK = CharTokenizer()
FAST = dict(poll_interval=0.002)


def put_group(store, status, born, n=2, pid="train", traj_born=None, uid=None):
    """Write a group the way run_group leaves it: trajectory tags (no fields needed here) then the prompt tag."""
    uid = uid or new_uid()
    if status in ("finished", "failure") and n:
        keys = [trajectory_key(uid, s, 0) for s in range(n)]
        b = born if traj_born is None else traj_born
        store.kv_batch_put(keys, pid, tags=[trajectory_tag(3, 4, b) for _ in keys])
    store.kv_batch_put([uid], pid, tags=[prompt_tag(born, status)])
    return uid


@settings(max_examples=100, deadline=None)
@given(cur=st.integers(0, 1000), born=st.integers(0, 1000))
def test_span_formula(cur, born):
    assert span(cur, born) == cur - born + 1


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(max_off_policy_threshold=0), "threshold"), (dict(max_off_policy_threshold=2.5), "threshold"),
    (dict(max_off_policy_threshold=True), "threshold"),
    (dict(off_policy_strategy="keep"), "off_policy_strategy"), (dict(failure_policy="retry"), "failure_policy"),
    (dict(poll_interval=0), "poll_interval"), (dict(timeout=-1), "timeout"), (dict(mode="colocate"), "mode"),
])
def test_config_errors(kwargs, fragment):
    with pytest.raises(ReplayBufferError, match=fragment):
        ReplayBuffer(LocalStore(), "train", **kwargs)
    with pytest.raises(ReplayBufferError, match=fragment):
        ReplayBufferConfig(**kwargs)


def test_sample_argument_errors():
    rb = ReplayBuffer(LocalStore(), "train", **FAST)
    with pytest.raises(ReplayBufferError, match="batch_size"):
        rb.sample(0, 0)
    with pytest.raises(ReplayBufferError, match="current_step"):
        rb.sample(1, -1)
    with pytest.raises(ReplayBufferError, match="partition_id"):
        ReplayBuffer(LocalStore(), "")
    rb2 = ReplayBuffer.from_config(LocalStore(), "val", {"failure_policy": "keep_successful"})
    assert rb2.config.failure_policy == "keep_successful" and rb2.partition_id == "val"


def test_oldest_first_whole_groups_and_never_twice():
    store = LocalStore()
    young = put_group(store, "finished", 5, n=3)
    old = put_group(store, "finished", 2, n=2)
    running = put_group(store, "running", 1)
    mid = put_group(store, "finished", 4, n=1)
    rb = ReplayBuffer(store, "train", **FAST)
    meta = rb.sample(2, current_step=5)
    assert meta.extra_info["uids"] == [old, mid]
    assert meta.keys == [f"{old}_0_0", f"{old}_1_0", f"{mid}_0_0"]
    assert all(t["seq_len"] == 7 for t in meta.tags)
    m = meta.extra_info["metrics"]
    assert m["replay/num_groups"] == 2 and m["replay/num_trajectories"] == 3
    assert m["off_policy/span/max"] == 4 and m["off_policy/span/min"] == 2
    assert m["replay/groups_running"] == 1 and m["replay/groups_finished"] == 3
    meta2 = rb.sample(1, current_step=5)
    assert meta2.extra_info["uids"] == [young]
    with pytest.raises(SampleTimeoutError, match="pending=0, running=1, finished=3, failed=0"):
        rb.sample(1, 5, timeout=0.01)
    assert running not in meta.extra_info["uids"]
    # clearing a batch removes its trajectory and prompt keys
    rb.clear(meta)
    rb.clear(meta2)
    assert set(store.kv_list("train")["train"]) == {running}


def test_failure_policy_drop_clears_and_counts():
    store = LocalStore()
    bad = put_group(store, "failure", 0, n=1)
    good = put_group(store, "finished", 1, n=2)
    rb = ReplayBuffer(store, "train", failure_policy="drop", **FAST)
    meta = rb.sample(1, 1)
    assert meta.extra_info["uids"] == [good]
    m = meta.extra_info["metrics"]
    assert m["replay/failed_groups_dropped"] == 1 and m["replay/failed_samples_dropped"] == 1
    assert bad not in store.kv_list("train")["train"] and rb.totals["failed_groups_dropped"] == 1
    with pytest.raises(Exception):  # the failed group is gone for good: a late write is refused
        store.kv_batch_put([trajectory_key(bad, 5, 0)], "train", tags=[{"x": 1}])


def test_failure_policy_keep_successful():
    store = LocalStore()
    bad = put_group(store, "failure", 0, n=1)
    empty = put_group(store, "failure", 0, n=0)
    rb = ReplayBuffer(store, "train", failure_policy="keep_successful", **FAST)
    meta = rb.sample(1, 0)
    assert meta.extra_info["uids"] == [bad] and meta.extra_info["metrics"]["replay/failed_groups_kept"] == 1
    assert meta.extra_info["metrics"]["replay/failed_groups_dropped"] == 1  # the one without any trajectory
    assert empty not in store.kv_list("train")["train"]


def test_drop_evicts_span_over_threshold_keeps_span_equal_and_refills_exactly_k():
    store = LocalStore()
    refills = []
    stale_a = put_group(store, "finished", 0, n=2)           # span at step 9: 10
    stale_b = put_group(store, "finished", 1, n=1)           # 9
    edge = put_group(store, "finished", 2, n=1)              # 8 == threshold: kept (strict >)
    partial = put_group(store, "finished", 5, n=1, traj_born=0)  # dispatched at 5: span 5, whatever its versions
    running_old = put_group(store, "running", 0)             # in flight: never evicted
    rb = ReplayBuffer(store, "train", max_off_policy_threshold=8, off_policy_strategy="drop",
                      refill=refills.append, **FAST)
    meta = rb.sample(2, 9)
    assert meta.extra_info["uids"] == [edge, partial]
    m = meta.extra_info["metrics"]
    assert m["off_policy/evicted_samples"] == 3 and m["off_policy/evicted_groups"] == 2
    assert m["off_policy/evicted_samples_staleness/max"] == 10
    assert m["off_policy/evicted_samples_staleness/min"] == 9
    assert m["off_policy/evicted_samples_staleness/mean"] == pytest.approx((10 + 10 + 9) / 3)  # per sample
    assert refills == [2] and m["replay/groups_refilled"] == 2
    listed = store.kv_list("train")["train"]
    assert not ({stale_a, stale_b} & {k.split("_")[0] for k in listed}) and running_old in listed


def test_failed_and_stale_group_is_evicted_and_refilled_once():
    store = LocalStore()
    refills = []
    put_group(store, "failure", 0, n=1)   # failed and stale at step 5
    good = put_group(store, "finished", 5, n=1)
    rb = ReplayBuffer(store, "train", max_off_policy_threshold=2, refill=refills.append, **FAST)
    meta = rb.sample(1, 5)
    m = meta.extra_info["metrics"]
    assert meta.extra_info["uids"] == [good] and refills == [1]
    assert m["replay/failed_groups_dropped"] == 1 and m["off_policy/evicted_groups"] == 0


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_sync_mode_and_val_partition_ignore_the_strategy(strategy):
    for mode, pid in (("sync", "train"), ("async", "val")):
        store = LocalStore()
        refills = []
        old = put_group(store, "finished", 0, n=1, pid=pid)
        put_group(store, "running", 0, n=1, pid=pid)  # would block 'wait' in the async train partition
        rb = ReplayBuffer(store, pid, max_off_policy_threshold=1, off_policy_strategy=strategy, mode=mode,
                          refill=refills.append, **FAST)
        meta = rb.sample(1, 50, timeout=0)
        assert meta.extra_info["uids"] == [old] and refills == []
        assert meta.extra_info["metrics"]["off_policy/evicted_samples"] == 0 and rb.blocking(50) == []


@pytest.mark.parametrize("status", ["pending", "running"])
def test_wait_blocks_at_the_threshold_not_below(status):
    store = LocalStore()
    fresh = put_group(store, "finished", 6, n=1)
    inflight = put_group(store, status, 5)
    rb = ReplayBuffer(store, "train", max_off_policy_threshold=3, off_policy_strategy="wait", **FAST)
    # step 6: span of the in-flight group = 2 < 3: no block
    assert rb.blocking(6) == [] and rb.sample(1, 6, timeout=0).extra_info["uids"] == [fresh]
    # step 7: span = 3 == threshold: blocks, even though a finished group is ready
    put_group(store, "finished", 7, n=1)
    assert rb.blocking(7) == [inflight]
    with pytest.raises(SampleTimeoutError, match=f"{status}=1.*'wait'"):
        rb.sample(1, 7, timeout=0)


def test_wait_strategy_waits_for_the_in_flight_group_then_takes_it_first():
    store = LocalStore()
    fresh = put_group(store, "finished", 6, n=1)
    old_uid = new_uid()
    store.kv_batch_put([old_uid], "train", tags=[prompt_tag(0, "running")])  # span at step 7: 8
    rb = ReplayBuffer(store, "train", max_off_policy_threshold=8, off_policy_strategy="wait", **FAST)
    with pytest.raises(SampleTimeoutError, match="running=1.*'wait'"):
        rb.sample(1, 7, timeout=0.02)

    def finish():
        time.sleep(0.03)
        put_group(store, "finished", 0, n=1, uid=old_uid)

    t = threading.Thread(target=finish)
    t.start()
    meta = rb.sample(1, 7, timeout=5)
    t.join()
    assert meta.extra_info["uids"] == [old_uid]  # waited for it, then took it first (oldest)
    assert meta.extra_info["metrics"]["replay/wait_s"] > 0.01
    assert rb.sample(1, 7).extra_info["uids"] == [fresh]


def test_wait_strategy_never_evicts_a_very_stale_finished_group():
    store = LocalStore()
    old = put_group(store, "finished", 0, n=1)  # span 21 at step 20: kept under 'wait'
    store.kv_batch_put([new_uid()], "train", tags=[prompt_tag(19, "running")])
    rb = ReplayBuffer(store, "train", max_off_policy_threshold=8, off_policy_strategy="wait", **FAST)
    meta = rb.sample(1, 20, timeout=1)
    assert meta.extra_info["uids"] == [old] and meta.extra_info["metrics"]["off_policy/evicted_samples"] == 0


def test_partial_ok_and_no_usable_group():
    store = LocalStore()
    only = put_group(store, "finished", 0, n=1)
    put_group(store, "failure", 0, n=1)
    rb = ReplayBuffer(store, "train", **FAST)
    meta = rb.sample(4, 0, timeout=1, partial_ok=True)
    assert meta.extra_info["uids"] == [only]
    with pytest.raises(ReplayBufferError, match="no usable group"):
        rb.sample(1, 0, timeout=1, partial_ok=True)
    with pytest.raises(ReplayBufferError, match="partition"):
        rb.clear(type(meta)("val", [], []))
    with pytest.raises(TypeError):
        rb.clear([1])


def test_sample_waits_for_threaded_run_group_writers():
    """Real writers: threads running run_group on their own event loops while sample polls."""
    store = LocalStore()
    uids = [new_uid() for _ in range(4)]
    register_prompts(store, uids, 3)

    def gen(ids, sp):
        time.sleep(0.01)
        return [9, TOK.eos_token_id], [-0.1, -0.1]

    loop = SingleTurnAgentLoop(gen, TOK, 4)

    def writer(uid):
        asyncio.run(run_group(store, uid, [1, 2], 2, loop, 3))

    rb = ReplayBuffer(store, "train", **FAST)
    threads = [threading.Thread(target=writer, args=(u,)) for u in uids]
    for t in threads:
        t.start()
    meta = rb.sample(4, 3, timeout=10)
    for t in threads:
        t.join()
    assert sorted(meta.extra_info["uids"]) == sorted(uids) and len(meta) == 8
    assert all(parse_trajectory_key(k)[0] in uids for k in meta.keys)
    got = store.kv_batch_get(meta.keys, "train", ["responses"])
    assert got["responses"][:, 0].tolist() == [9] * 8
    rb.clear(meta)
    assert store.stats()["keys"] == 0


def test_async_sample_with_asyncio_writers_and_failures():
    store = LocalStore()
    uids = [new_uid() for _ in range(3)]

    class Loop(AgentLoop):
        async def run(self, prompt, sampling_params=None, session_id=0, **kw):
            await asyncio.sleep(0.01 * (1 + session_id))
            if prompt == [2] and session_id == 1:
                raise RuntimeError("env crashed")
            return [AgentLoopOutput(prompt, [4, 5], [1, 1])]

    async def main():
        register_prompts(store, uids, 0)
        rb = ReplayBuffer(store, "train", failure_policy="keep_successful", **FAST)
        writers = [asyncio.create_task(run_group(store, u, [i], 2, Loop(lambda a, b: None), 0))
                   for i, u in enumerate(uids)]
        meta = await rb.async_sample(3, 0, timeout=10)
        await asyncio.gather(*writers)
        return meta

    meta = asyncio.run(main())
    assert sorted(meta.extra_info["uids"]) == sorted(uids)
    assert len(meta) == 5 and meta.extra_info["metrics"]["replay/failed_groups_kept"] == 1


def test_snapshot_ignores_orphans_and_orders_sessions():
    tags = {"u": prompt_tag(0, "finished"), "u_10_0": trajectory_tag(1, 1, 0), "u_2_1": trajectory_tag(1, 1, 0),
            "u_2_0": trajectory_tag(1, 1, 0), "pad_0_0": {**trajectory_tag(1, 1, 0), "is_padding": True},
            "weird": {"x": 1}}
    snap = snapshot(tags)
    assert snap.groups["u"].keys == ["u_2_0", "u_2_1", "u_10_0"] and snap.orphans == 2
    assert snap.counts() == {"pending": 0, "running": 0, "finished": 1, "failure": 0}


group_specs = st.lists(st.tuples(st.sampled_from(["pending", "running", "finished", "failure"]),
                                 st.integers(0, 12), st.integers(1, 3)), min_size=1, max_size=10)


@settings(max_examples=40, deadline=None)
@given(specs=group_specs, step=st.integers(0, 14), bs=st.integers(1, 4), threshold=st.integers(1, 6),
       failure=st.sampled_from(["drop", "keep_successful"]))
def test_sample_matches_reference_model(specs, step, bs, threshold, failure):
    """drop strategy: the chosen groups are the bs oldest terminal, usable ones with span <= threshold (arrival
    breaks ties); exactly the evicted groups are refilled."""
    store = LocalStore()
    refills = []
    uids = [put_group(store, st_, born, n) for st_, born, n in specs]
    rb = ReplayBuffer(store, "train", max_off_policy_threshold=threshold, failure_policy=failure,
                      refill=refills.append, **FAST)
    usable = [(born, i) for i, (st_, born, n) in enumerate(specs)
              if (st_ == "finished" or (st_ == "failure" and failure == "keep_successful"))
              and step - born + 1 <= threshold]
    stale = [i for i, (st_, born, n) in enumerate(specs) if st_ in ("finished", "failure")
             and step - born + 1 > threshold and not (st_ == "failure" and failure == "drop")]
    failed = [i for i, (st_, _, _) in enumerate(specs) if st_ == "failure" and failure == "drop"]
    expected = [uids[i] for _, i in sorted(usable)[:bs]]
    if len(usable) < bs:
        with pytest.raises(SampleTimeoutError):
            rb.sample(bs, step, timeout=0)
    else:
        meta = rb.sample(bs, step, timeout=0)
        assert meta.extra_info["uids"] == expected
        assert meta.extra_info["metrics"]["off_policy/evicted_groups"] == len(stale)
    assert sum(refills) == len(stale) + len(failed) and len(refills) <= 1
    left = store.kv_list("train")["train"]
    for i in stale + failed:
        assert uids[i] not in left


@settings(max_examples=100, deadline=None)
@given(versions=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 5)), min_size=1, max_size=8),
       step=st.integers(12, 30))
def test_version_metrics_formulas(versions, step):
    """spans = max - min + 1, staleness = step - max, worst = step - min (verl's trajectory_* metrics)."""
    tags = [trajectory_tag(1, 1, lo, lo, lo + d) for lo, d in versions]
    m = version_metrics(tags, step)
    spans = [d + 1 for _, d in versions]
    assert m["off_policy/trajectory_spans/max"] == max(spans)
    assert m["off_policy/trajectory_spans/mean"] == pytest.approx(sum(spans) / len(spans))
    assert m["off_policy/trajectory_staleness/min"] == min(step - lo - d for lo, d in versions)
    assert m["off_policy/trajectory_staleness_worst/max"] == max(step - lo for lo, _ in versions)
    assert version_metrics([{}], step) == {}
