"""The KV store contract, run against both stores: LocalStore and TransferQueueStore (real transfer_queue on Ray).

TransferQueue starts once for this module (about 20 s); each test works in its own partition.
"""
from __future__ import annotations

import asyncio
import random
import threading
import uuid

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from protocol.batch.nested import field_parts
from protocol.store.meta import KVBatchMeta
from protocol.store import (
    FieldOverwriteError,
    FieldShapeError,
    KVStore,
    LateWriteError,
    LocalStore,
    StoreClosedError,
    StoreKeyError,
)


def _jagged(parts):
    return torch.nested.as_nested_tensor(list(parts), layout=torch.jagged)


@pytest.fixture(scope="module")
def tq_store():
    pytest.importorskip("transfer_queue")
    from protocol.store import TransferQueueStore

    store = TransferQueueStore()
    yield store
    store.close()


@pytest.fixture(params=["local", pytest.param("tq", marks=pytest.mark.slow)])
def store(request) -> KVStore:
    if request.param == "local":
        s = LocalStore()
        yield s
        s.close()
    else:
        yield request.getfixturevalue("tq_store")


@pytest.fixture
def pid() -> str:
    return f"p{uuid.uuid4().hex[:8]}"


def _uid() -> str:
    return uuid.uuid4().hex


def _batch(n, lengths=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or [3 + (i * 5) % 7 for i in range(n)]
    return TensorDict(
        {
            "responses": _jagged([torch.randint(0, 100, (L,), generator=g) for L in lengths]),
            "old_log_probs": _jagged([torch.randn(L, generator=g) for L in lengths]),
            "hidden": _jagged([torch.randn(L, 2, generator=g) for L in lengths]),
            "reward_score": torch.randn(n, generator=g),
            "fixed": torch.randn(n, 4, generator=g),
        },
        batch_size=[n],
    )


def _keys(n):
    uid = _uid()
    return [f"{uid}_{i}_0" for i in range(n)]


def _assert_same(a: torch.Tensor, b: torch.Tensor):
    assert a.is_nested == b.is_nested
    if a.is_nested:
        assert [x.shape for x in a.unbind()] == [y.shape for y in b.unbind()]
        for x, y in zip(a.unbind(), b.unbind()):
            assert torch.equal(x, y)
    else:
        assert torch.equal(a, b)


# ---- round trip and the dense-or-jagged rule -----------------------------------------------------------
def test_put_get_roundtrip_in_key_order(store, pid):
    keys = _keys(4)
    td = _batch(4)
    meta = store.kv_batch_put(keys, pid, td, tags=[{"seq_len": i} for i in range(4)])
    assert isinstance(meta, KVBatchMeta) and meta.keys == keys and meta.tag_values("seq_len") == [0, 1, 2, 3]
    order = [2, 0, 3, 1]
    got = store.kv_batch_get([keys[i] for i in order], pid)
    assert got.batch_size == torch.Size([4])
    assert set(got.keys()) == set(td.keys())
    for name in td.keys():
        want = td[name]
        rows = want.unbind(0)
        if want.is_nested:
            _assert_same(got[name], _jagged([rows[i] for i in order]))
        else:
            assert torch.equal(got[name], torch.stack([rows[i] for i in order]))
    assert got["hidden"].is_nested and got["hidden"].shape[2] == 2
    assert not got["fixed"].is_nested and got["fixed"].shape == (4, 4)
    assert got["reward_score"].shape == (4,)


def test_select_fields_returns_only_those(store, pid):
    keys = _keys(3)
    store.kv_batch_put(keys, pid, _batch(3))
    got = store.kv_batch_get(keys, pid, select_fields=["old_log_probs"])
    assert list(got.keys()) == ["old_log_probs"]
    got = store.kv_batch_get(keys, pid, select_fields="reward_score")
    assert list(got.keys()) == ["reward_score"]


def test_equal_lengths_come_back_dense_unless_asked_jagged(store, pid):
    keys = _keys(3)
    store.kv_batch_put(keys, pid, _batch(3, lengths=[5, 5, 5]))
    got = store.kv_batch_get(keys, pid, ["responses"])
    assert not got["responses"].is_nested and got["responses"].shape == (3, 5)
    got = store.kv_batch_get(keys, pid, ["responses", "fixed"], jagged=["responses", "fixed"])
    assert got["responses"].is_nested and got["fixed"].is_nested
    assert [t.shape[0] for t in got["fixed"].unbind()] == [4, 4, 4]


def test_fields_as_dict_of_lists_and_dense(store, pid):
    keys = _keys(2)
    store.kv_batch_put(keys, pid, {"a": [torch.arange(2), torch.arange(4)], "b": torch.tensor([1, 2])})
    got = store.kv_batch_get(keys, pid)
    _assert_same(got["a"], _jagged([torch.arange(2), torch.arange(4)]))
    assert torch.equal(got["b"], torch.tensor([1, 2]))


def test_kv_put_single_key(store, pid):
    key = f"{_uid()}_0_0"
    meta = store.kv_put(key, pid, {"responses": torch.arange(5), "score": torch.tensor(1.5)}, tag={"x": 1})
    assert meta.keys == [key] and meta.tags == [{"x": 1}]
    store.kv_put(key, pid, tag={"y": 2})
    store.kv_put(key, pid, TensorDict({"more": torch.ones(2)}, batch_size=[]))
    got = store.kv_batch_get([key], pid)
    assert torch.equal(got["responses"], torch.arange(5).unsqueeze(0))
    assert got["score"].shape == (1,) and float(got["score"][0]) == 1.5
    assert torch.equal(got["more"], torch.ones(1, 2))
    assert store.kv_batch_get_tags([key], pid) == [{"x": 1, "y": 2}]


def test_empty_key_list(store, pid):
    assert len(store.kv_batch_put([], pid, tags=[])) == 0
    assert store.kv_batch_get([], pid).batch_size == torch.Size([0])
    assert store.kv_clear([], pid) == 0
    assert pid not in store.kv_list() and store.kv_list(pid) == {pid: {}}


# ---- tags --------------------------------------------------------------------------------------------
def test_tags_merge_and_new_fields_add(store, pid):
    keys = _keys(2)
    store.kv_batch_put(keys, pid, tags=[{"status": "pending", "a": 1}, {"status": "pending"}])
    store.kv_batch_put(keys, pid, TensorDict({"x": torch.ones(2, 3)}, [2]))
    meta = store.kv_batch_put(keys, pid, TensorDict({"y": torch.zeros(2)}, [2]),
                              tags=[{"status": "running"}, {"b": np.int64(7)}])
    assert meta.tags == [{"status": "running", "a": 1}, {"status": "pending", "b": 7}]
    assert type(meta.tags[1]["b"]) is int
    assert sorted(store.kv_batch_get(keys, pid).keys()) == ["x", "y"]
    assert store.kv_batch_get_tags(keys[::-1], pid) == meta.tags[::-1]
    assert store.kv_batch_get_meta(keys, pid).tags == meta.tags


def test_kv_list_is_tags_only_and_copies(store, pid):
    keys = _keys(2)
    store.kv_batch_put(keys, pid, _batch(2), tags=[{"i": 0}, {"i": 1}])
    listed = store.kv_list(pid)
    assert listed == {pid: {keys[0]: {"i": 0}, keys[1]: {"i": 1}}}
    listed[pid][keys[0]]["i"] = 99
    assert store.kv_list(pid)[pid][keys[0]] == {"i": 0}
    assert pid in store.kv_list()
    empty = f"{pid}_none"
    assert store.kv_list(empty) == {empty: {}}
    assert empty not in store.kv_list()


def test_get_by_meta(store, pid):
    keys = _keys(3)
    meta = store.kv_batch_put(keys, pid, _batch(3))
    got = store.kv_batch_get_by_meta(meta.reorder([2, 1, 0]), ["reward_score"])
    assert torch.equal(got["reward_score"], _batch(3)["reward_score"].flip(0))
    with pytest.raises(TypeError, match="KVBatchMeta"):
        store.kv_batch_get_by_meta(keys)


# ---- overwrite rule ------------------------------------------------------------------------------------
def test_overwrite_refused_identical_is_noop_and_overwrite_true_replaces(store, pid):
    keys = _keys(2)
    td = _batch(2)
    store.kv_batch_put(keys, pid, td)
    before = store.stats()["overwrites_refused"]
    store.kv_batch_put(keys, pid, td.clone())  # identical: no-op
    changed = td.clone()
    changed["reward_score"] = changed["reward_score"] + 1
    with pytest.raises(FieldOverwriteError, match=r"1 \(key, field\)|2 \(key, field\)") as info:
        store.kv_batch_put(keys, pid, TensorDict({"reward_score": changed["reward_score"],
                                                  "brand_new": torch.ones(2)}, [2]))
    assert "overwrite=True" in str(info.value) and "reward_score" in str(info.value)
    assert store.stats()["overwrites_refused"] - before == 2
    got = store.kv_batch_get(keys, pid)
    assert torch.equal(got["reward_score"], td["reward_score"])  # nothing written ...
    assert "brand_new" not in got.keys()  # ... not even the new field of the refused batch
    store.kv_batch_put(keys, pid, TensorDict({"reward_score": changed["reward_score"]}, [2]), overwrite=True)
    assert torch.equal(store.kv_batch_get(keys, pid, ["reward_score"])["reward_score"], changed["reward_score"])


def test_overwrite_with_other_length_or_dtype_is_a_change(store, pid):
    key = f"{_uid()}_0_0"
    store.kv_put(key, pid, {"r": torch.arange(3)})
    with pytest.raises(FieldOverwriteError):
        store.kv_put(key, pid, {"r": torch.arange(4)})
    with pytest.raises(FieldOverwriteError):
        store.kv_put(key, pid, {"r": torch.arange(3, dtype=torch.int32)})
    store.kv_put(key, pid, {"f": torch.tensor([float("nan"), 1.0])})
    store.kv_put(key, pid, {"f": torch.tensor([float("nan"), 1.0])})  # NaN equals NaN: identical


# ---- late writes ---------------------------------------------------------------------------------------
def test_late_writes_refused_and_counted(store, pid):
    uid, other = _uid(), _uid()
    traj = [f"{uid}_{i}_0" for i in range(3)]
    store.kv_put(uid, pid, tag={"is_prompt": True, "status": "running"})
    store.kv_batch_put(traj[:2], pid, _batch(2))
    base = store.stats()["late_writes_refused"]

    store.kv_clear([uid], pid)  # the prompt key: group cleared
    with pytest.raises(LateWriteError, match=r"1 cleared key\(s\)") as info:
        store.kv_put(traj[2], pid, {"x": torch.ones(1)})  # new trajectory of the cleared group
    assert traj[2] in str(info.value)
    with pytest.raises(LateWriteError):
        store.kv_put(uid, pid, tag={"status": "finished"})  # the prompt key itself
    # keys still present are not late: the trainer may score them after the group was cleared
    store.kv_batch_put(traj[:2], pid, TensorDict({"adv": torch.ones(2)}, [2]))

    store.kv_clear([traj[0]], pid)  # a trajectory key alone
    with pytest.raises(LateWriteError):
        store.kv_put(traj[0], pid, tag={"a": 1})
    # a mixed batch is refused as a whole
    fresh = f"{other}_0_0"
    with pytest.raises(LateWriteError):
        store.kv_batch_put([fresh, traj[0]], pid, tags=[{}, {}])
    assert store.kv_list(pid)[pid].keys() == {traj[1]}
    assert store.stats()["late_writes_refused"] - base == 4
    # a new uid works, and so does another partition
    store.kv_put(fresh, pid, tag={"a": 1})
    store.kv_put(traj[2], f"{pid}_other", tag={"a": 1})
    store.kv_clear([f"{other}_9_9"], pid, mark_cleared=False)
    store.kv_put(f"{other}_9_9", pid, tag={"ok": True})


# ---- missing keys / fields -----------------------------------------------------------------------------
def test_missing_keys_named_with_count(store, pid):
    keys = _keys(2)
    store.kv_batch_put(keys, pid, _batch(2))
    ghosts = [f"ghost{i}" for i in range(7)]
    with pytest.raises(StoreKeyError) as info:
        store.kv_batch_get(keys + ghosts, pid)
    msg = str(info.value)
    assert "7 key(s)" in msg and "ghost0" in msg and "ghost4" in msg and "ghost5" not in msg and "7 in total" in msg
    with pytest.raises(KeyError):
        store.kv_batch_get_tags(["ghost"], pid)
    with pytest.raises(StoreKeyError, match="not in partition"):
        store.kv_batch_get(keys, f"{pid}_absent")


def test_missing_fields_named(store, pid):
    keys = _keys(3)
    store.kv_batch_put(keys, pid, _batch(3))
    store.kv_put(keys[0], pid, {"only_first": torch.ones(2)})
    with pytest.raises(StoreKeyError, match=r"2 \(key, field\) pair\(s\)") as info:
        store.kv_batch_get(keys, pid, ["reward_score", "only_first"])
    assert keys[1] in str(info.value) and "only_first" in str(info.value)
    with pytest.raises(StoreKeyError, match="nope"):
        store.kv_batch_get(keys, pid, ["nope"])
    with pytest.raises(StoreKeyError, match="only_first"):  # select_fields=None: every key must hold the same
        store.kv_batch_get(keys, pid)
    assert torch.equal(store.kv_batch_get(keys[:1], pid, ["only_first"])["only_first"], torch.ones(1, 2))


# ---- input errors --------------------------------------------------------------------------------------
def test_input_errors(store, pid):
    keys = _keys(2)
    with pytest.raises(ValueError, match="give fields, tags, or both"):
        store.kv_batch_put(keys, pid)
    with pytest.raises(FieldShapeError, match="does not match 2 keys"):
        store.kv_batch_put(keys, pid, _batch(3))
    with pytest.raises(FieldShapeError, match=r"field 'a'.*3 entries, expected 2"):
        store.kv_batch_put(keys, pid, {"a": torch.ones(3)})
    with pytest.raises(ValueError, match="got 1 tags for 2 keys"):
        store.kv_batch_put(keys, pid, tags=[{}])
    with pytest.raises(TypeError, match=r"tag 'x' of key .*\.item\(\)"):
        store.kv_batch_put(keys, pid, tags=[{"x": torch.tensor(1)}, {}])
    with pytest.raises(ValueError, match="unique"):
        store.kv_batch_put([keys[0], keys[0]], pid, tags=[{}, {}])
    with pytest.raises(TypeError, match="partition_id"):
        store.kv_batch_put(keys, "", tags=[{}, {}])
    with pytest.raises(TypeError, match="field 'a'"):
        store.kv_batch_put(keys, pid, {"a": ["x", "y"]})
    with pytest.raises(TypeError, match="fields must be"):
        store.kv_batch_put(keys, pid, [torch.ones(2)])
    with pytest.raises(ValueError, match="give fields, a tag"):
        store.kv_put(keys[0], pid)
    with pytest.raises(TypeError, match="single-key value"):
        store.kv_put(keys[0], pid, {"a": _jagged([torch.ones(2)])})
    with pytest.raises(TypeError, match="select_fields"):
        store.kv_batch_get(keys, pid, [3])
    assert store.kv_list(pid) == {pid: {}}  # nothing was written by any refused call


def test_inconsistent_field_values_refused_at_get(store, pid):
    keys = _keys(2)
    store.kv_put(keys[0], pid, {"a": torch.ones(2, 3)})
    store.kv_put(keys[1], pid, {"a": torch.ones(2, 4)})
    with pytest.raises(FieldShapeError, match="field 'a'.*differ only in dim 0"):
        store.kv_batch_get(keys, pid, ["a"])


# ---- memory, copies, concurrency ----------------------------------------------------------------------
def test_clear_frees_everything_after_many_cycles(store, pid):
    base = store.stats()
    for cycle in range(5):
        keys = _keys(6)
        uid = keys[0].split("_")[0]
        store.kv_put(uid, pid, tag={"is_prompt": True})
        store.kv_batch_put(keys, pid, _batch(6, seed=cycle), tags=[{"c": cycle}] * 6)
        store.kv_batch_put(keys, pid, TensorDict({"adv": torch.ones(6)}, [6]))
        assert store.kv_batch_get(keys, pid, ["adv"])["adv"].shape == (6,)
        assert store.stats()["bytes"] > base["bytes"]
        assert store.kv_clear(keys + [uid], pid) == 7
    after = store.stats()
    assert store.kv_list(pid) == {pid: {}}
    assert (after["keys"], after["bytes"], after["fields"]) == (base["keys"], base["bytes"], base["fields"])


def test_returned_and_input_tensors_are_copies(store, pid):
    keys = _keys(2)
    td = _batch(2, lengths=[3, 3])
    store.kv_batch_put(keys, pid, td)
    expected = td["fixed"].clone()
    td["fixed"].add_(100)
    got = store.kv_batch_get(keys, pid, ["fixed"])
    assert torch.equal(got["fixed"], expected)
    got["fixed"].add_(5)
    assert torch.equal(store.kv_batch_get(keys, pid, ["fixed"])["fixed"], expected)


def test_concurrent_threads_distinct_keys_and_shared_tag_merge(store, pid):
    shared = f"{_uid()}_0_0"
    store.kv_put(shared, pid, tag={"start": True})
    n_threads, per_thread = 6, 4
    errors = []

    def work(t):
        try:
            keys = [f"{_uid()}_{t}_{i}" for i in range(per_thread)]
            store.kv_batch_put(keys, pid, _batch(per_thread, seed=t), tags=[{"t": t}] * per_thread)
            for i in range(3):
                store.kv_put(shared, pid, tag={f"t{t}_{i}": i})
            got = store.kv_batch_get(keys, pid, ["reward_score"])
            assert torch.equal(got["reward_score"], _batch(per_thread, seed=t)["reward_score"])
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    listed = store.kv_list(pid)[pid]
    assert len(listed) == 1 + n_threads * per_thread
    assert listed[shared] == {"start": True, **{f"t{t}_{i}": i for t in range(n_threads) for i in range(3)}}


def test_concurrent_asyncio_tasks(store, pid):
    shared = f"{_uid()}"

    async def one(i):
        key = f"{shared}_{i}_0"
        await store.async_kv_put(key, pid, {"r": torch.arange(i + 1)}, tag={"i": i})
        await store.async_kv_batch_put([shared], pid, tags=[{f"s{i}": True}])
        return key

    async def main():
        await store.async_kv_put(shared, pid, tag={"is_prompt": True})
        keys = await asyncio.gather(*(one(i) for i in range(8)))
        got = await store.async_kv_batch_get(list(keys), pid, ["r"])
        listed = await store.async_kv_list(pid)
        cleared = await store.async_kv_clear(list(keys) + [shared], pid)
        return keys, got, listed, cleared

    keys, got, listed, cleared = asyncio.run(main())
    assert [t.shape[0] for t in got["r"].unbind()] == list(range(1, 9))
    assert listed[pid][shared] == {"is_prompt": True, **{f"s{i}": True for i in range(8)}}
    assert cleared == 9


# ---- the store against a plain-dict model ----------------------------------------------------------------
class DictModel:
    """The contract in a few lines: what every store must agree with."""

    def __init__(self):
        self.data: dict[tuple[str, str], tuple[dict, dict]] = {}
        self.cleared: set[tuple[str, str]] = set()

    def put(self, pid, keys, fields, tags, overwrite):
        new = [k for k in keys if (pid, k) not in self.data]
        if any((pid, k) in self.cleared or (pid, k.split("_", 1)[0]) in self.cleared for k in new):
            return "late"
        for name, rows in (fields or {}).items():
            for k, v in zip(keys, rows):
                old = self.data.get((pid, k), ({}, {}))[1].get(name)
                if old is not None and not torch.equal(old, v) and not overwrite:
                    return "overwrite"
        for i, k in enumerate(keys):
            tag, flds = self.data.setdefault((pid, k), ({}, {}))
            tag.update(tags[i] if tags else {})
            for name, rows in (fields or {}).items():
                flds[name] = rows[i]
        return "ok"

    def get(self, pid, keys, name):
        if any((pid, k) not in self.data for k in keys):
            return "missing"
        if any(name not in self.data[(pid, k)][1] for k in keys):
            return "missing"
        return [self.data[(pid, k)][1][name] for k in keys]

    def clear(self, pid, keys):
        n = sum(1 for k in keys if self.data.pop((pid, k), None) is not None)
        self.cleared.update((pid, k) for k in keys)
        return n

    def listing(self, pid):
        return {k: t for (p, k), (t, _) in self.data.items() if p == pid}


def run_against_model(store: KVStore, ops: list[tuple], pids: list[str]) -> None:
    """Apply ``ops`` to the store and the model; every result (value or error kind) must agree."""
    model = DictModel()
    for op in ops:
        kind, p = op[0], pids[op[1]]
        if kind == "put":
            _, _, keys, name, lengths, vals, tagv, overwrite = op
            fields = None
            if name is not None:
                fields = {name: [torch.full((L,), float(v)) for L, v in zip(lengths, vals)]}
            tags = [{"v": tagv}] * len(keys)
            expect = model.put(p, keys, fields, tags, overwrite)
            try:
                store.kv_batch_put(keys, p, fields, tags, overwrite=overwrite)
                got = "ok"
            except LateWriteError:
                got = "late"
            except FieldOverwriteError:
                got = "overwrite"
            assert got == expect, op
        elif kind == "get":
            _, _, keys, name = op
            expect = model.get(p, keys, name)
            try:
                td = store.kv_batch_get(keys, p, [name])
                value = td[name]
                got = list(value.unbind(0))
                # the packed read (what a transfer sends) is the same field, flat
                (flat, offsets), want = store.kv_batch_get_packed(keys, p, [name])[name], field_parts(value)
                assert torch.equal(flat, want[0]) and flat.dtype == want[0].dtype, op
                assert (offsets is None) == (want[1] is None) and (offsets is None or torch.equal(offsets, want[1])), op
            except StoreKeyError:
                got = "missing"
            if expect == "missing" or got == "missing":
                assert got == expect, op
            else:
                assert len(got) == len(expect) and all(torch.equal(a, b) for a, b in zip(got, expect)), op
        elif kind == "clear":
            _, _, keys = op
            assert store.kv_clear(keys, p) == model.clear(p, keys), op
        assert store.kv_list(p)[p] == model.listing(p), op


_KEY_POOL = ["aa", "aa_0_0", "aa_1_0", "bb_0_0", "bb_0_1", "bb", "cc_0_0", "dd_0_0", "dd_1_0"]


def random_ops(rng: random.Random, n_ops: int) -> list[tuple]:
    ops = []
    for _ in range(n_ops):
        kind = rng.choices(["put", "get", "clear"], weights=[5, 3, 1])[0]
        p = rng.randrange(2)
        keys = rng.sample(_KEY_POOL, rng.randint(1, 3))
        if kind == "put":
            name = rng.choice([None, "f", "g"])
            lengths = [rng.randint(1, 3) for _ in keys]
            vals = [rng.randint(0, 1) for _ in keys]
            ops.append(("put", p, keys, name, lengths, vals, rng.randint(0, 2), rng.random() < 0.3))
        elif kind == "get":
            ops.append(("get", p, keys, rng.choice(["f", "g"])))
        else:
            ops.append(("clear", p, keys[:2]))
    return ops


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_sequences_agree_with_model(store, pid, seed):
    run_against_model(store, random_ops(random.Random(seed), 30), [pid, f"{pid}_b"])


def test_closed_store_refuses(pid):
    s = LocalStore()
    s.kv_put("a", pid, tag={})
    s.close()
    with pytest.raises(StoreClosedError, match="closed"):
        s.kv_batch_get(["a"], pid)
    with pytest.raises(StoreClosedError):
        s.kv_put("b", pid, tag={})


# ---- TransferQueue only: marks live in the queue, not in one adapter instance ---------------------------------
@pytest.mark.slow
def test_tq_clear_marks_seen_by_another_instance_and_process(tq_store, pid):
    import ray

    from protocol.store import TransferQueueStore
    from protocol.store.tq import MARKS_PREFIX

    uid = _uid()
    tq_store.kv_put(uid, pid, tag={"is_prompt": True})
    tq_store.kv_clear([uid], pid)
    other = TransferQueueStore()  # attaches to the running queue
    try:
        with pytest.raises(LateWriteError):
            other.kv_put(f"{uid}_0_0", pid, tag={"late": True})
        with pytest.raises(ValueError, match="reserved"):
            other.kv_list(MARKS_PREFIX + pid)
    finally:
        other.close()
    assert tq_store.kv_list(pid) == {pid: {}}  # closing an attached instance leaves the queue running

    @ray.remote(num_cpus=0)
    def late_writer(key: str, partition: str) -> str:
        from protocol.store import LateWriteError as Late, TransferQueueStore as Store

        store = Store()
        try:
            store.kv_put(key, partition, tag={"late": True})
            return "written"
        except Late:
            return "refused"
        finally:
            store.close()

    assert ray.get(late_writer.remote(f"{uid}_1_0", pid), timeout=120) == "refused"
    assert ray.get(late_writer.remote(f"{_uid()}_0_0", pid), timeout=120) == "written"
    assert uid in tq_store._tq.kv_list(MARKS_PREFIX + pid)[MARKS_PREFIX + pid]  # the mark is in the queue ...
    assert not [p for p in tq_store.kv_list() if p.startswith(MARKS_PREFIX)]  # ... and hidden from kv_list()


@pytest.mark.slow
def test_tq_marks_bounded_per_instance(tq_store, pid):
    from protocol.store import TransferQueueStore
    from protocol.store.tq import MARKS_PREFIX

    small = TransferQueueStore(max_cleared_marks=3)
    try:
        keys = [_uid() for _ in range(5)]
        small.kv_batch_put(keys, pid, tags=[{}] * 5)
        small.kv_clear(keys, pid)
        marks = small._tq.kv_list(MARKS_PREFIX + pid).get(MARKS_PREFIX + pid, {})
        assert set(marks) == set(keys[2:])
        small.kv_put(keys[0], pid, tag={"again": True})  # its mark was forgotten
        with pytest.raises(LateWriteError):
            small.kv_put(keys[4], pid, tag={})
        small.kv_clear([keys[0]], pid, mark_cleared=False)
    finally:
        small.close()


def test_tag_reads_are_deep_copies(store, pid):
    """A caller editing a nested value of a tag it read (a status's error list) never edits the store's tag."""
    keys = _keys(2)
    store.kv_batch_put(keys, pid, tags=[{"errors": ["a"], "m": {"x": [1]}}, {"errors": []}])
    got = store.kv_batch_get_tags(keys, pid)
    got[0]["errors"].append("edited")
    got[0]["m"]["x"].append(2)
    listed = store.kv_list(pid)[pid]
    listed[keys[1]]["errors"].append("edited")
    assert store.kv_batch_get_tags(keys, pid) == [{"errors": ["a"], "m": {"x": [1]}}, {"errors": []}]
    meta = store.kv_batch_get_meta(keys, pid)
    meta.tags[0]["errors"].append("edited")
    assert store.kv_list(pid)[pid][keys[0]] == {"errors": ["a"], "m": {"x": [1]}}
