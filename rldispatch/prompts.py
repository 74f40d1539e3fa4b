"""The training prompts as one stream: which dataset rows and uids each step (or each asynchronous submission)
takes, and the uid -> row map of every prompt taken and not yet trained on, which the reward stage scores against.

Prompt ``p`` of the stream is position ``p % B`` of step ``p // B``'s batch (``B = data.train_batch_size``), so a
synchronous step of ``B`` prompts takes exactly that step's batch, and an asynchronous schedule that takes prompts
in other counts (refills after evictions) walks the same sequence. Everything is derived from (seed, step): no
collective, and a resumed run takes the same prompts.
"""
from __future__ import annotations

import logging
import random
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from protocol.algos.reward import RewardError, needs_ground_truth
from protocol.rollout.dataset import DatasetError, RLHFDataset
from protocol.rollout.images import ImageError, VisionProcessor, load_image_processor
from rldispatch.config import ConfigError, RunConfig, vision_config

__all__ = ["PromptStream", "step_uids", "batch_indices", "load_datasets"]

logger = logging.getLogger(__name__)


def load_datasets(cfg: RunConfig, tokenizer: Any, is_main: bool) -> tuple[RLHFDataset, RLHFDataset]:
    """The training and validation sets; a file, row or column that cannot be used is a config error naming its key.

    Missing files of the configured task are generated first (rank 0), so the quick start needs no download. Every
    row's data_source and ground truth are checked against the scorers before step 0 (a custom reward function
    decides for itself which rows it can score)."""
    _ensure_data(cfg, is_main)
    d = cfg.data
    check = None if cfg.custom_reward_function.path else needs_ground_truth
    processor = _vision_processor(cfg, tokenizer)
    sets = []
    for key in ("train_files", "val_files"):
        try:
            sets.append(RLHFDataset(getattr(d, key), tokenizer, d.max_prompt_length, prompt_key=d.prompt_key,
                                    filter_overlong_prompts=d.filter_overlong_prompts, needs_ground_truth=check,
                                    processor=processor))
        except (DatasetError, RewardError, ImageError) as exc:  # every rank reads the same files: all stop alike
            raise ConfigError(f"data.{key}: {exc}") from exc
        readable = ("image",) if processor is not None else ()
        with_media = next((r for r in sets[-1].rows if set(r.get("multi_modal_data") or ()) - set(readable)), None)
        if with_media is not None:  # the policy would train on the prompt without what it refers to
            raise ConfigError(f"data.{key}: row {with_media['extra_info']['index']} carries "
                              f"{sorted(with_media['multi_modal_data'])} (multi_modal_data); the policy "
                              f"(model.hf_path={cfg.model.hf_path!r}) reads "
                              f"{'text and images' if processor is not None else 'text only'} (vision-language "
                              f"training: docs/multimodal.md), so such rows are refused rather than trained on "
                              f"without what they carry")
    if len(sets[0]) < d.train_batch_size:
        raise ConfigError(f"data.train_batch_size={d.train_batch_size} exceeds the {len(sets[0])} usable rows of "
                          f"data.train_files {d.train_files}")
    return sets[0], sets[1]


def _vision_processor(cfg: RunConfig, tokenizer: Any) -> VisionProcessor | None:
    """A vision-language policy's processor (its folder's image processor and the run's tokenizer), else None."""
    if vision_config(cfg) is None:
        return None
    try:
        return VisionProcessor(load_image_processor(cfg.model.hf_path), tokenizer)
    except ImageError as exc:
        raise ConfigError(f"model.hf_path: {exc}") from exc


def _ensure_data(cfg: RunConfig, is_main: bool) -> None:
    d = cfg.data
    missing = [f for f in [*d.train_files, *d.val_files] if not Path(f).exists()]
    failed = ""
    if missing and is_main:
        from protocol.rollout.tasks.data import write_task_data

        out_dirs = {str(Path(f).parent) for f in missing}
        try:
            for out in out_dirs:
                logger.info("generating task %r data into %s", d.task, out)
                write_task_data(out, d.task, train=d.train_size, val=d.val_size, seed=cfg.trainer.seed)
        except (OSError, ValueError) as exc:  # reach the barrier all the same: every rank then stops below
            failed = f" ({type(exc).__name__}: {exc})"
    dist.barrier()
    for key in ("train_files", "val_files"):
        still = [f for f in getattr(d, key) if not Path(f).exists()]
        if still:
            raise ConfigError(f"data.{key}: {still} not found, and data.task={d.task!r} could not generate "
                              f"them{failed}")


