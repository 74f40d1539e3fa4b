"""ReplayBuffer: assemble training batches of whole prompt groups from the store, oldest first, staleness-bounded.

A *group* is a prompt key ``{uid}`` (tag ``is_prompt``, ``status``, ``global_steps``) and its trajectory keys
``{uid}_{session}_{index}``. Only terminal groups (``finished`` | ``failure``) are sampleable.

Staleness of a trajectory sampled at ``current_step``::

    staleness = (current_step - born_step + 1) / parameter_sync_step

where ``born_step`` is the trajectory tag's ``min_global_steps`` (the oldest policy version that produced a token
of it; ``global_steps`` when absent). A group's staleness is the largest of its trajectories'. In a pending or
running group (no trajectories yet) ``born_step`` is the prompt tag's ``global_steps``.

* ``off_policy_strategy="drop"``: terminal groups with staleness > ``max_off_policy_threshold`` are cleared from
  the store (prompt key included) and counted in the metrics.
* ``off_policy_strategy="wait"``: nothing is dropped; ``sample`` blocks while an in-flight group would exceed the
  threshold at the next step (``staleness(current_step + 1) > threshold``), so it is trained on now.
* ``failure_policy="drop"``: failed groups are cleared and counted; ``"keep_successful"``: their successful
  sessions are trained on (a failed group without any trajectory is cleared and counted).

``sample`` returns every trajectory key of the chosen groups (group by group, sessions in order) with their tags;
``extra_info`` carries ``metrics``, ``uids`` (the prompt keys) and ``global_steps``. Clear a consumed batch with
:meth:`ReplayBuffer.clear`, which also clears the prompt keys (so no late write can land afterwards).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Mapping, Sequence

from protocol.checks import INT, only_types
from protocol.store.keys import KeyFormatError, PromptStatus, parse_trajectory_key
from protocol.store.meta import KVBatchMeta

__all__ = ["ReplayBufferConfig", "ReplayBuffer", "ReplayBufferError", "SampleTimeoutError", "GroupView",
           "staleness", "BufferSnapshot", "snapshot"]

logger = logging.getLogger(__name__)

_OFF_POLICY = ("drop", "wait")
_FAILURE = ("drop", "keep_successful")


class ReplayBufferError(ValueError):
    """A replay-buffer configuration or request that cannot be served (bad value, no usable group)."""


class SampleTimeoutError(TimeoutError):
    """``sample`` waited ``timeout`` seconds without enough terminal groups; the message gives the counts."""


def staleness(current_step: int, born_step: int, parameter_sync_step: int = 1) -> float:
    """``(current_step - born_step + 1) / parameter_sync_step``: policy versions between birth and use."""
    return (current_step - born_step + 1) / parameter_sync_step


@dataclass(frozen=True)
class ReplayBufferConfig:
    """Validated replay-buffer settings (config section ``replay_buffer``)."""

    parameter_sync_step: int = 1
    max_off_policy_threshold: float = 8
    off_policy_strategy: str = "drop"
    failure_policy: str = "drop"
    poll_interval: float = 0.05
    timeout: float = 600.0

    def __post_init__(self) -> None:
        def bad(name: str, value: Any, expected: str) -> ReplayBufferError:
            return ReplayBufferError(f"replay_buffer.{name} must be {expected}, got {value!r}")

        if isinstance(self.parameter_sync_step, bool) or not isinstance(self.parameter_sync_step, int) or \
                self.parameter_sync_step < 1:
            raise bad("parameter_sync_step", self.parameter_sync_step, "a positive int")
        if isinstance(self.max_off_policy_threshold, bool) or not isinstance(self.max_off_policy_threshold,
                                                                             (int, float)) \
                or not self.max_off_policy_threshold > 0:
            raise bad("max_off_policy_threshold", self.max_off_policy_threshold, "a positive number")
        if self.off_policy_strategy not in _OFF_POLICY:
            raise bad("off_policy_strategy", self.off_policy_strategy, f"one of {list(_OFF_POLICY)}")
        if self.failure_policy not in _FAILURE:
            raise bad("failure_policy", self.failure_policy, f"one of {list(_FAILURE)}")
        for name in ("poll_interval", "timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise bad(name, value, "a positive number of seconds")


@dataclass
class GroupView:
    """What the store says about one group: prompt tag, trajectory keys/tags (session order), listing rank.

    ``order`` is the group's position in ``kv_list`` (arrival order for LocalStore); it breaks ties between
    groups of the same step, so every rank that sees the same listing picks the same groups.
    """

    uid: str
    order: int
    prompt_tag: dict | None = None
    keys: list[str] = field(default_factory=list)
    tags: list[dict] = field(default_factory=list)

    @property
    def status(self) -> str | None:
        """The prompt tag's status (None for trajectories whose prompt key is absent)."""
        return None if self.prompt_tag is None else self.prompt_tag.get("status")

    @property
    def born_step(self) -> int:
        """The prompt's global_steps (the step it was taken from the dataset)."""
        return int((self.prompt_tag or {}).get("global_steps", 0))

    def trajectory_born_steps(self) -> list[int]:
        """Per trajectory: ``min_global_steps`` (else ``global_steps``, else the prompt's step)."""
        steps = [t.get("min_global_steps") for t in self.tags]
        if only_types(steps, INT):  # every tag has its own, as trajectory tags do: no per-tag fallbacks
            return steps
        return [int(t.get("min_global_steps", t.get("global_steps", self.born_step))) for t in self.tags]


