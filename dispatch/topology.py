"""The parallel topology of one training job: degrees, logical DP and the global-rank -> coordinates map.

Vocabulary: a *global rank* is a process in the job (0 .. world_size-1); a *DP rank* is the index of the
data share a process computes on (0 .. dp_size-1). All ranks of one replica (its TP / PP / CP / SP ranks)
share a DP rank and see the same share. Rollout TP belongs to the inference engine and never enters DP.

Rank orderings (checked against the libraries in tests):

* **Megatron**: megatron-core's default order ``tp-cp-ep-dp-pp`` (fastest-varying first), i.e.
  ``rank = tp + TP*(cp + CP*(dp + DP*pp))``. Expert layers re-cut the same ranks as
  ``rank = etp + ETP*(ep + EP*(edp + EDP*pp))``. With dynamic context parallel the DP x CP ranks share
  one logical data share (logical DP = 1) and the engine spreads sequences over them itself.
* **FSDP**: Ulysses mesh ``("dp", "sp")`` of shape ``(world/SP, SP)``; the parameter mesh is
  ``("replicate", "shard")`` of shape ``(world/fsdp_size, fsdp_size)`` (HSDP) or 1-D over all ranks
  (``fsdp_size = -1``). Both are row-major like ``torch.distributed.device_mesh.init_device_mesh``.

Example::

    >>> topo = Topology.from_config({"backend": "megatron", "tp": 2, "pp": 2}, world_size=8)
    >>> topo.dp_size, topo.coords(6)["dp"], topo.ranks_of_dp(1), topo.is_reporting(6)
    (2, 1, [2, 3, 6, 7], True)
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["Backend", "Topology", "TopologyError", "ENGINE_ONLY_KEYS"]


class TopologyError(ValueError):
    """Parallel degrees that do not fit the world size or each other; the message names the numbers to change."""


class Backend(str, enum.Enum):
    """The training backend a topology describes; stored as its plain string value."""

    FSDP = "fsdp"
    MEGATRON = "megatron"

    def __str__(self) -> str:
        return self.value


# Config keys read from a mapping or attributes read from a typed section, with their defaults.
_DEFAULTS: dict[str, Any] = {
    "tp": 1, "pp": 1, "vpp": 1, "cp": 1, "ep": 1, "etp": 1, "dynamic_cp": False,
    "ulysses_sp": 1, "fsdp_size": -1, "rollout_tp": 1, "num_experts": None,
}
_ALIASES = {
    "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
    "virtual_pipeline_model_parallel_size": "vpp", "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep", "expert_tensor_parallel_size": "etp",
    "ulysses_sequence_parallel_size": "ulysses_sp",
}
# Engine-only keys of the backend config sections (FSDPConfig, MegatronConfig): accepted and ignored, so that
# ``{"backend": ..., **dataclasses.asdict(section)}`` works; any other unknown key is refused as a likely typo.
ENGINE_ONLY_KEYS = frozenset({"activation_checkpointing", "param_dtype", "reduce_dtype", "use_distributed_optimizer",
                              "sequence_parallel"})
_MEGATRON_ONLY = ("tp", "pp", "vpp", "cp", "ep", "etp")
_FSDP_ONLY = ("ulysses_sp",)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TopologyError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    return int(value)


@dataclass(frozen=True)
class Topology:
    """Immutable parallel layout; validated once at construction. Build it with :meth:`from_config`.

    ``dp_size`` is the logical DP (number of distinct data shares): FSDP ``world / ulysses_sp``;
    Megatron ``world / (tp * pp * cp)``, or 1 with ``dynamic_cp``. ``fsdp_size`` (HSDP) and ``ep`` / ``etp``
    reshape parameter groups, not DP. ``rollout_tp`` is kept for the record only.
    """

    backend: Backend
    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dynamic_cp: bool = False
    ulysses_sp: int = 1
    fsdp_size: int = -1
    rollout_tp: int = 1
    num_experts: int | None = None

    # ------------------------------------------------------------------ construction
    def __post_init__(self) -> None:
        try:
            backend = Backend(str(self.backend).lower())
        except ValueError:
            raise TopologyError(f"backend must be one of {[b.value for b in Backend]}, got {self.backend!r}") from None
        object.__setattr__(self, "backend", backend)
        w = _positive_int("world_size", self.world_size)
        for name in ("tp", "pp", "vpp", "cp", "ep", "etp", "ulysses_sp", "rollout_tp"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.dynamic_cp, bool):
            raise TopologyError(f"dynamic_cp must be a bool, got {self.dynamic_cp!r}")
        if isinstance(self.fsdp_size, bool) or not isinstance(self.fsdp_size, int) or (
                self.fsdp_size < 1 and self.fsdp_size != -1):
            raise TopologyError(f"fsdp_size must be -1 (shard over all ranks) or a positive int, got {self.fsdp_size!r}")
        if self.num_experts is not None:
            _positive_int("num_experts", self.num_experts)
        if w % self.rollout_tp:
            raise TopologyError(f"rollout_tp ({self.rollout_tp}) must divide world_size ({w}) so that rollout "
                                f"replicas tile the ranks; change rollout_tp or the world size")
        if backend is Backend.MEGATRON:
            self._validate_megatron(w)
        else:
            self._validate_fsdp(w)

    def _validate_fsdp(self, w: int) -> None:
        unused = [f"{k}={getattr(self, k)}" for k in _MEGATRON_ONLY if getattr(self, k) != 1]
        if unused or self.dynamic_cp:
            raise TopologyError(f"backend 'fsdp' has no {', '.join(unused) or 'dynamic_cp'}; set them to 1 "
                                f"(use ulysses_sp for sequence parallelism) or choose backend 'megatron'")
        if w % self.ulysses_sp:
            raise TopologyError(f"world_size ({w}) is not divisible by ulysses_sp ({self.ulysses_sp}); "
                                f"choose ulysses_sp among the divisors {_divisors(w)} or change the world size")
        if self.fsdp_size != -1 and w % self.fsdp_size:
            raise TopologyError(f"world_size ({w}) is not divisible by fsdp_size ({self.fsdp_size}); use -1 "
                                f"(shard over all ranks) or one of the divisors {_divisors(w)}")

    def _validate_megatron(self, w: int) -> None:
        if self.ulysses_sp != 1 or self.fsdp_size != -1:
            raise TopologyError(f"backend 'megatron' has no ulysses_sp/fsdp_size (got ulysses_sp={self.ulysses_sp}, "
                                f"fsdp_size={self.fsdp_size}); use cp for context parallelism and leave them at 1/-1")
        model = self.tp * self.pp * self.cp
        if w % model:
            raise TopologyError(f"world_size ({w}) is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = "
                                f"{model}; change tp, pp or cp so their product divides {w}")
        if self.vpp > 1 and self.pp == 1:
            raise TopologyError(f"vpp={self.vpp} (virtual pipeline) needs pp > 1, got pp=1; set vpp=1 or pp >= 2")
        expert = self.etp * self.ep * self.pp
        if w % expert:
            raise TopologyError(
                f"world_size ({w}) is not divisible by etp*ep*pp = {self.etp}*{self.ep}*{self.pp} = {expert}; the "
                f"expert group per pipeline stage has {w // self.pp if w % self.pp == 0 else w / self.pp} ranks, "
                f"change ep or etp so that etp*ep divides it")
        if self.num_experts is not None and self.num_experts % self.ep:
            raise TopologyError(f"num_experts ({self.num_experts}) is not divisible by ep ({self.ep}); "
                                f"choose ep among {_divisors(self.num_experts)}")

    @classmethod
    def from_config(cls, cfg: Any, world_size: int, backend: str | None = None) -> "Topology":
        """Build from a plain mapping or a typed section, plus the world size.

        ``cfg`` is either a mapping (``{"backend": "megatron", "tp": 2, "pp": 2}``; missing keys default, the
        engine-only keys of the backend sections (:data:`ENGINE_ONLY_KEYS`) are ignored, other keys are an error) or any object carrying the degrees as attributes (``FSDPConfig``,
        ``MegatronConfig``, a dataclass); the backend comes from ``cfg["backend"]`` / ``cfg.backend`` or the
        ``backend`` argument. Long megatron-core names (``tensor_model_parallel_size`` ...) are accepted.
        Keys a backend section carries that are not parallel degrees (``param_dtype``, ``sequence_parallel``,
        ...) are ignored when ``cfg`` is a typed object.
        """
        if isinstance(cfg, Mapping):
            raw = dict(cfg)
            strict = True
        elif dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
            raw = dataclasses.asdict(cfg)
            strict = False
        elif cfg is None:
            raw, strict = {}, True
        else:
            raw = {k: getattr(cfg, k) for k in (*_DEFAULTS, *_ALIASES, "backend") if hasattr(cfg, k)}
            strict = False
        name = backend if backend is not None else raw.get("backend")
        if name is None:
            raise TopologyError("Topology.from_config needs a backend: put 'backend': 'fsdp' | 'megatron' in the "
                                "config or pass backend=...")
        if backend is not None and raw.get("backend") not in (None, backend):
            raise TopologyError(f"backend argument {backend!r} disagrees with config backend {raw.get('backend')!r}")
        raw.pop("backend", None)
        values: dict[str, Any] = {}
        unknown = []
        for key, value in raw.items():
            key = _ALIASES.get(key, key)
            if key in _DEFAULTS:
                values[key] = value
            elif key not in ENGINE_ONLY_KEYS:
                unknown.append(key)
        if unknown and strict:
            raise TopologyError(f"unknown topology keys {sorted(unknown)}; known keys: {sorted(_DEFAULTS)}")
        if values.get("vpp") is None:  # megatron-core spells "off" as None
            values["vpp"] = 1
        if values.get("fsdp_size") == 0:
            raise TopologyError("fsdp_size must be -1 (shard over all ranks) or a positive int, got 0")
        return cls(backend=name, world_size=world_size, **values)

    # ------------------------------------------------------------------ derived degrees
    @property
    def dp_size(self) -> int:
        """Logical DP: the number of distinct data shares per step."""
        if self.backend is Backend.FSDP:
            return self.world_size // self.ulysses_sp
        if self.dynamic_cp:
            return 1
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def megatron_dp(self) -> int:
        """megatron-core's own data-parallel size ``world / (tp*pp*cp)`` (1 for FSDP's point of view: n/a)."""
        return self.world_size // (self.tp * self.pp * self.cp) if self.backend is Backend.MEGATRON else self.dp_size

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size ``world / (etp*ep*pp)`` (Megatron)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def shard_size(self) -> int:
        """FSDP parameter-shard group size (``fsdp_size``, -1 resolved to world_size)."""
        return self.world_size if self.fsdp_size == -1 else self.fsdp_size

    @property
    def replicate_size(self) -> int:
        """FSDP replicate (HSDP outer) size ``world / shard_size``."""
        return self.world_size // self.shard_size

    @property
    def seq_shards(self) -> int:
        """Ranks one sequence is split over; a token budget per GPU is multiplied by this for a micro-batch.

        FSDP: ulysses_sp; Megatron: cp, or dp*cp with dynamic context parallel (those ranks share one share).
        """
        if self.backend is Backend.FSDP:
            return self.ulysses_sp
        return self.megatron_dp * self.cp if self.dynamic_cp else self.cp

    @property
    def microbatch_group(self) -> int:
        """Micro-batch counts must be a multiple of this: pp with virtual pipelining (vpp > 1), else 1."""
        return self.pp if (self.backend is Backend.MEGATRON and self.vpp > 1) else 1

    @property
    def replica_size(self) -> int:
        """Global ranks sharing one DP rank."""
        return self.world_size // self.dp_size

    # ------------------------------------------------------------------ rank maps
    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise TopologyError(f"global rank must be an int in [0, {self.world_size}), got {rank!r}")
        return rank

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of a global rank: always ``dp`` (logical DP rank), ``tp``, ``pp``, ``cp``, ``sp``, ``ep``.

        Megatron adds ``etp``, ``edp`` (expert layers) and ``mdp`` (megatron-core's DP rank, which differs
        from ``dp`` only with dynamic CP). FSDP adds ``replicate`` and ``shard`` (the HSDP mesh). Axes a
        backend lacks are 0.
        """
        r = self._check_rank(rank)
        if self.backend is Backend.FSDP:
            return {"dp": r // self.ulysses_sp, "tp": 0, "pp": 0, "cp": 0, "sp": r % self.ulysses_sp, "ep": 0,
                    "replicate": r // self.shard_size, "shard": r % self.shard_size}
        tp, rest = r % self.tp, r // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        mdp, pp = rest % self.megatron_dp, rest // self.megatron_dp
        etp, rest = r % self.etp, r // self.etp
        ep, rest = rest % self.ep, rest // self.ep
        edp = rest % self.expert_dp
        return {"dp": 0 if self.dynamic_cp else mdp, "tp": tp, "pp": pp, "cp": cp, "sp": 0, "ep": ep,
                "etp": etp, "edp": edp, "mdp": mdp}

    def dp_rank(self, rank: int) -> int:
        """The logical DP rank (data share) of a global rank."""
        return self.coords(rank)["dp"]

    def is_reporting(self, rank: int) -> bool:
        """True for the one rank per replica whose outputs are kept: TP 0, last PP stage, CP 0, SP 0.

        With dynamic CP (one logical replica) it is also megatron-core's DP rank 0.
        """
        c = self.coords(rank)
        ok = c["tp"] == 0 and c["pp"] == self.pp - 1 and c["cp"] == 0 and c["sp"] == 0
        if self.backend is Backend.MEGATRON and self.dynamic_cp:
            ok = ok and c["mdp"] == 0
        return ok

    def reporting_rank(self, dp_rank: int) -> int:
        """The global rank that reports outputs for ``dp_rank``."""
        (rank,) = [r for r in self.ranks_of_dp(dp_rank) if self.is_reporting(r)]
        return rank

    def ranks_of_dp(self, dp_rank: int) -> list[int]:
        """All global ranks (ascending) that compute on DP share ``dp_rank``."""
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < self.dp_size:
            raise TopologyError(f"dp_rank must be an int in [0, {self.dp_size}), got {dp_rank!r}")
        return [r for r in range(self.world_size) if self.dp_rank(r) == dp_rank]

    # ------------------------------------------------------------------ reporting
    def axes(self) -> list[str]:
        """The coordinate names shown in :meth:`table` for this backend."""
        if self.backend is Backend.FSDP:
            return ["dp", "sp", "replicate", "shard"]
        return ["dp", "tp", "pp", "cp", "ep", "etp", "edp", "mdp"] if self.dynamic_cp else \
            ["dp", "tp", "pp", "cp", "ep", "etp", "edp"]

    def summary(self) -> str:
        """One line: backend, world, degrees and logical DP."""
        if self.backend is Backend.FSDP:
            deg = f"ulysses_sp={self.ulysses_sp} fsdp_size={self.fsdp_size} (replicate={self.replicate_size} x " \
                  f"shard={self.shard_size})"
        else:
            deg = (f"tp={self.tp} pp={self.pp} vpp={self.vpp} cp={self.cp} ep={self.ep} etp={self.etp} "
                   f"dynamic_cp={self.dynamic_cp}")
        return f"backend={self.backend} world={self.world_size} {deg} rollout_tp={self.rollout_tp} -> dp={self.dp_size}"

    def table(self, max_rows: int | None = None) -> str:
        """A text table, one row per global rank: its coordinates and whether it reports outputs."""
        axes = self.axes()
        header = ["rank", *axes, "reports"]
        rows = [[str(r), *(str(self.coords(r)[a]) for a in axes), "yes" if self.is_reporting(r) else ""]
                for r in range(self.world_size)]
        cut = max_rows is not None and len(rows) > max_rows
        if cut:
            rows = rows[:max_rows]
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
        if cut:
            lines.append(f"... ({self.world_size - max_rows} more ranks)")
        return "\n".join(lines)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