def step_uids(seed: int, step: int, count: int, partition: str = "train") -> list[str]:
    """The same fresh uids on every rank, derived from (seed, step): no collective, and a resumed run reuses them."""
    rng = random.Random(f"{partition}:{seed}:{step}")
    return [uuid.UUID(int=rng.getrandbits(128), version=4).hex for _ in range(count)]


def batch_indices(num_rows: int, batch_size: int, step: int, seed: int, shuffle: bool) -> list[int]:
    """Dataset rows of ``step``: an epoch-wise permutation seeded by (seed, epoch), so a resumed run sees the same."""
    per_epoch = num_rows // batch_size
    if per_epoch == 0:
        raise ValueError(f"the training set has {num_rows} rows, fewer than data.train_batch_size={batch_size}")
    epoch, pos = divmod(step, per_epoch)
    if shuffle:
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(num_rows, generator=g).tolist()
    else:
        order = list(range(num_rows))
    return order[pos * batch_size:(pos + 1) * batch_size]


def _runs(numbers: Sequence[int]) -> list[tuple[int, int]]:
    """``numbers`` as (start, length) runs of consecutive values, in order."""
    runs: list[tuple[int, int]] = []
    for p in numbers:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


class PromptStream:
    """The training set's prompts in stream order, and the prompts taken and not yet done with.

    Example::

        stream = PromptStream(dataset, batch_size=16, seed=0, shuffle=True)
        rows, uids = stream.take(16)          # the next 16 prompts, now outstanding
        stream.rows[uids[0]]                  # the row the reward stage scores uids[0]'s responses against
        stream.forget(uids)                   # trained on (or evicted)
    """

    def __init__(self, dataset: Any, batch_size: int, seed: int, shuffle: bool):
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.cursor = 0  # prompts taken from the stream so far
        self.rows: dict[str, dict] = {}  # uid -> dataset row of every prompt taken and not yet forgotten
        self.numbers: dict[str, int] = {}  # uid -> its position in the stream, for every prompt in rows

    def at(self, start: int, count: int) -> tuple[list[dict], list[str]]:
        """Prompts ``start .. start + count - 1`` of the stream (rows and uids); nothing is recorded."""
        B = self.batch_size
        rows, uids = [], []
        for batch in range(start // B, (start + count - 1) // B + 1):
            lo, hi = max(start - batch * B, 0), min(start + count - batch * B, B)
            idx = batch_indices(len(self.dataset), B, batch, self.seed, self.shuffle)[lo:hi]
            rows += [self.dataset[i] for i in idx]
            uids += step_uids(self.seed, batch, B)[lo:hi]
        return rows, uids

    def take(self, count: int, numbers: Sequence[int] | None = None) -> tuple[list[dict], list[str]]:
        """The stream's next ``count`` prompts (or exactly the prompts ``numbers``), recorded as outstanding."""
        if numbers is None:
            numbers = list(range(self.cursor, self.cursor + count))
            self.cursor += count
        rows, uids = [], []
        for start, run in _runs(numbers):
            r, u = self.at(start, run)
            rows += r
            uids += u
        self.rows.update(zip(uids, rows))
        self.numbers.update(zip(uids, numbers))
        return rows, uids

    def take_step(self, step: int) -> tuple[list[dict], list[str]]:
        """Step ``step``'s batch (a synchronous step), recorded as outstanding; the cursor moves past it."""
        self.cursor = step * self.batch_size
        return self.take(self.batch_size)

    def forget(self, uids: Sequence[str]) -> None:
        """Prompts trained on or evicted: no longer outstanding."""
        for uid in uids:
            self.rows.pop(uid, None)
            self.numbers.pop(uid, None)

    def outstanding(self) -> list[int]:
        """Stream positions of the prompts taken and not forgotten, in order."""
        return sorted(self.numbers.values())

    def position(self, uids: Sequence[str]) -> list[int]:
        """The stream positions of ``uids`` (outstanding prompts), in order."""
        return sorted(self.numbers[u] for u in uids)