@dataclass
class BufferSnapshot:
    """The groups of a partition by status, in arrival order (orphan trajectory keys without a prompt key aside)."""

    groups: dict[str, GroupView]
    orphans: int = 0

    def by_status(self, status: str) -> list[GroupView]:
        """Groups whose prompt tag has ``status``, in arrival order."""
        return [g for g in self.groups.values() if g.status == status]

    def counts(self) -> dict[str, int]:
        """Number of groups per status (every status present, zero when none)."""
        c = {s.value: 0 for s in PromptStatus}
        for g in self.groups.values():
            if g.status in c:
                c[g.status] += 1
        return c


def snapshot(tags: Mapping[str, dict]) -> BufferSnapshot:
    """Group a partition's ``key -> tag`` listing into prompt groups (pure; trajectory keys sorted by session)."""
    groups: dict[str, GroupView] = {}
    orphans = 0
    for key, tag in tags.items():
        if tag.get("is_prompt"):
            g = groups.setdefault(key, GroupView(key, len(groups)))
            g.prompt_tag = tag
    places: dict[str, list[tuple[int, int]]] = {}
    for key, tag in tags.items():
        if tag.get("is_prompt"):
            continue
        try:
            uid, session, index = parse_trajectory_key(key)
        except KeyFormatError:
            orphans += 1
            continue
        g = groups.get(uid)
        if g is None:  # padding samples and trajectories whose prompt key is gone are not sampleable
            orphans += 1
            continue
        g.keys.append(key)
        g.tags.append(tag)
        places.setdefault(uid, []).append((session, index))
    for uid, place in places.items():
        g = groups[uid]
        order = sorted(range(len(place)), key=place.__getitem__)
        if order != list(range(len(order))):
            g.keys = [g.keys[i] for i in order]
            g.tags = [g.tags[i] for i in order]
    return BufferSnapshot(groups, orphans)


def _stats(values: Sequence[float], prefix: str) -> dict[str, float]:
    if not values:
        return {}
    return {f"{prefix}/mean": float(sum(values) / len(values)), f"{prefix}/max": float(max(values)),
            f"{prefix}/min": float(min(values))}


