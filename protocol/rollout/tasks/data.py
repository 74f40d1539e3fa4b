"""Seeded generation of a task's train/val rows and their parquet files (no download)."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from protocol.rollout.tasks.base import TaskError, get_task

__all__ = ["make_rows", "write_task_data", "warmup_token_pairs"]


def make_rows(task: str, n: int, seed: int, split: str = "train", **params: Any) -> list[dict[str, Any]]:
    """``n`` dataset rows of ``task``; the same (task, n, seed, split, params) always gives the same rows.

    Each split draws from its own RNG stream, so val rows do not depend on how many train rows were made.
    """
    if not isinstance(n, int) or n < 0:
        raise TaskError(f"number of rows for split {split!r} must be an integer >= 0, got {n!r}")
    t = get_task(task, **params)
    rng = random.Random(f"{task}:{split}:{seed}")
    return [t.make_row(i, rng, split) for i in range(n)]


def write_task_data(out_dir: str | Path, task: str, train: int, val: int, seed: int = 0,
                    **params: Any) -> dict[str, Path]:
    """Write ``train.parquet`` and ``val.parquet`` of ``task`` into ``out_dir``; return their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", train), ("val", val)):
        rows = make_rows(task, n, seed, split, **params)
        if not rows:
            raise TaskError(f"--{split} must be >= 1 to write {split}.parquet, got {n}")
        path = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        paths[split] = path
    return paths


def warmup_token_pairs(task: str, n: int, seed: int, tokenizer: Any, **params: Any) -> list[tuple[list[int], list[int]]]:
    """``n`` supervised warm-up pairs ``(prompt_ids, response_ids)``: the chat-templated prompt and the answer + eos.

    A warm-up step through the actor engine needs no new loss: train on these responses with ``advantages = 1``
    and ``old_log_probs`` = the engine's own log-probs of them (so the PPO ratio is 1); the policy-loss gradient
    is then exactly the token-mean negative log-likelihood gradient.
    """
    t = get_task(task, **params)
    out = []
    for messages, target in t.warmup_pairs(n, seed):
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        out.append((prompt, list(tokenizer.encode(target)) + [tokenizer.eos_token_id]))
    return out
