"""Per-step metrics: padding-aware reductions, stage timers, and a JSONL (+ TensorBoard) logger."""
from __future__ import annotations

import json
import logging
import math
import os
import time
from numbers import Real
from pathlib import Path
from typing import Any, Mapping

import torch

from protocol.batch.nested import nested_offsets, nested_values

__all__ = [
    "MetricsError", "MetricsLogger", "Timer", "masked_stats", "length_stats", "sample_lengths",
    "distributed_masked_stats", "to_float_dict", "read_metrics", "global_sums", "per_rank_values",
    "check_same_everywhere",
]


class MetricsError(ValueError):
    """A metric value or mask that cannot be reduced or logged; the message names the metric."""


def _as_1d(values: Any, name: str) -> torch.Tensor:
    t = values if isinstance(values, torch.Tensor) else torch.as_tensor(values, dtype=torch.float64)
    if t.dim() != 1:
        raise MetricsError(f"{name}: expected one value per sample (1-D), got shape {tuple(t.shape)}")
    return t.detach().to(torch.float64).cpu()


def _keep_mask(n: int, is_padding: Any, name: str) -> torch.Tensor:
    if is_padding is None:
        return torch.ones(n, dtype=torch.bool)
    pad = torch.as_tensor(is_padding).detach().cpu()
    if pad.dim() != 1 or pad.numel() != n:
        raise MetricsError(f"{name}: is_padding must have one entry per sample ({n}), got shape {tuple(pad.shape)}")
    return ~pad.to(torch.bool)


def masked_stats(values: Any, is_padding: Any = None, name: str = "value") -> dict[str, float]:
    """``{name}/mean, /std, /min, /max`` over the non-padding samples (population std).

    Raises :class:`MetricsError` when every sample is padding: such a metric would be meaningless.

    >>> masked_stats([1.0, 3.0, 100.0], [False, False, True], "reward")["reward/mean"]
    2.0
    """
    v = _as_1d(values, name)
    keep = _keep_mask(v.numel(), is_padding, name)
    kept = v[keep]
    if kept.numel() == 0:
        raise MetricsError(f"{name}: every one of the {v.numel()} samples is padding (or the batch is empty); "
                           "no statistic can be computed")
    mean = kept.mean()
    std = kept.std(unbiased=False) if kept.numel() > 1 else torch.zeros((), dtype=torch.float64)
    return {f"{name}/mean": float(mean), f"{name}/std": float(std), f"{name}/min": float(kept.min()),
            f"{name}/max": float(kept.max())}


def distributed_masked_stats(values: Any, is_padding: Any = None, name: str = "value",
                             group: Any = None, device: Any = None) -> dict[str, float]:
    """:func:`masked_stats` over the samples of every rank in ``group`` (each rank passes its own samples).

    Count, sum and squared deviations are combined exactly (Chan's parallel formula); a rank may hold zero
    non-padding samples as long as some rank holds one. Every rank gets the same result. ``device`` is where the
    gather runs (the process group's device: a GPU under NCCL).
    """
    import torch.distributed as dist

    v = _as_1d(values, name)
    kept = v[_keep_mask(v.numel(), is_padding, name)]
    n = kept.numel()
    mean = kept.mean() if n else torch.zeros((), dtype=torch.float64)
    m2 = ((kept - mean) ** 2).sum() if n else torch.zeros((), dtype=torch.float64)
    lo = kept.min() if n else torch.tensor(math.inf, dtype=torch.float64)
    hi = kept.max() if n else torch.tensor(-math.inf, dtype=torch.float64)
    world = dist.get_world_size(group)
    local = torch.stack([torch.tensor(float(n), dtype=torch.float64), mean, m2, lo, hi])
    if device is not None:  # NCCL gathers only device tensors
        local = local.to(device)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=group)
    parts = [p.cpu() for p in parts]
    total, g_mean, g_m2 = 0.0, 0.0, 0.0
    g_lo, g_hi = math.inf, -math.inf
    for p in parts:
        c, mu, m2_i, lo_i, hi_i = (float(x) for x in p)
        if c == 0:
            continue
        delta = mu - g_mean
        new_total = total + c
        g_mean += delta * c / new_total
        g_m2 += m2_i + delta * delta * total * c / new_total
        total = new_total
        g_lo, g_hi = min(g_lo, lo_i), max(g_hi, hi_i)
    if total == 0:
        raise MetricsError(f"{name}: every sample on all {world} ranks is padding (or the batch is empty); "
                           "no statistic can be computed")
    return {f"{name}/mean": g_mean, f"{name}/std": math.sqrt(max(g_m2 / total, 0.0)), f"{name}/min": g_lo,
            f"{name}/max": g_hi}