class ReplayBuffer:
    """Samples terminal prompt groups from ``store`` partition ``partition_id``; see the module docstring.

    Example::

        buffer = ReplayBuffer(store, "train", off_policy_strategy="drop", failure_policy="drop")
        meta = buffer.sample(batch_size=16, current_step=step)   # blocks until 16 groups are terminal
        ...  # reward, advantage, update on meta.keys
        buffer.clear(meta)
    """

    def __init__(self, store: Any, partition_id: str = "train", parameter_sync_step: int = 1,
                 max_off_policy_threshold: float = 8, off_policy_strategy: str = "drop",
                 failure_policy: str = "drop", poll_interval: float = 0.05, timeout: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(partition_id, str) or not partition_id:
            raise ReplayBufferError(f"replay buffer partition_id must be a non-empty str, got {partition_id!r}")
        self.config = ReplayBufferConfig(parameter_sync_step, max_off_policy_threshold, off_policy_strategy,
                                         failure_policy, poll_interval, timeout)
        self.store = store
        self.partition_id = partition_id
        self._clock = clock
        self._handed_out: set[str] = set()
        self._dropped_staleness: list[float] = []
        self.totals: dict[str, int] = {"stale_groups_dropped": 0, "stale_samples_dropped": 0,
                                       "failed_groups_dropped": 0, "failed_samples_dropped": 0,
                                       "failed_groups_kept": 0, "groups_sampled": 0, "samples_sampled": 0}

    @classmethod
    def from_config(cls, store: Any, partition_id: str, config: ReplayBufferConfig | Mapping[str, Any]
                    ) -> "ReplayBuffer":
        """Build from a :class:`ReplayBufferConfig` or a mapping of its fields."""
        cfg = config if isinstance(config, ReplayBufferConfig) else ReplayBufferConfig(**dict(config))
        return cls(store, partition_id, cfg.parameter_sync_step, cfg.max_off_policy_threshold,
                   cfg.off_policy_strategy, cfg.failure_policy, cfg.poll_interval, cfg.timeout)

    # ------------------------------------------------------------------------------------------- helpers
    def _snapshot(self) -> BufferSnapshot:
        tags = self.store.kv_list(self.partition_id).get(self.partition_id, {})
        snap = snapshot(tags)
        self._handed_out &= set(snap.groups)  # forget groups that were cleared
        return snap

    def _group_staleness(self, g: GroupView, step: int) -> float:
        born = g.trajectory_born_steps()
        # staleness falls as born_step rises, so the group's largest is its oldest trajectory's
        return staleness(step, min(born) if born else g.born_step, self.config.parameter_sync_step)

    def _drop(self, groups: Sequence[GroupView]) -> None:
        keys = [k for g in groups for k in g.keys] + [g.uid for g in groups]
        if keys:
            self.store.kv_clear(keys, self.partition_id)

    def counts(self) -> dict[str, int]:
        """Groups per status in the partition now (``pending``, ``running``, ``finished``, ``failure``)."""
        return self._snapshot().counts()

    # -------------------------------------------------------------------------------------------- sample
    def _try_sample(self, batch_size: int, current_step: int, partial_ok: bool, metrics: dict[str, float]
                    ) -> tuple[KVBatchMeta | None, dict[str, int]]:
        cfg = self.config
        snap = self._snapshot()
        counts = snap.counts()
        groups = [g for g in snap.groups.values() if g.uid not in self._handed_out]
        terminal = [g for g in groups if g.status in (PromptStatus.FINISHED, PromptStatus.FAILURE)]
        in_flight = [g for g in groups if g.status in (PromptStatus.PENDING, PromptStatus.RUNNING)]

        # failed groups
        failed = [g for g in terminal if g.status == PromptStatus.FAILURE]
        if cfg.failure_policy == "drop":
            drop_failed = failed
        else:
            drop_failed = [g for g in failed if not g.keys]
        if drop_failed:
            self._drop(drop_failed)
            n_samples = sum(len(g.keys) for g in drop_failed)
            metrics["replay/failed_groups_dropped"] += len(drop_failed)
            metrics["replay/failed_samples_dropped"] += n_samples
            self.totals["failed_groups_dropped"] += len(drop_failed)
            self.totals["failed_samples_dropped"] += n_samples
            logger.warning("replay buffer dropped %d failed group(s) (%d trajectories) from partition %r",
                           len(drop_failed), n_samples, self.partition_id)
        dropped_ids = {g.uid for g in drop_failed}
        usable = [g for g in terminal if g.uid not in dropped_ids]

        # staleness
        if cfg.off_policy_strategy == "drop":
            stale = [g for g in usable if self._group_staleness(g, current_step) > cfg.max_off_policy_threshold]
            if stale:
                self._drop(stale)
                values = [staleness(current_step, b, cfg.parameter_sync_step)
                          for g in stale for b in g.trajectory_born_steps()]
                metrics["off_policy/dropped_samples"] += len(values)
                metrics["off_policy/dropped_groups"] += len(stale)
                self._dropped_staleness.extend(values)
                self.totals["stale_groups_dropped"] += len(stale)
                self.totals["stale_samples_dropped"] += len(values)
                stale_ids = {g.uid for g in stale}
                usable = [g for g in usable if g.uid not in stale_ids]
            blocking: list[GroupView] = []
        else:
            blocking = [g for g in in_flight
                        if self._group_staleness(g, current_step + 1) > cfg.max_off_policy_threshold]

        usable.sort(key=lambda g: (g.born_step, g.order))
        if blocking or len(usable) < batch_size:
            if not (partial_ok and not in_flight and usable):
                return None, counts
        chosen = usable[:batch_size]
        keys = [k for g in chosen for k in g.keys]
        tags = [t for g in chosen for t in g.tags]
        values = [staleness(current_step, b, cfg.parameter_sync_step) for g in chosen
                  for b in g.trajectory_born_steps()]
        kept = sum(1 for g in chosen if g.status == PromptStatus.FAILURE)
        metrics.update(_stats(values, "off_policy/staleness"))
        metrics["replay/failed_groups_kept"] = float(kept)
        metrics["replay/num_groups"] = float(len(chosen))
        metrics["replay/num_trajectories"] = float(len(keys))
        self.totals["failed_groups_kept"] += kept
        self.totals["groups_sampled"] += len(chosen)
        self.totals["samples_sampled"] += len(keys)
        self._handed_out.update(g.uid for g in chosen)
        # the tags are this snapshot's own copies (a store's listing copies them), so the batch takes them as they are
        meta = KVBatchMeta.adopt(self.partition_id, keys, tags,
                                 {"uids": [g.uid for g in chosen], "global_steps": current_step})
        return meta, counts

    def _check_request(self, batch_size: int, current_step: int, timeout: float | None) -> float:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ReplayBufferError(f"sample: batch_size (prompt groups) must be a positive int, got {batch_size!r}")
        if isinstance(current_step, bool) or not isinstance(current_step, int) or current_step < 0:
            raise ReplayBufferError(f"sample: current_step must be a non-negative int, got {current_step!r}")
        timeout = self.config.timeout if timeout is None else timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ReplayBufferError(f"sample: timeout must be a non-negative number of seconds, got {timeout!r}")
        return float(timeout)

    def _new_metrics(self) -> dict[str, float]:
        self._dropped_staleness = []
        return {"off_policy/dropped_samples": 0.0, "off_policy/dropped_groups": 0.0,
                "replay/failed_groups_dropped": 0.0, "replay/failed_samples_dropped": 0.0}

    def _finish(self, meta: KVBatchMeta, metrics: dict[str, float], counts: dict[str, int], waited: float
                ) -> KVBatchMeta:
        metrics.update(_stats(self._dropped_staleness, "off_policy/dropped_samples_staleness"))
        metrics["replay/wait_s"] = waited
        for status, count in counts.items():
            metrics[f"replay/groups_{status}"] = float(count)
        meta.extra_info["metrics"] = metrics
        return meta

    def _timeout_error(self, batch_size: int, timeout: float, counts: dict[str, int], partial_ok: bool
                       ) -> Exception:
        usable_hint = "" if partial_ok else "; pass partial_ok=True to accept fewer groups once none is in flight"
        wait_hint = (f"; off_policy_strategy='wait' also blocks on in-flight groups older than "
                     f"max_off_policy_threshold={self.config.max_off_policy_threshold}"
                     if self.config.off_policy_strategy == "wait" else "")
        return SampleTimeoutError(
            f"replay buffer (partition {self.partition_id!r}) waited {timeout:.3g}s for {batch_size} terminal "
            f"group(s) not yet sampled; groups now: pending={counts['pending']}, running={counts['running']}, "
            f"finished={counts['finished']}, failed={counts['failure']} (already handed out: "
            f"{len(self._handed_out)}){usable_hint}{wait_hint}")

    def _attempts(self, batch_size: int, current_step: int, timeout: float | None, partial_ok: bool
                  ) -> Generator[float, None, KVBatchMeta]:
        """Try to sample until it works: yields the seconds to wait between tries, returns the batch."""
        timeout = self._check_request(batch_size, current_step, timeout)
        metrics = self._new_metrics()
        start = self._clock()
        while True:
            meta, counts = self._try_sample(batch_size, current_step, partial_ok, metrics)
            if meta is not None:
                return self._finish(meta, metrics, counts, self._clock() - start)
            self._raise_if_hopeless(counts, partial_ok)
            if self._clock() - start >= timeout:
                raise self._timeout_error(batch_size, timeout, counts, partial_ok)
            yield self.config.poll_interval

    def sample(self, batch_size: int, current_step: int, timeout: float | None = None, partial_ok: bool = False
               ) -> KVBatchMeta:
        """Block until ``batch_size`` terminal groups are sampleable; return all their trajectory keys and tags.

        ``timeout`` (seconds; default ``config.timeout``) raises :class:`SampleTimeoutError` with the group
        counts. With ``partial_ok`` fewer groups are returned once no group is pending or running (never zero:
        a request with no usable group raises :class:`ReplayBufferError`).
        """
        attempts = self._attempts(batch_size, current_step, timeout, partial_ok)
        try:
            while True:
                time.sleep(next(attempts))
        except StopIteration as done:
            return done.value

    async def async_sample(self, batch_size: int, current_step: int, timeout: float | None = None,
                           partial_ok: bool = False) -> KVBatchMeta:
        """:meth:`sample` for an event loop whose own tasks write the groups (polls with ``asyncio.sleep``)."""
        attempts = self._attempts(batch_size, current_step, timeout, partial_ok)
        try:
            while True:
                await asyncio.sleep(next(attempts))
        except StopIteration as done:
            return done.value

    def _raise_if_hopeless(self, counts: dict[str, int], partial_ok: bool) -> None:
        if partial_ok and counts["pending"] == 0 and counts["running"] == 0:
            raise ReplayBufferError(
                f"replay buffer (partition {self.partition_id!r}) has no usable group: nothing is pending or "
                f"running and every terminal group was dropped or already handed out (finished={counts['finished']}, "
                f"failed={counts['failure']}, handed out={len(self._handed_out)}, totals={self.totals})")

    # ------------------------------------------------------------------------------------------- cleanup
    def clear(self, meta: KVBatchMeta, extra_keys: Sequence[str] = ()) -> int:
        """Clear a sampled batch: its trajectory keys, its groups' prompt keys and ``extra_keys`` (e.g. padding)."""
        if not isinstance(meta, KVBatchMeta):
            raise TypeError(f"clear expects the KVBatchMeta returned by sample, got {type(meta).__name__}")
        if meta.partition_id != self.partition_id:
            raise ReplayBufferError(f"clear: batch is from partition {meta.partition_id!r}, this buffer serves "
                                    f"{self.partition_id!r}")
        uids = list(meta.extra_info.get("uids", []))
        keys = list(dict.fromkeys([*meta.keys, *extra_keys, *uids]))
        dropped = self.store.kv_clear(keys, self.partition_id) if keys else 0
        self._handed_out.difference_update(uids)
        return dropped
