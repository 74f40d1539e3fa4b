"""Data plane across 2 gloo ranks: replicated tags, point-to-point values, clear. Run by
tests/rldispatch/test_dataplane.py."""
from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict

from protocol.batch.nested import to_nested
from protocol.store import LocalStore
from rldispatch.dataplane import DataPlaneError, ShardedStore, first_part_bytes


def value_of(key: str) -> torch.Tensor:
    n = (sum(map(ord, key)) % 5) + 1 if not key.endswith("e") else 0  # "..._e" keys are empty responses
    return torch.arange(n, dtype=torch.float32) + len(key)


def main() -> None:
    dist.init_process_group("gloo")
    check()


def check() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    store = ShardedStore(LocalStore())
    keys = [f"u{rank}_{i}_0" for i in range(3)] + [f"u{rank}_9_e"]
    vals = [value_of(k) for k in keys]
    fields = TensorDict({"x": to_nested(vals), "score": torch.tensor([float(i) for i in range(4)])}, batch_size=[4])
    store.kv_batch_put(keys, "train", fields, [{"seq_len": len(v), "owner": rank} for v in vals])
    assert store.sync(also={"rank": rank}) == [{"rank": r} for r in range(world)]  # rides on the same round trip
    listing = store.kv_list("train")["train"]
    assert len(listing) == 4 * world, listing
    assert all(listing[f"u{r}_0_0"]["owner"] == r for r in range(world))

    # every rank fetches the other rank's keys plus one of its own, in an interleaved order
    other = (rank + 1) % world
    want = [f"u{other}_2_0", f"u{rank}_1_0", f"u{other}_9_e", f"u{other}_0_0"]
    got = store.fetch(want, "train", ["x", "score"])
    assert got.batch_size == torch.Size([4])
    for i, k in enumerate(want):
        torch.testing.assert_close(got["x"][i], value_of(k))
    assert got["score"].shape == (4,) and got["score"].tolist() == [2.0, 1.0, 3.0, 0.0]
    remote_bytes = store.bytes_received
    assert remote_bytes > 0, "values from the other rank must arrive by point-to-point transfer"

    # one rank holds the whole field (the other's keys, or this rank's own): its buffer comes back as the field
    for owner in (other, rank):
        mine = [f"u{owner}_{i}_0" for i in (0, 2)] + [f"u{owner}_9_e"]
        got = store.fetch(mine, "train", ["x", "score"])
        assert got["x"].is_nested and [r.tolist() for r in got["x"].unbind()] == [value_of(k).tolist() for k in mine]
        assert not got["score"].is_nested and got["score"].tolist() == [0.0, 2.0, 3.0]

    # fetching only local keys moves nothing
    before = store.bytes_received
    store.fetch([f"u{rank}_0_0"], "train", ["x"])
    assert store.bytes_received == before

    # a rank may ask for nothing while the other asks for something
    got = store.fetch(want if rank == 0 else [], "train", ["x"])
    assert len(got) == (4 if rank == 0 else 0)

    # a planned fetch (every rank names every rank's keys) gives what fetch gives, with no request sent
    wants = [[f"u{(r + 1) % world}_2_0", f"u{r}_1_0", f"u{(r + 1) % world}_0_0"] for r in range(world)]
    planned, asked = store.fetch_planned(wants, "train", ["x", "score"]), store.fetch(wants[rank], "train", ["x", "score"])
    assert [v.tolist() for v in planned["x"].unbind()] == [v.tolist() for v in asked["x"].unbind()]
    assert planned["score"].tolist() == asked["score"].tolist()
    assert store.holds(f"u{rank}_0_0", "x", "train") and not store.holds(f"u{other}_0_0", "x", "train")
    assert not store.holds(f"u{rank}_0_0", "nope", "train") and not store.holds("u9_9_9", "x", "train")
    listed = sorted(store.kv_list("train")["train"])
    assert store.split_by_holder(listed, "train", "x") == [[k for k in listed if k.startswith(f"u{r}_")]
                                                           for r in range(world)]

    # when every rank holds what it asks for, a planned fetch communicates not at all
    def no_collective(*_, **__):
        raise AssertionError("a planned fetch of held values communicated")

    saved = dist.all_gather, dist.batch_isend_irecv
    dist.all_gather = dist.batch_isend_irecv = no_collective
    try:
        local = store.fetch_planned([[f"u{r}_2_0", f"u{r}_0_0"] for r in range(world)], "train", ["x", "score"])
    finally:
        dist.all_gather, dist.batch_isend_irecv = saved
    assert [v.tolist() for v in local["x"].unbind()] == [value_of(f"u{rank}_{i}_0").tolist() for i in (2, 0)]
    try:
        store.fetch_planned(wants[:1], "train", ["x"])
    except ValueError as exc:
        assert "one per rank" in str(exc)
    else:
        raise AssertionError("a wants list of the wrong length was not refused")

    # a put every rank knows of reaches every rank's locations with no communication
    planned_puts = [[f"u{r}_1_0", f"u{r}_0_0"] for r in range(world)]
    store.kv_batch_put(planned_puts[rank], "train", TensorDict({"adv": torch.tensor([1.0, 0.0]) + 10 * rank},
                                                                batch_size=[2]))
    dist.all_gather = dist.batch_isend_irecv = no_collective
    try:
        store.sync_planned(planned_puts, "train", ["adv"])
    finally:
        dist.all_gather, dist.batch_isend_irecv = saved
    assert store.location(f"u{other}_0_0", "adv", "train") == other and not store._pending
    got = store.fetch([f"u{other}_0_0", f"u{rank}_1_0"], "train", ["adv"])
    assert got["adv"].tolist() == [10.0 * other, 1.0 + 10 * rank]
    # this rank's own entry must be its put: one it did not make, or one with another put of the field, is refused
    for puts in ([[f"u{r}_2_0"] for r in range(world)], planned_puts):
        if puts is planned_puts:
            store.kv_batch_put([f"u{rank}_2_0"], "train", TensorDict({"adv": torch.zeros(1)}, batch_size=[1]))
            store.kv_batch_put(planned_puts[rank], "train", TensorDict({"adv": torch.zeros(2)}, batch_size=[2]),
                               overwrite=True)
        try:
            store.sync_planned(puts, "train", ["adv"])
        except DataPlaneError as exc:
            assert "sync_planned" in str(exc) and "'adv'" in str(exc), exc
        else:
            raise AssertionError(f"a planned sync of puts this rank did not make alone was accepted: {puts}")
    store.sync()  # what was refused is still pending: a plain sync replicates it

    # ranks that name rank 0's keys in other orders: rank 0 refuses what it received instead of joining it; the
    # size-exchange path NCCL takes (gloo runs it too) gives the same values and the same refusal
    skewed = [list(w) for w in wants]
    if rank == 1:
        skewed[0] = [skewed[0][2], skewed[0][1], skewed[0][0]]
    for framed in (True, False):
        store._gloo = framed
        try:
            again = store.fetch_planned(wants, "train", ["x", "score"])
            assert [v.tolist() for v in again["x"].unbind()] == [v.tolist() for v in asked["x"].unbind()]
            assert again["score"].tolist() == asked["score"].tolist()
            try:
                store.fetch_planned(skewed, "train", ["x"])
            except DataPlaneError as exc:
                assert rank == 0 and "other keys" in str(exc), (rank, framed, exc)
            else:
                assert rank == 1, f"rank 0 joined values of keys it did not ask for (framed={framed})"
        finally:
            store._gloo = True

    # a missing field is named before any collective starts
    try:
        store.fetch([f"u{other}_0_0"], "train", ["nope"])
    except DataPlaneError as exc:
        assert "nope" in str(exc) and f"u{other}_0_0" in str(exc)
    else:
        raise AssertionError("missing field not refused")

    # a value longer than a frame's first part arrives in two parts, bit for bit
    size = first_part_bytes(world) // 4 + 1000
    store.kv_batch_put([f"u{rank}_5_0"], "train", TensorDict({"big": to_nested([torch.arange(size) * (rank + 1.0)])},
                                                             batch_size=[1]), [{"seq_len": 1}])
    store.sync()
    before = store.bytes_received
    got = store.fetch([f"u{other}_5_0", f"u{rank}_5_0"], "train", ["big"])
    assert torch.equal(got["big"][0], torch.arange(size) * (other + 1.0))
    assert torch.equal(got["big"][1], torch.arange(size) * (rank + 1.0))
    assert store.bytes_received - before > size * 4, "the long value came from the other rank"

    # tags written after the first sync reach the other rank at the next sync
    store.kv_batch_put([keys[0]], "train", tags=[{"status": "seen"}])
    store.sync()
    assert store.kv_list("train")["train"][f"u{other}_0_0"].get("status") == "seen"

    # clear everything everywhere: nothing is left on any rank
    all_keys = sorted(store.kv_list("train")["train"])
    store.kv_clear(all_keys, "train")
    assert store.num_keys() == 0 and store.local.stats()["keys"] == 0, store.local.stats()
    dist.barrier()
    if rank == 0:
        print(f"DATAPLANE OK bytes={remote_bytes}")


if __name__ == "__main__":
    from worker_exit import run_worker

    run_worker(main)
