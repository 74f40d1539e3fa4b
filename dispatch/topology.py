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

The parallel degrees a user sets are typed sections, one per backend (:class:`FSDPParallel`,
:class:`MegatronParallel`); the engines' config sections extend them with their engine-only keys. A plain
mapping (tests, scripts) becomes such a section first (:func:`parallel_section`), so every topology is built
along one path: mapping -> typed section -> :class:`Topology`.

Example::

    >>> topo = Topology.from_config(MegatronParallel(tp=2, pp=2), world_size=8)
    >>> topo.dp_size, topo.coords(6)["dp"], topo.ranks_of_dp(1), topo.is_reporting(6)
    (2, 1, [2, 3, 6, 7], True)
    >>> Topology.from_config({"backend": "megatron", "tp": 2, "pp": 2}, world_size=8) == topo
    True
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from protocol.config import ConfigError

__all__ = ["Backend", "BackendName", "FSDPParallel", "MegatronParallel", "ParallelSection", "parallel_section",
           "Topology", "TopologyError"]


class TopologyError(ConfigError):
    """Parallel degrees that do not fit the world size or each other; the message names the numbers to change."""


class Backend(str, enum.Enum):
    """The training backend a topology describes; stored as its plain string value."""

    FSDP = "fsdp"
    MEGATRON = "megatron"

    def __str__(self) -> str:
        return self.value


BackendName = Literal["fsdp", "megatron"]  # the config spelling of :class:`Backend` (``actor.backend``)

# megatron-core's long names for the degrees, accepted in a mapping
_ALIASES = {
    "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
    "virtual_pipeline_model_parallel_size": "vpp", "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep", "expert_tensor_parallel_size": "etp",
    "ulysses_sequence_parallel_size": "ulysses_sp",
}
# keys of the job rather than of a backend section: the rollout engine's TP and the model's expert count
_JOB_KEYS = ("rollout_tp", "num_experts")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TopologyError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    return int(value)


def _check_fsdp_size(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise TopologyError(f"fsdp_size must be -1 (shard over all ranks) or a positive int, got {value!r}")


@dataclass
class FSDPParallel:
    """FSDP's parallel degrees: ``fsdp_size`` (-1 = shard over all ranks, else the HSDP shard group) and Ulysses SP."""

    backend: ClassVar[Backend] = Backend.FSDP
    fsdp_size: int = -1
    ulysses_sp: int = 1

    def __post_init__(self) -> None:
        _check_fsdp_size(self.fsdp_size)
        _positive_int("ulysses_sp", self.ulysses_sp)


@dataclass
class MegatronParallel:
    """Megatron-core's parallel degrees; ``vpp`` = virtual pipeline stages per rank (1 = off)."""

    backend: ClassVar[Backend] = Backend.MEGATRON
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dynamic_cp: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "cp", "ep", "etp"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.dynamic_cp, bool):
            raise TopologyError(f"dynamic_cp must be a bool, got {self.dynamic_cp!r}")


ParallelSection = FSDPParallel | MegatronParallel
_SECTIONS: dict[Backend, type] = {Backend.FSDP: FSDPParallel, Backend.MEGATRON: MegatronParallel}


def _backend(name: Any) -> Backend:
    try:
        return Backend(str(name).lower())
    except ValueError:
        raise TopologyError(f"backend must be one of {[b.value for b in Backend]}, got {name!r}") from None


def _degrees(section_cls: type) -> dict[str, Any]:
    """The degrees a backend section declares, with their defaults."""
    return {f.name: f.default for f in dataclasses.fields(section_cls)}


def _engine_keys(section_cls: type) -> set[str]:
    """Keys the (imported) subclasses of a section add, e.g. an engine's dtypes: not parallel degrees."""
    own, found = set(_degrees(section_cls)), set()
    todo = list(section_cls.__subclasses__())
    while todo:
        sub = todo.pop()
        todo.extend(sub.__subclasses__())
        if dataclasses.is_dataclass(sub):
            found |= {f.name for f in dataclasses.fields(sub)} - own
    return found


def _check_foreign(backend: Backend, values: Mapping[str, Any]) -> None:
    """Refuse the other backend's degrees when set away from their defaults, naming the ones to reset."""
    other = _degrees(_SECTIONS[Backend.MEGATRON if backend is Backend.FSDP else Backend.FSDP])
    changed = [f"{k}={values[k]}" for k in other if k in values and values[k] != other[k]]
    if not changed:
        return
    if backend is Backend.FSDP:
        raise TopologyError(f"backend 'fsdp' has no {', '.join(changed)}; set them to 1 (use ulysses_sp for "
                            f"sequence parallelism) or choose backend 'megatron'")
    raise TopologyError(f"backend 'megatron' has no ulysses_sp/fsdp_size (got {', '.join(changed)}); use cp for "
                        f"context parallelism and leave them at 1/-1")


