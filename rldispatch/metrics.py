"""Per-step metrics: padding-aware reductions, stage timers, and a JSONL (+ TensorBoard) logger."""
from __future__ import annotations

import json
import logging
import math
import os
import time
from numbers import Real
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from protocol.batch.nested import nested_offsets, nested_values
from rldispatch.collectives import gather_objects

__all__ = [
    "MetricsError", "MetricsLogger", "Timer", "masked_stats", "length_stats", "sample_lengths",
    "distributed_masked_stats", "StepStats", "to_float_dict", "read_metrics", "explained_variance",
    "ComputeClock", "MODEL_STAGES", "overhead_fraction", "combine_update_metrics",
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


def _local_moments(values: Any, is_padding: Any, name: str) -> tuple[float, float, float, float, float]:
    """``(count, mean, M2, min, max)`` of the non-padding samples here (float64; an empty share is ``(0, 0, 0, inf,
    -inf)``): what ranks exchange to combine their statistics exactly."""
    v = _as_1d(values, name)
    kept = v[_keep_mask(v.numel(), is_padding, name)]
    if not kept.numel():
        return 0.0, 0.0, 0.0, math.inf, -math.inf
    mean = kept.mean()
    return float(kept.numel()), float(mean), float(((kept - mean) ** 2).sum()), float(kept.min()), float(kept.max())


def _combine_moments(parts: Sequence[Sequence[float]], name: str) -> dict[str, float]:
    """``{name}/mean, /std, /min, /max`` from each rank's :func:`_local_moments`, in rank order (Chan's parallel
    formula, so every rank computes the same floats)."""
    total, g_mean, g_m2 = 0.0, 0.0, 0.0
    g_lo, g_hi = math.inf, -math.inf
    for c, mu, m2_i, lo_i, hi_i in parts:
        if c == 0:
            continue
        delta = mu - g_mean
        new_total = total + c
        g_mean += delta * c / new_total
        g_m2 += m2_i + delta * delta * total * c / new_total
        total = new_total
        g_lo, g_hi = min(g_lo, lo_i), max(g_hi, hi_i)
    if total == 0:
        raise MetricsError(f"{name}: every sample on all {len(parts)} ranks is padding (or the batch is empty); "
                           "no statistic can be computed")
    return {f"{name}/mean": g_mean, f"{name}/std": math.sqrt(max(g_m2 / total, 0.0)), f"{name}/min": g_lo,
            f"{name}/max": g_hi}


def distributed_masked_stats(values: Any, is_padding: Any = None, name: str = "value",
                             group: Any = None, device: Any = None) -> dict[str, float]:
    """:func:`masked_stats` over the samples of every rank in ``group`` (each rank passes its own samples).

    Count, sum and squared deviations are combined exactly (Chan's parallel formula); a rank may hold zero
    non-padding samples as long as some rank holds one. Every rank gets the same result. ``device`` is where the
    gather runs (the process group's device: a GPU under NCCL). A step reduces many of these at once with
    :class:`StepStats`.
    """
    import torch.distributed as dist

    local = torch.tensor(_local_moments(values, is_padding, name), dtype=torch.float64, device=device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return _combine_moments([p.cpu().tolist() for p in parts], name)


class StepStats:
    """A step's cross-rank metrics, collected as the stages run and reduced together in one collective.

    Each stage records its local share (:meth:`masked`, :meth:`sum`, :meth:`per_rank`); :meth:`reduce` gathers every
    rank's shares at once (one round trip instead of one per metric) and returns what
    :func:`distributed_masked_stats`, a global sum or an all-gather of each would have. A name recorded on some
    ranks only is reduced over the ranks that recorded it (a masked statistic: as an empty share elsewhere).

    >>> s = StepStats()
    >>> s.masked("r", [1.0, 3.0, 9.0], [False, False, True]); s.sum("n", 2.0)
    >>> out = s.reduce()  # no process group: this process's values
    >>> out["r/mean"], out["r/max"], out["n"]
    (2.0, 3.0, 2.0)
    """

    def __init__(self) -> None:
        self._moments: dict[str, tuple[tuple[float, ...], tuple[str, ...]]] = {}
        self._sums: dict[str, float] = {}
        self._per_rank: dict[str, float] = {}
        self._spread: dict[str, float] = {}

    def masked(self, name: str, values: Any, is_padding: Any = None,
               keep: Sequence[str] = ("mean", "std", "min", "max")) -> None:
        """``{name}/<stat>`` for each stat in ``keep``, over every rank's non-padding ``values``."""
        self._record(name)
        self._moments[name] = (_local_moments(values, is_padding, name), tuple(keep))

    def sum(self, name: str, value: float) -> None:
        """``name``: ``value`` summed over the ranks."""
        self._record(name)
        self._sums[name] = float(value)

    def per_rank(self, name: str, value: float) -> None:
        """``{name}/rank<r>`` for every rank and ``{name}/max``; every rank must record it."""
        self._record(name)
        self._per_rank[name] = float(value)

    def spread(self, name: str, value: float) -> None:
        """``{name}/max``, ``/mean`` and ``/straggler_ratio`` (max over mean, 1 when balanced) of one value per
        rank; every rank must record it. Shows a slow rank that a sum over the ranks hides."""
        self._record(name)
        self._spread[name] = float(value)

    def _record(self, name: str) -> None:
        if name in self._moments or name in self._sums or name in self._per_rank or name in self._spread:
            raise MetricsError(f"{name}: recorded twice in one step")

    def reduce(self, group: Any = None, device: Any = None) -> dict[str, float]:
        """Every recorded metric over the ranks of ``group`` (a collective, when a process group is up)."""
        import torch.distributed as dist

        mine = (self._moments, self._sums, self._per_rank, self._spread)
        grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        gathered = gather_objects(mine, group=group, device=device) if grouped else [mine]
        out: dict[str, float] = {}
        for name in sorted(set().union(*(g[0] for g in gathered))):
            empty = ((0.0, 0.0, 0.0, math.inf, -math.inf), ())
            shares = [g[0].get(name, empty) for g in gathered]
            keep = next(k for _, k in shares if k)
            stats = _combine_moments([m for m, _ in shares], name)
            out.update({f"{name}/{k}": stats[f"{name}/{k}"] for k in keep})
        for name in sorted(set().union(*(g[1] for g in gathered))):
            out[name] = sum(g[1].get(name, 0.0) for g in gathered)
        for name in sorted(set().union(*(g[2] for g in gathered))):
            missing = [r for r, g in enumerate(gathered) if name not in g[2]]
            if missing:
                raise MetricsError(f"{name}: a per-rank value that ranks {missing} did not record")
            values = [g[2][name] for g in gathered]
            out.update({f"{name}/rank{r}": v for r, v in enumerate(values)})
            out[f"{name}/max"] = max(values)
        for name in sorted(set().union(*(g[3] for g in gathered))):
            missing = [r for r, g in enumerate(gathered) if name not in g[3]]
            if missing:
                raise MetricsError(f"{name}: a per-rank value that ranks {missing} did not record")
            values = [g[3][name] for g in gathered]
            hi, mean = max(values), sum(values) / len(values)
            out.update({f"{name}/max": hi, f"{name}/mean": mean,
                        f"{name}/straggler_ratio": hi / mean if mean > 0 else 1.0})
        return out


def explained_variance(n: float, sum_r: float, sum_rr: float, sum_d: float, sum_dd: float,
                       eps: float = 1e-5) -> float:
    """``1 - var(returns - values) / (var(returns) + eps)`` (unbiased variances, the reference system's
    ``critic/vf_explained_var``) from the step's sums over its ``n`` policy tokens: of the returns ``r``, their
    squares, the residuals ``d = r - v`` and their squares. NaN below 2 tokens.

    >>> round(explained_variance(3, 6.0, 14.0, 1.0, 1.0), 4)  # returns 1, 2, 3; values 1, 2, 2
    0.6667
    """
    if n < 2:
        return math.nan
    var_r = max(sum_rr - sum_r * sum_r / n, 0.0) / (n - 1)
    var_d = max(sum_dd - sum_d * sum_d / n, 0.0) / (n - 1)
    return 1.0 - var_d / (var_r + eps)


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


class ComputeClock:
    """Seconds a rank computes inside timed regions, summed per name, without the time it waits for its peers.

    On a CPU device it reads the process's CPU time: a rank blocked in a gloo collective (waiting for a slower
    peer) uses none, so the figure is its own compute (CPU-seconds: with several intra-op threads it exceeds the
    wall time). On a GPU it reads the wall clock around a device synchronisation, waits included.
    """

    def __init__(self, device: Any = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.seconds: dict[str, float] = {}

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()

    def region(self, name: str) -> "_Region":
        return _Region(self, name)


class _Region:
    def __init__(self, clock: ComputeClock, name: str):
        self.clock, self.name, self.start = clock, name, 0.0

    def __enter__(self) -> None:
        self.start = self.clock._now()

    def __exit__(self, *exc: Any) -> None:
        took = self.clock._now() - self.start
        self.clock.seconds[self.name] = self.clock.seconds.get(self.name, 0.0) + took


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


#: Stages whose time is the models' (rollout generation, log-probs of the policy and the reference, the update,
#: the weight sync); every other stage (sample, plan, reward, advantage, clear) is the step's own overhead.
MODEL_STAGES = ("rollout", "old_log_prob", "ref", "values", "critic_update", "update", "weight_sync")


def overhead_fraction(times: dict[str, float], step_seconds: float) -> float:
    """The step's non-model share: the summed ``timing_s/<stage>`` of stages not in MODEL_STAGES over the step."""
    model = {f"timing_s/{s}" for s in MODEL_STAGES} | {"timing_s/step", "timing_s/overhead_fraction"}
    other = sum(v for k, v in times.items() if k.startswith("timing_s/") and k not in model)
    return other / step_seconds if step_seconds > 0 else 0.0


_SUMMED = ("tokens", "seqs", "micro_batches", "skipped", "nonfinite", "time")
_LAST = ("global_step", "lr")


def combine_update_metrics(updates: Sequence[dict[str, float]], prefix: str = "actor/") -> dict[str, float]:
    """One step's ``actor/*`` (or ``critic/*``) metrics from its optimizer steps: counts add up, lr is the last, the
    rest average."""
    out: dict[str, float] = {}
    for k in sorted({k for u in updates for k in u}):
        vals = [float(u[k]) for u in updates if u.get(k) is not None]
        if not vals:
            continue
        out[f"{prefix}{k}"] = sum(vals) if k in _SUMMED else vals[-1] if k in _LAST else sum(vals) / len(vals)
    out[f"{prefix}optimizer_steps"] = float(len(updates))
    return out
