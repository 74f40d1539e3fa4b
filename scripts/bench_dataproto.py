"""Benchmark DataProto pickling: consolidated (one buffer) vs naive TensorDict pickling vs numpy serialization.

A realistic batch: ``--n`` trajectories with jagged sequence lengths drawn from [--min-len, --max-len] (prompt and
response split at random), jagged int64 input_ids / position_ids / response_mask and float32 old_log_probs /
advantages over the response, dense reward_score, per-sample uid objects. Each method is timed on the whole
batch and on one of 4 chunks (a slice that views the whole batch's buffers). Prints a table of medians over
``--repeats`` runs and writes JSON with ``--out FILE.json``.

    python scripts/bench_dataproto.py --out bench_dataproto.json
"""
from __future__ import annotations

import argparse
import gc
import json
import pickle
import statistics
import time
import numpy as np
import torch

from protocol.batch.dataproto import DataProto, deserialize_tensordict, serialize_tensordict
from protocol.batch.nested import to_nested


def make_batch(n: int, min_len: int, max_len: int, seed: int) -> DataProto:
    """n trajectories with jagged fields of realistic lengths."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(min_len, max_len + 1, (n,), generator=g)
    prompt_lens = (seq_lens.float() * torch.rand(n, generator=g) * 0.5).long().clamp(min=1)
    resp_lens = seq_lens - prompt_lens
    input_ids = [torch.randint(0, 150_000, (int(s),), generator=g) for s in seq_lens]
    tensors = {
        "input_ids": to_nested(input_ids),
        "position_ids": to_nested([torch.arange(int(s)) for s in seq_lens]),
        "response_mask": to_nested([torch.ones(int(r), dtype=torch.int64) for r in resp_lens]),
        "old_log_probs": to_nested([-torch.rand(int(r), generator=g) for r in resp_lens]),
        "advantages": to_nested([torch.randn(int(r), generator=g) for r in resp_lens]),
        "reward_score": torch.randn(n, generator=g),
        "prompt_len": prompt_lens,
        "response_len": resp_lens,
    }
    return DataProto.from_dict(tensors, {"uid": [f"{i:032x}" for i in range(n)]}, {"global_steps": 1})


def naive_dumps(data: DataProto) -> bytes:
    """Pickle the three parts as they are, without consolidating the TensorDict."""
    return pickle.dumps((data.batch, data.non_tensor_batch, data.meta_info), protocol=pickle.HIGHEST_PROTOCOL)


def consolidated_dumps(data: DataProto) -> bytes:
    """Pickle through DataProto.__getstate__ (consolidated TensorDict)."""
    return pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)


def numpy_dumps(data: DataProto) -> bytes:
    """Pickle the numpy-bytes form from serialize_tensordict."""
    return pickle.dumps((serialize_tensordict(data.batch), data.non_tensor_batch, data.meta_info),
                        protocol=pickle.HIGHEST_PROTOCOL)


def numpy_loads(blob: bytes) -> object:
    raw, nt, meta = pickle.loads(blob)
    return DataProto(batch=deserialize_tensordict(raw), non_tensor_batch=nt, meta_info=meta)


def run(n: int, min_len: int, max_len: int, repeats: int, seed: int) -> list[dict]:
    """Time every (case, method) pair; repeats run round-robin so machine noise hits all methods alike."""
    data = make_batch(n, min_len, max_len, seed)
    cases = {"full batch": data, "1 of 4 chunks": data.chunk(4)[1]}
    methods = {"naive": (naive_dumps, pickle.loads), "consolidated": (consolidated_dumps, pickle.loads),
               "numpy": (numpy_dumps, numpy_loads)}
    pairs = [(case, name) for case in cases for name in methods]
    blobs = {(case, name): methods[name][0](cases[case]) for case, name in pairs}
    dumps_t: dict = {p: [] for p in pairs}
    loads_t: dict = {p: [] for p in pairs}
    for _ in range(repeats):
        for case, name in pairs:
            dumps, loads = methods[name]
            gc.collect()
            t0 = time.perf_counter()
            dumps(cases[case])
            t1 = time.perf_counter()
            loads(blobs[(case, name)])
            t2 = time.perf_counter()
            dumps_t[(case, name)].append(t1 - t0)
            loads_t[(case, name)].append(t2 - t1)
    return [{"case": case, "method": name, "samples": len(cases[case]), "bytes": len(blobs[(case, name)]),
             "dumps_s": statistics.median(dumps_t[(case, name)]), "loads_s": statistics.median(loads_t[(case, name)])}
            for case, name in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=str, default=None, help="write the results as JSON to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = run(args.n, args.min_len, args.max_len, args.repeats, args.seed)
    naive = {r["case"]: r for r in rows if r["method"] == "naive"}
    print(f"{'case':<14} {'method':<13} {'samples':>7} {'MB':>9} {'dumps ms':>9} {'loads ms':>9} "
          f"{'bytes/naive':>11} {'dumps/naive':>11} {'loads/naive':>11}")
    for r in rows:
        base = naive[r["case"]]
        r["bytes_ratio_vs_naive"] = r["bytes"] / base["bytes"]
        r["dumps_ratio_vs_naive"] = r["dumps_s"] / base["dumps_s"]
        r["loads_ratio_vs_naive"] = r["loads_s"] / base["loads_s"]
        print(f"{r['case']:<14} {r['method']:<13} {r['samples']:>7} {r['bytes'] / 2**20:>9.2f} "
              f"{r['dumps_s'] * 1e3:>9.1f} {r['loads_s'] * 1e3:>9.1f} {r['bytes_ratio_vs_naive']:>11.3f} "
              f"{r['dumps_ratio_vs_naive']:>11.3f} {r['loads_ratio_vs_naive']:>11.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "torch": torch.__version__, "numpy": np.__version__, "rows": rows},
                      f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