def parallel_section(cfg: Mapping[str, Any] | None, backend: str | None = None
                     ) -> tuple[ParallelSection, dict[str, Any]]:
    """A mapping of degrees as its backend's typed section, plus the job keys it carries (``rollout_tp``, ``num_experts``).

    The backend comes from ``cfg["backend"]`` or the ``backend`` argument. Missing degrees default; megatron-core's
    long names (``tensor_model_parallel_size`` ...) are accepted; the other backend's degrees must stay at their
    defaults; keys an engine's section adds to its parallel section (``param_dtype`` ...) are ignored, so
    ``{"backend": ..., **dataclasses.asdict(section)}`` works; any other key is refused as a likely typo.

    >>> parallel_section({"backend": "megatron", "tensor_model_parallel_size": 2, "rollout_tp": 2})
    (MegatronParallel(tp=2, pp=1, vpp=1, cp=1, ep=1, etp=1, dynamic_cp=False), {'rollout_tp': 2})
    """
    raw = dict(cfg or {})
    given = raw.pop("backend", None)
    if backend is not None and given not in (None, backend):
        raise TopologyError(f"backend argument {backend!r} disagrees with config backend {given!r}")
    name = backend if backend is not None else given
    if name is None:
        raise TopologyError("Topology.from_config needs a backend: put 'backend': 'fsdp' | 'megatron' in the "
                            "config or pass backend=...")
    kind = _backend(name)
    section_cls = _SECTIONS[kind]
    own = _degrees(section_cls)
    foreign_names = set(_degrees(_SECTIONS[Backend.MEGATRON if kind is Backend.FSDP else Backend.FSDP]))
    engine_only = _engine_keys(section_cls)
    values: dict[str, Any] = {}
    job: dict[str, Any] = {}
    foreign: dict[str, Any] = {}
    unknown = []
    for key, value in raw.items():
        key = _ALIASES.get(key, key)
        if key in own:
            values[key] = value
        elif key in _JOB_KEYS:
            job[key] = value
        elif key in foreign_names:
            foreign[key] = value
        elif key not in engine_only:
            unknown.append(key)
    if unknown:
        known = sorted({*own, *foreign_names, *_JOB_KEYS})
        raise TopologyError(f"unknown topology keys {sorted(unknown)}; known keys: {known}")
    if "vpp" in values and values["vpp"] is None:  # megatron-core spells "off" as None
        values["vpp"] = 1
    if "vpp" in foreign and foreign["vpp"] is None:
        foreign["vpp"] = 1
    _check_foreign(kind, foreign)
    return section_cls(**values), job


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
        backend = _backend(self.backend)
        object.__setattr__(self, "backend", backend)
        w = _positive_int("world_size", self.world_size)
        for name in ("tp", "pp", "vpp", "cp", "ep", "etp", "ulysses_sp", "rollout_tp"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.dynamic_cp, bool):
            raise TopologyError(f"dynamic_cp must be a bool, got {self.dynamic_cp!r}")
        _check_fsdp_size(self.fsdp_size)
        if self.num_experts is not None:
            _positive_int("num_experts", self.num_experts)
        if w % self.rollout_tp:
            raise TopologyError(f"rollout_tp ({self.rollout_tp}) must divide world_size ({w}) so that rollout "
                                f"replicas tile the ranks; change rollout_tp or the world size")
        _check_foreign(backend, {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if backend is Backend.MEGATRON:
            self._validate_megatron(w)
        else:
            self._validate_fsdp(w)

    def _validate_fsdp(self, w: int) -> None:
        if w % self.ulysses_sp:
            raise TopologyError(f"world_size ({w}) is not divisible by ulysses_sp ({self.ulysses_sp}); "
                                f"choose ulysses_sp among the divisors {_divisors(w)} or change the world size")
        if self.fsdp_size != -1 and w % self.fsdp_size:
            raise TopologyError(f"world_size ({w}) is not divisible by fsdp_size ({self.fsdp_size}); use -1 "
                                f"(shard over all ranks) or one of the divisors {_divisors(w)}")

    def _validate_megatron(self, w: int) -> None:
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
    def from_config(cls, cfg: ParallelSection | Mapping[str, Any] | None, world_size: int,
                    backend: str | None = None, *, rollout_tp: int | None = None,
                    num_experts: int | None = None) -> "Topology":
        """Build from a typed parallel section (:class:`FSDPParallel`, :class:`MegatronParallel` or an engine's
        section extending one) plus the world size; the section's class fixes the backend.

        A mapping (``{"backend": "megatron", "tp": 2}``) is first made a typed section by :func:`parallel_section`
        (see there for the keys it accepts); ``rollout_tp`` / ``num_experts`` come from the arguments or the mapping.
        """
        job: dict[str, Any] = {}
        if cfg is None or isinstance(cfg, Mapping):
            section, job = parallel_section(cfg, backend)
        elif isinstance(cfg, (FSDPParallel, MegatronParallel)):
            section = cfg
            if backend is not None and _backend(backend) is not section.backend:
                raise TopologyError(f"backend argument {backend!r} disagrees with the {type(cfg).__name__} section "
                                    f"(backend {section.backend.value!r})")
        else:
            raise TopologyError(f"Topology.from_config takes an FSDPParallel or MegatronParallel section (or a "
                                f"mapping of degrees), got {type(cfg).__name__}")
        for key, value in (("rollout_tp", rollout_tp), ("num_experts", num_experts)):
            if value is not None:
                if key in job and job[key] != value:
                    raise TopologyError(f"{key}={value} disagrees with the config's {key}={job[key]}")
                job[key] = value
        degrees = {k: getattr(section, k) for k in _degrees(_SECTIONS[section.backend])}
        return cls(backend=section.backend, world_size=world_size, **degrees, **job)

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