def global_sums(values: list[float], device: Any = None, group: Any = None) -> list[float]:
    """Each of a few scalars summed over the ranks of ``group``, in one all-reduce (float64)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return [float(x) for x in t.cpu()]


def per_rank_values(value: float, device: Any = None, group: Any = None) -> list[float]:
    """One scalar from every rank of ``group``, indexed by rank (an all-gather)."""
    import torch.distributed as dist

    mine = torch.tensor([float(value)], dtype=torch.float64, device=device)
    parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [float(p.item()) for p in parts]


def check_same_everywhere(items: Any, what: str, device: Any = None, group: Any = None) -> None:
    """Raise when ``items`` (a sequence of str) differ between ranks: a hash compared by MIN/MAX all-reduces.

    Every rank must plan from the same ordered keys; a divergence would silently train on wrong shares.
    """
    import hashlib

    import torch.distributed as dist

    digest = hashlib.sha256("\n".join(items).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64, device=device)
    lo, hi = mine.clone(), mine.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if lo.item() != hi.item():
        raise RuntimeError(f"{what} differs between ranks (rank {dist.get_rank()} holds {len(items)} items); "
                           "the replicated tag view is out of sync")


def sample_lengths(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``(response_len, policy_len)`` of a jagged ``response_mask`` (policy_len = mask.sum())."""
    if not isinstance(response_mask, torch.Tensor):
        raise MetricsError(f"response_mask: expected a tensor, got {type(response_mask).__name__}")
    if response_mask.is_nested:
        # nested_offsets / nested_values also read jagged tensors whose rows do not sit back to back
        offsets = nested_offsets(response_mask).detach().cpu()
        response_len = offsets.diff()
        values = nested_values(response_mask).detach().cpu()
        policy_len = torch.zeros(response_len.numel(), dtype=torch.int64)
        seg = torch.repeat_interleave(torch.arange(response_len.numel()), response_len)
        policy_len.index_add_(0, seg, (values != 0).to(torch.int64))
        return response_len, policy_len
    raise MetricsError("response_mask: expected a jagged nested tensor (one row per trajectory); for a padded "
                       "[n, max_len] mask the response length is not recoverable, pass the lengths instead")


def length_stats(response_len: Any, policy_len: Any, is_padding: Any = None) -> dict[str, float]:
    """``response_length/*`` and ``policy_length/*`` statistics over non-padding samples."""
    out = masked_stats(response_len, is_padding, "response_length")
    out.update(masked_stats(policy_len, is_padding, "policy_length"))
    return out


