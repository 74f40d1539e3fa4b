"""Write a learnable task's train/val parquet files in the reference system's row format (no download).

    rldispatch data --task repeat --out-dir data/repeat --train 2048 --val 64 --seed 0
    rldispatch data --task arithmetic --out-dir data/arithmetic   # GSM8K-style rows, data_source openai/gsm8k
    rldispatch data --task arithmetic --steps 1 --out-dir data/arithmetic_1step   # one-step problems
"""
from __future__ import annotations

import argparse
import sys

from protocol.rollout.tasks import TaskError, known_tasks, write_task_data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", required=True, help="directory for train.parquet and val.parquet")
    ap.add_argument("--task", default="repeat", choices=known_tasks(), help="task (the rows' data_source)")
    ap.add_argument("--train", type=int, default=2000, help="number of train rows")
    ap.add_argument("--val", type=int, default=128, help="number of val rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alphabet", default=None, help="characters words are drawn from (default: the task's)")
    ap.add_argument("--min-len", type=int, default=None, help="shortest word (default: the task's)")
    ap.add_argument("--max-len", type=int, default=None, help="longest word (default: the task's)")
    ap.add_argument("--length-weight", type=float, default=None,
                    help="weight of the length term in the score (default: the task's, 0.5)")
    ap.add_argument("--max-operand", type=int, default=None,
                    help="arithmetic: the largest number in a problem (default: the task's, 12)")
    ap.add_argument("--steps", type=int, default=None,
                    help="arithmetic: operations per problem, 1 (a training curriculum) or 2 (default)")
    args = ap.parse_args(argv)
    params = {k: v for k, v in (("alphabet", args.alphabet), ("min_len", args.min_len), ("max_len", args.max_len),
                                ("length_weight", args.length_weight), ("max_operand", args.max_operand),
                                ("steps", args.steps))
              if v is not None}
    try:
        paths = write_task_data(args.out_dir, args.task, args.train, args.val, args.seed, **params)
    except TaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
