"""Store throughput: kv_batch_put / kv_batch_get of a realistic batch against a plain torch.cat of the same bytes.

A batch of N trajectories with response lengths drawn uniformly from [min_len, max_len] and the fields a
training step moves (responses, response_mask, old_log_probs, advantages: jagged; reward_score: dense).
Reports the median over repeats of: put (all fields), get (all fields), get of one field, and the
torch.cat floor for the same bytes; the one-field get shows that select_fields reads only what it names.

    .venv/bin/python scripts/bench_store.py                      # LocalStore, 1024 trajectories
    .venv/bin/python scripts/bench_store.py --store tq --n 256   # real TransferQueue (starts Ray)
    .venv/bin/python scripts/bench_store.py --out store.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocol.store import LocalStore  # noqa: E402

JAGGED = {"responses": torch.int64, "response_mask": torch.int64, "old_log_probs": torch.float32,
          "advantages": torch.float32}


def make_batch(n: int, min_len: int, max_len: int, seed: int) -> tuple[TensorDict, list[int]]:
    """A TensorDict of n trajectories: four jagged response-length fields and one dense score."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    fields = {}
    for name, dtype in JAGGED.items():
        parts = [torch.randint(0, 1000, (L,), generator=g).to(dtype) for L in lengths]
        fields[name] = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    fields["reward_score"] = torch.randn(n, generator=g)
    return TensorDict(fields, batch_size=[n]), lengths


def td_bytes(td: TensorDict) -> int:
    total = 0
    for name in td.keys():
        v = td[name]
        t = v.values() if v.is_nested else v
        total += t.numel() * t.element_size()
    return total


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median wall time of ``repeats`` calls after one warm-up call, and the last result."""
    fn()
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    if args.store == "local":
        store = LocalStore()
    else:
        from protocol.store import TransferQueueStore

        store = TransferQueueStore()
    try:
        batch, lengths = make_batch(args.n, args.min_len, args.max_len, args.seed)
        all_bytes = td_bytes(batch)
        one = "old_log_probs"
        one_bytes = td_bytes(batch.select(one))
        keys = [f"bench{i:05d}_0_0" for i in range(args.n)]

        # torch.cat floor: one copy of every field's values (what any batched copy of these bytes costs)
        parts = {name: list(batch[name].unbind(0)) for name in JAGGED}

        def cat_all():
            return [torch.cat(p) for p in parts.values()]

        t_cat, _ = timed(cat_all, args.repeats)

        def put():
            store.kv_clear(keys, "bench", mark_cleared=False)
            t0 = time.perf_counter()
            store.kv_batch_put(keys, "bench", batch)
            return time.perf_counter() - t0

        put()  # warm-up
        put_times = [put() for _ in range(args.repeats)]
        t_put = statistics.median(put_times)
        t_get_all, got = timed(lambda: store.kv_batch_get(keys, "bench"), args.repeats)
        assert td_bytes(got) == all_bytes
        t_get_one, got_one = timed(lambda: store.kv_batch_get(keys, "bench", [one]), args.repeats)
        assert list(got_one.keys()) == [one] and td_bytes(got_one) == one_bytes
        held = store.stats()["bytes"]
        store.kv_clear(keys, "bench")
        rows = [
            ("torch.cat floor (all jagged)", t_cat, all_bytes - args.n * 4),
            ("kv_batch_put (all fields)", t_put, all_bytes),
            ("kv_batch_get (all fields)", t_get_all, all_bytes),
            (f"kv_batch_get ([{one!r}])", t_get_one, one_bytes),
        ]
        result = {
            "store": args.store, "n": args.n, "min_len": args.min_len, "max_len": args.max_len,
            "mean_len": sum(lengths) / len(lengths), "repeats": args.repeats, "bytes_all_fields": all_bytes,
            "bytes_one_field": one_bytes, "bytes_held_after_put": held,
            "rows": [{"op": op, "median_s": t, "bytes": b, "GB_per_s": b / t / 1e9} for op, t, b in rows],
            "one_field_time_fraction": t_get_one / t_get_all,
            "one_field_byte_fraction": one_bytes / all_bytes,
        }
    finally:
        store.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", choices=["local", "tq"], default="local")
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=str, default=None, help="write the result as JSON to this file")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = run(args)
    print(f"store={res['store']} n={res['n']} lengths {res['min_len']}..{res['max_len']} "
          f"(mean {res['mean_len']:.0f}), median of {res['repeats']}")
    print(f"{'operation':34s} {'median ms':>10s} {'MB':>9s} {'GB/s':>7s}")
    for r in res["rows"]:
        print(f"{r['op']:34s} {r['median_s'] * 1e3:10.1f} {r['bytes'] / 1e6:9.1f} {r['GB_per_s']:7.2f}")
    print(f"one field: {res['one_field_byte_fraction']:.0%} of the bytes, "
          f"{res['one_field_time_fraction']:.0%} of the time of a full get")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
