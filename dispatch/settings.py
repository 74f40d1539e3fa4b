"""Batch settings of one dispatch: mini-batch size, epochs, shuffling, micro-batch mode and balancing switches.

Validated twice: on their own at construction, and against a :class:`~dispatch.topology.Topology` with
:meth:`BatchSettings.check` at start-up, so a setting that cannot divide the batch fails before any rollout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from dispatch.topology import Topology
from dispatch.workload import WorkloadModel
from protocol.config import ConfigError

__all__ = ["BatchSettings", "DispatchConfigError"]


class DispatchConfigError(ConfigError):
    """Batch settings that cannot be dispatched on a topology; the message names the numbers to change."""


def _opt_pos(name: str, v: Any) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise DispatchConfigError(f"{name} must be a positive int or None, got {v!r}")


@dataclass(frozen=True)
class BatchSettings:
    """How a step's trajectories become per-rank mini- and micro-batches.

    * ``ppo_mini_batch_size`` (M, in prompts) × ``rollout_n`` (G) trajectories per optimizer step;
      ``None`` = the whole batch is one mini-batch (inference: log-probs, reference, values).
    * ``ppo_epochs`` passes over the batch; with ``shuffle`` each epoch permutes the batch (or its groups)
      from ``seed`` and the epoch number, reproducibly.
    * Micro-batches: ``micro_batch_size_per_gpu`` (samples) or ``max_token_len_per_gpu`` (tokens, multiplied
      by the topology's ``seq_shards``), at most one of them; neither = one micro-batch per mini-batch.
    * ``group_partition`` keeps every GRPO group (uid) on one DP rank.
    * ``balance`` = False uses contiguous splits (the baseline); ``small_ends`` orders micro-batches with the
      lightest at both ends to shrink pipeline warm-up and cool-down bubbles.
    """

    ppo_mini_batch_size: int | None = None
    rollout_n: int = 1
    ppo_epochs: int = 1
    shuffle: bool = False
    seed: int = 0
    micro_batch_size_per_gpu: int | None = None
    max_token_len_per_gpu: int | None = None
    group_partition: bool = False
    balance: bool = True
    small_ends: bool = False
    workload: WorkloadModel = field(default_factory=WorkloadModel)

    def __post_init__(self) -> None:
        _opt_pos("ppo_mini_batch_size", self.ppo_mini_batch_size)
        _opt_pos("micro_batch_size_per_gpu", self.micro_batch_size_per_gpu)
        _opt_pos("max_token_len_per_gpu", self.max_token_len_per_gpu)
        for name in ("rollout_n", "ppo_epochs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise DispatchConfigError(f"{name} must be a positive int, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise DispatchConfigError(f"seed must be a non-negative int, got {self.seed!r}")
        for name in ("shuffle", "group_partition", "balance", "small_ends"):
            if not isinstance(getattr(self, name), bool):
                raise DispatchConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.micro_batch_size_per_gpu is not None and self.max_token_len_per_gpu is not None:
            raise DispatchConfigError(
                f"set either micro_batch_size_per_gpu ({self.micro_batch_size_per_gpu}) or max_token_len_per_gpu "
                f"({self.max_token_len_per_gpu}), not both")
        if not isinstance(self.workload, WorkloadModel):
            object.__setattr__(self, "workload", WorkloadModel.from_config(self.workload))

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None = None, **overrides: Any) -> "BatchSettings":
        """From a mapping with these field names (unknown keys are an error); ``workload`` may be a mapping."""
        raw = {**dict(cfg or {}), **overrides}
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise DispatchConfigError(f"unknown dispatch settings {unknown}; known: {sorted(known)}")
        if "workload" in raw:
            raw["workload"] = WorkloadModel.from_config(raw["workload"])
        return cls(**raw)

    @property
    def mini_batch_samples(self) -> int | None:
        """M·G trajectories per optimizer step (None: the whole batch)."""
        return None if self.ppo_mini_batch_size is None else self.ppo_mini_batch_size * self.rollout_n

    def token_cap(self, topology: Topology) -> int | None:
        """Hard token cap per micro-batch: max_token_len_per_gpu × the ranks a sequence is split over."""
        if self.max_token_len_per_gpu is None:
            return None
        return self.max_token_len_per_gpu * topology.seq_shards

    def padding_multiple(self, topology: Topology) -> int:
        """The batch size must be a multiple of this: lcm(DP, M·G), or lcm(DP·G, M·G) with group partition."""
        unit = self.rollout_n if self.group_partition else 1
        multiple = topology.dp_size * unit
        if self.mini_batch_samples is not None:
            multiple = math.lcm(multiple, self.mini_batch_samples)
        return multiple

    def check(self, topology: Topology) -> None:
        """Refuse settings that cannot be dispatched on ``topology``, naming the numbers (call at start-up)."""
        dp = topology.dp_size
        mb = self.mini_batch_samples
        if mb is not None and mb % dp:
            raise DispatchConfigError(
                f"ppo_mini_batch_size ({self.ppo_mini_batch_size}) x rollout_n ({self.rollout_n}) = {mb} trajectories "
                f"per optimizer step is not divisible by the logical DP size {dp} ({topology.summary()}); change "
                f"ppo_mini_batch_size so that M*G is a multiple of {dp}")
        if self.group_partition and mb is not None and self.ppo_mini_batch_size % dp:
            raise DispatchConfigError(
                f"group_partition keeps whole groups on one rank, so ppo_mini_batch_size ({self.ppo_mini_batch_size} "
                f"prompts) must be divisible by the logical DP size {dp}; change it or set group_partition=false")
        group = topology.microbatch_group
        if mb is not None and group > mb // dp:
            raise DispatchConfigError(
                f"virtual pipelining needs a multiple of pp={group} micro-batches but a rank holds only "
                f"{mb // dp} samples per mini-batch (M*G/DP = {self.ppo_mini_batch_size}*{self.rollout_n}/{dp}); "
                f"raise ppo_mini_batch_size or lower pp/vpp")
        if mb is not None and self.micro_batch_size_per_gpu is not None:
            per_rank = mb // dp
            if self.micro_batch_size_per_gpu > per_rank:
                raise DispatchConfigError(
                    f"micro_batch_size_per_gpu ({self.micro_batch_size_per_gpu}) exceeds the per-rank mini-batch "
                    f"M*G/DP = {self.ppo_mini_batch_size}*{self.rollout_n}/{dp} = {per_rank}; lower it to <= {per_rank}")
            count = -(-per_rank // self.micro_batch_size_per_gpu)
            if -(-count // group) * group > per_rank:
                raise DispatchConfigError(
                    f"virtual pipelining needs a multiple of pp={group} micro-batches: {count} micro-batches of "
                    f"micro_batch_size_per_gpu={self.micro_batch_size_per_gpu} round up to "
                    f"{-(-count // group) * group}, more than the {per_rank} samples a rank holds per mini-batch; "
                    f"lower micro_batch_size_per_gpu or raise ppo_mini_batch_size")
