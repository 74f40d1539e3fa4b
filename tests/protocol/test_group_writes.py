"""Group writes: puts of one event-loop turn combined into few batch puts, each caller keeping its own outcome."""
from __future__ import annotations

import asyncio

import pytest
import torch
from tensordict import TensorDict

from protocol.rollout.agent_loop import AgentLoop, AgentLoopOutput, SingleTurnAgentLoop, register_prompts, run_groups
from protocol.rollout.agent_loop.writes import GroupWrites
from protocol.rollout.tokenizer import CharTokenizer
from protocol.store import FieldOverwriteError, LateWriteError, LocalStore
from protocol.store.keys import new_uid

TOK = CharTokenizer()
EOS = TOK.eos_token_id


class CountingStore(LocalStore):
    """A real LocalStore that records every batch put: its keys and the status tags it carried."""

    def __init__(self):
        super().__init__()
        self.puts: list[tuple[list[str], bool, list]] = []

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None, overwrite=False):
        self.puts.append((list(keys), fields is not None, [t.get("status") for t in tags] if tags else []))
        return super().kv_batch_put(keys, partition_id, fields, tags, overwrite)


def _rows(*lengths):
    return [torch.arange(n) for n in lengths]


def test_requests_of_one_turn_become_one_put_and_each_caller_gets_its_own_rows():
    store = CountingStore()
    writes = GroupWrites(store, combine=True)

    async def main():
        return await asyncio.gather(
            writes.put(["a_0_0", "a_1_0"], "t", {"x": _rows(2, 3), "s": torch.tensor([1.0, 2.0])}, [{"v": 1}] * 2),
            writes.put(["b_0_0"], "t", {"x": _rows(1), "s": torch.tensor([3.0])}, [{"v": 2}]),
            writes.put(["c_0_0"], "t", {"x": _rows(4), "s": torch.tensor([4.0])}, [{"v": 3}]))

    metas = asyncio.run(main())
    assert [m.keys for m in metas] == [["a_0_0", "a_1_0"], ["b_0_0"], ["c_0_0"]]
    assert [[t["v"] for t in m.tags] for m in metas] == [[1, 1], [2], [3]]
    assert len(store.puts) == 1 and store.puts[0][0] == ["a_0_0", "a_1_0", "b_0_0", "c_0_0"]
    got = store.kv_batch_get(["c_0_0", "a_1_0", "b_0_0"], "t", ["x", "s"])
    assert [r.tolist() for r in got["x"].unbind()] == [[0, 1, 2, 3], [0, 1, 2], [0]]
    assert got["s"].tolist() == [4.0, 2.0, 3.0]


def test_requests_that_cannot_share_a_put_keep_their_order():
    """The same key twice, another partition, other fields or a TensorDict: separate puts, in request order."""
    store = CountingStore()
    writes = GroupWrites(store, combine=True)

    async def main():
        return await asyncio.gather(
            writes.put(["u"], "t", tags=[{"status": "running"}]),
            writes.put(["v"], "t", tags=[{"status": "running"}]),
            writes.put(["u"], "t", tags=[{"status": "finished"}]),  # u again: after the first u
            writes.put(["w"], "other", tags=[{"status": "running"}]),
            writes.put(["k_0_0"], "t", {"x": _rows(2)}),
            writes.put(["k_1_0"], "t", {"y": _rows(2)}),
            writes.put(["k_2_0"], "t", TensorDict({"x": torch.zeros(1, 2)}, [1])))

    asyncio.run(main())
    assert [p[0] for p in store.puts] == [["u", "v"], ["u"], ["w"], ["k_0_0"], ["k_1_0"], ["k_2_0"]]
    assert store.kv_batch_get_tags(["u"], "t")[0]["status"] == "finished"


def test_a_refused_request_fails_alone_with_the_stores_error():
    store = CountingStore()
    writes = GroupWrites(store, combine=True)
    store.kv_batch_put(["a_0_0"], "t", {"x": _rows(2)})

    async def main():
        return await asyncio.gather(
            writes.put(["b_0_0"], "t", {"x": _rows(1)}),
            writes.put(["a_0_0"], "t", {"x": _rows(3)}),  # a different value: refused
            writes.put(["c_0_0"], "t", {"x": _rows(2)}), return_exceptions=True)

    b, a, c = asyncio.run(main())
    assert isinstance(a, FieldOverwriteError) and b.keys == ["b_0_0"] and c.keys == ["c_0_0"]
    assert store.kv_batch_get(["a_0_0"], "t", ["x"])["x"][0].tolist() == [0, 1]
    assert sorted(k for p in store.puts[1:] for k in p[0]) == ["a_0_0", "a_0_0", "b_0_0", "b_0_0", "c_0_0", "c_0_0"]