def to_float_dict(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """Metrics as plain floats (0-d tensors and numpy scalars unwrapped); non-finite values become ``None``."""
    out: dict[str, float | None] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise MetricsError(f"metric names must be strings, got {key!r}")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise MetricsError(f"metric {key!r}: expected a scalar, got a tensor of shape {tuple(value.shape)}")
            value = value.item()
        elif hasattr(value, "item") and not isinstance(value, (str, bytes)):
            try:
                value = value.item()
            except (ValueError, TypeError) as exc:
                raise MetricsError(f"metric {key!r}: expected a scalar, got {value!r}") from exc
        if isinstance(value, bool) or not isinstance(value, Real):
            raise MetricsError(f"metric {key!r}: expected a number, got {type(value).__name__} {value!r}")
        f = float(value)
        out[key] = f if math.isfinite(f) else None
    return out


class Timer:
    """Context manager timing one stage; adds the seconds to ``sink['timing_s/{name}']`` (summing repeats).

    >>> times = {}
    >>> with Timer("reward", times):
    ...     pass
    >>> "timing_s/reward" in times
    True
    """

    def __init__(self, name: str, sink: dict | None = None, prefix: str = "timing_s/"):
        self.name, self.sink, self.key = name, sink, f"{prefix}{name}"
        self.elapsed = 0.0
        self._start = 0.0

    def __enter__(self) -> "Timer":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.elapsed = time.perf_counter() - self._start
        if self.sink is not None:
            self.sink[self.key] = self.sink.get(self.key, 0.0) + self.elapsed


class MetricsLogger:
    """Appends one JSON object per step (with a ``step`` key) to ``run_dir/metrics.jsonl``.

    Only the rank built with ``enabled_on_this_rank=True`` writes; elsewhere every call is a no-op. Scalars are
    mirrored to TensorBoard (``run_dir/tb``): ``tensorboard=None`` means when ``torch.utils.tensorboard`` can be
    imported (said once in the log when it cannot), ``True`` requires it, ``False`` turns it off.
    """

    FILE = "metrics.jsonl"

    def __init__(self, run_dir: str | Path, enabled_on_this_rank: bool = True, tensorboard: bool | None = None):
        self.run_dir = Path(run_dir)
        self.enabled = bool(enabled_on_this_rank)
        self.path = self.run_dir / self.FILE
        self._fh = None
        self._tb = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")
        if tensorboard is not False:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # tensorboard is optional; JSONL is the record
                if tensorboard:
                    raise ImportError("trainer.tensorboard=true but torch.utils.tensorboard cannot be imported "
                                      f"({exc}); pip install tensorboard, or leave trainer.tensorboard unset") from exc
                logging.getLogger(__name__).info(
                    "TensorBoard is off (the tensorboard package is not installed); metrics go to %s only", self.path)
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))

    def keep_through(self, step: int) -> int:
        """Drop the records after ``step`` (a resume redoes those steps and logs them again); return how many."""
        if not self.enabled or not self.path.exists():
            return 0
        self._fh.close()
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)
        self._fh = open(self.path, "a", encoding="utf-8")
        return len([ln for ln in lines if ln.strip()]) - len(kept)

    @property
    def tensorboard_enabled(self) -> bool:
        return self._tb is not None

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any] | None:
        """Write the metrics of ``step``; return the record written (``None`` on a non-writing rank)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise MetricsError(f"step must be an integer >= 0, got {step!r}")
        if "step" in metrics:
            raise MetricsError("metrics must not contain a 'step' key; pass the step as the first argument")
        clean = to_float_dict(metrics)
        if not self.enabled:
            return None
        if self._fh is None:
            raise MetricsError(f"MetricsLogger for {self.path} is closed")
        record = {"step": step, **clean}
        self._fh.write(json.dumps(record, allow_nan=False) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for key, value in clean.items():
                if value is not None:
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        return record

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` file (or of ``RUN_DIR/metrics.jsonl``), in file order."""
    p = Path(path)
    if p.is_dir():
        p = p / MetricsLogger.FILE
    if not p.exists():
        raise MetricsError(f"no metrics file at {p}")
    out = []
    with open(p, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise MetricsError(f"{p}:{lineno}: not a JSON object: {exc}") from exc
            if not isinstance(rec, dict) or "step" not in rec:
                raise MetricsError(f"{p}:{lineno}: expected a JSON object with a 'step' key, got {line[:80]!r}")
            out.append(rec)
    return out