def test_without_combining_every_put_is_done_at_once():
    store = CountingStore()
    writes = GroupWrites(store)

    async def main():
        first = writes.put_nowait(["u"], "t", tags=[{"v": 1}])
        assert first.done() and len(store.puts) == 1  # no turn waited for
        return await writes.put(["w"], "t", tags=[{"v": 2}])

    assert asyncio.run(main()).keys == ["w"]


def test_run_groups_writes_three_combined_puts_and_each_group_in_order():
    """Many groups of instant sessions: one put of every running status, one of every trajectory, one of every
    final status; per group, running before its data before its final status, as run_group alone writes."""
    store = CountingStore()
    uids = [new_uid() for _ in range(6)]
    register_prompts(store, uids, 2)
    store.puts.clear()
    loop = SingleTurnAgentLoop(lambda ids, sp: ([ids[-1], 7, EOS], [-0.5] * 3), TOK, 8)
    metas = asyncio.run(run_groups(store, uids, [[1, 10 + i] for i in range(6)], 3, loop, 2))
    assert [m.extra_info["status"] for m in metas] == ["finished"] * 6
    assert len(store.puts) == 3
    assert store.puts[0][2] == ["running"] * 6 and store.puts[1][1] and store.puts[2][2] == ["finished"] * 6
    assert store.puts[1][0] == [k for m in metas for k in m.keys]
    got = store.kv_batch_get(metas[4].keys, "train", ["responses"])["responses"]
    assert got[:, 0].tolist() == [14] * 3


def test_run_groups_group_cleared_before_its_combined_write_is_reported_cleared_alone():
    uids = [new_uid() for _ in range(3)]

    class ClearsFirstGroup(CountingStore):
        def kv_batch_put(self, keys, partition_id, fields=None, tags=None, overwrite=False):
            if fields is not None and not self.puts[-1][1]:  # the combined trajectory put: clear group 0 first
                self.kv_clear([uids[0]], partition_id)
            return super().kv_batch_put(keys, partition_id, fields, tags, overwrite)

    store = ClearsFirstGroup()
    loop = SingleTurnAgentLoop(lambda ids, sp: ([5, EOS], None), TOK, 8)
    metas = asyncio.run(run_groups(store, uids, [[1]] * 3, 2, loop, 0))
    assert [m.extra_info["status"] for m in metas] == ["cleared", "finished", "finished"]
    assert metas[0].extra_info["dropped_trajectories"] == 2 and not metas[0].keys
    listed = store.kv_list("train")["train"]
    assert uids[0] not in listed and not any(k.startswith(uids[0]) for k in listed)
    assert all(listed[u]["status"] == "finished" for u in uids[1:])
    assert store.stats()["late_writes_refused"] >= 2


def test_run_groups_cancelled_marks_every_group_failed():
    store = LocalStore()
    uids = [new_uid() for _ in range(3)]

    started = []

    class Hang(AgentLoop):
        async def run(self, prompt, sampling_params=None, **kw):
            started.append(1)
            await asyncio.sleep(10)

    async def main():
        task = asyncio.create_task(run_groups(store, uids, [[1]] * 3, 2, Hang(lambda i, s: None), 0))
        while len(started) < 6:  # every session is running (a fixed sleep could end before a slow machine got there)
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [t["status"] for t in store.kv_batch_get_tags(uids, "train")] == ["failure"] * 3  # written already

    asyncio.run(main())
    tags = store.kv_batch_get_tags(uids, "train")
    assert [t["status"] for t in tags] == ["failure"] * 3
    assert all(t["errors"] == ["CancelledError: run_group was cancelled"] for t in tags)


def test_run_groups_keeps_a_late_write_of_one_group_from_touching_the_others():
    """A RUNNING status refused (its uid was cleared before the run) is that group's error; the rest finish."""
    store = LocalStore()
    uids = [new_uid() for _ in range(2)]
    store.kv_batch_put([uids[0]], "train", tags=[{"status": "pending"}])
    store.kv_clear([uids[0]], "train")
    loop = SingleTurnAgentLoop(lambda ids, sp: ([5, EOS], None), TOK, 8)
    with pytest.raises(LateWriteError):
        asyncio.run(run_groups(store, uids, [[1]] * 2, 1, loop, 0))
    assert store.kv_batch_get_tags([uids[1]], "train")[0]["status"] == "finished"
