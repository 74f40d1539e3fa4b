"""Running prompt groups: n concurrent sessions per uid, one batch put of their trajectories, then the group status.

Order of writes for a group (so a reader never sees a terminal status before the data, and nothing of a group is
written after its status settles):

1. prompt tag ``status = running`` (the tag is created as ``pending`` -> ``running`` when the uid is new), with the
   prompt's own fields (:class:`PromptInputs`: a vision-language prompt's images, stored once for the group);
2. all ``n`` sessions run concurrently and ALL settle (a session that raises does not cancel the others);
3. the trajectories of the successful sessions are post-processed and written with ONE ``kv_batch_put``;
4. the prompt tag gets ``status = finished`` (every session succeeded) or ``failure`` (at least one raised),
   with ``num_sessions``, ``num_failed_sessions``, ``num_trajectories`` and up to 5 ``errors`` (``num_errors``
   counts all).

What a failed group's successful trajectories are used for is the replay buffer's ``failure_policy``.
:func:`run_groups` sends the puts its groups ask for in one event-loop turn as a few combined batch puts
(:mod:`protocol.rollout.agent_loop.writes`); each group's writes keep this order.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from protocol.rollout.agent_loop.base import AgentLoop, session_versions
from protocol.rollout.agent_loop.output import AgentLoopOutput, AgentLoopOutputError
from protocol.store.keys import PromptStatus, check_uid, prompt_tag, transition
from protocol.store.meta import KVBatchMeta
from protocol.rollout.agent_loop.writes import GroupWrites
from protocol.rollout.postprocess import postprocess_group

__all__ = ["PromptInputs", "register_prompts", "run_group", "run_groups", "MAX_ERRORS_IN_TAG"]

logger = logging.getLogger(__name__)

#: How many session error messages a prompt tag keeps (``num_errors`` counts all of them).
MAX_ERRORS_IN_TAG = 5


@dataclass(frozen=True)
class PromptInputs:
    """What a group stores once beside its trajectories: ``fields`` on the prompt key ``{uid}`` (a vision-language
    prompt's images, which every trajectory of the group reads instead of holding a copy; one row per field) and
    ``tags``, entries added to every trajectory's tag (the images' ``vision_spans``, which the dispatch plans from)."""

    fields: Mapping[str, Any] = field(default_factory=dict)
    tags: Mapping[str, Any] = field(default_factory=dict)


def _prompt_status(store: Any, uid: str, partition_id: str) -> tuple[str | None, dict | None]:
    try:
        tag = store.kv_batch_get_tags([uid], partition_id)[0]
    except KeyError:
        return None, None
    return tag.get("status"), tag


def register_prompts(store: Any, uids: Sequence[str], global_steps: int, partition_id: str = "train") -> KVBatchMeta:
    """Write the ``pending`` prompt tag of every (new) uid in one put; an existing uid is an error naming it."""
    uids = [check_uid(u) for u in uids]
    if len(set(uids)) != len(uids):
        raise ValueError(f"register_prompts: uids must be unique, got {len(uids) - len(set(uids))} duplicate(s)")
    if not uids:
        return KVBatchMeta(partition_id, [], [])
    present = {k for k in store.kv_list(partition_id).get(partition_id, {})}
    clash = [u for u in uids if u in present]
    if clash:
        raise ValueError(f"register_prompts: uid(s) already in partition {partition_id!r}: {clash[:5]} "
                         f"({len(clash)} in total); every prompt needs a fresh uid (protocol.store.keys.new_uid)")
    tag = prompt_tag(global_steps, transition(None, PromptStatus.PENDING))
    return store.kv_batch_put(uids, partition_id, tags=[dict(tag) for _ in uids])


async def _session(agent_loop: AgentLoop, prompt: Any, sampling_params: Mapping[str, Any] | None,
                   session_id: int, kwargs: Mapping[str, Any]) -> list[AgentLoopOutput]:
    versions: list[int] = []
    session_versions.set(versions)  # this session's task has its own context
    outputs = await agent_loop.run(prompt, sampling_params, session_id=session_id, **kwargs)
    if not isinstance(outputs, (list, tuple)) or not outputs:
        raise AgentLoopOutputError(f"{type(agent_loop).__name__}.run must return a non-empty list of "
                                   f"AgentLoopOutput, got {outputs!r:.80}")
    bad = [type(o).__name__ for o in outputs if not isinstance(o, AgentLoopOutput)]
    if bad:
        raise AgentLoopOutputError(f"{type(agent_loop).__name__}.run returned non-AgentLoopOutput items {bad[:3]}")
    if versions:  # the weight versions of its first and last generated chunk (a loop's own tags win)
        for o in outputs:
            o.extra_fields.setdefault("min_global_steps", min(versions))
            o.extra_fields.setdefault("max_global_steps", max(versions))
    return list(outputs)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


async def run_group(store: Any, uid: str, prompt: Any, n: int, agent_loop: AgentLoop, global_steps: int,
                    partition_id: str = "train", sampling_params: Mapping[str, Any] | None = None,
                    inputs: PromptInputs | None = None, **kwargs: Any) -> KVBatchMeta:
    """Run ``n`` sessions of ``agent_loop`` on ``prompt`` for group ``uid`` and write them to ``store``.

    ``kwargs`` go to every ``agent_loop.run`` call (plus ``session_id``), e.g. ``tools_kwargs``; ``inputs``: what
    the group stores once (:class:`PromptInputs`). Returns the
    KVBatchMeta of the written trajectory keys; ``extra_info`` holds ``uid``, ``status``,
    ``num_failed_sessions`` and ``errors``. If the group was cleared while its sessions ran, nothing is written,
    a warning is logged and ``extra_info["status"]`` is ``"cleared"``.
    """
    return await _run_group(GroupWrites(store), uid, prompt, n, agent_loop, global_steps, partition_id,
                            sampling_params, kwargs, inputs)


async def _run_group(writes: GroupWrites, uid: str, prompt: Any, n: int, agent_loop: AgentLoop, global_steps: int,
                     partition_id: str, sampling_params: Mapping[str, Any] | None,
                     kwargs: Mapping[str, Any], inputs: PromptInputs | None = None) -> KVBatchMeta:
    from protocol.store import LateWriteError

    check_uid(uid)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"run_group: n (rollout.n) must be a positive int, got {n!r}")
    if not isinstance(agent_loop, AgentLoop):
        raise TypeError(f"run_group: agent_loop must be an AgentLoop, got {type(agent_loop).__name__}")
    status, _ = _prompt_status(writes.store, uid, partition_id)
    if status is None:
        transition(transition(None, PromptStatus.PENDING), PromptStatus.RUNNING)
        running = prompt_tag(global_steps, PromptStatus.RUNNING)
    else:
        transition(status, PromptStatus.RUNNING)
        running = {"status": PromptStatus.RUNNING.value}

    async def settle(final: PromptStatus, extra: dict[str, Any]) -> bool:
        transition(PromptStatus.RUNNING, final)
        try:
            await writes.put([uid], partition_id, tags=[{"status": final.value, **extra}])
        except LateWriteError:
            logger.warning("group %s was cleared from partition %r while its sessions ran; status %s not written",
                           uid, partition_id, final.value)
            return False
        return True

    def settle_cancelled(summary: dict[str, Any]) -> None:
        """Mark the group failed without waiting: this task is being cancelled, and the write must still happen."""
        transition(PromptStatus.RUNNING, PromptStatus.FAILURE)
        future = writes.put_nowait([uid], partition_id, tags=[{
            "status": PromptStatus.FAILURE.value, **summary,
            "errors": ["CancelledError: run_group was cancelled", *summary.get("errors", [])][:MAX_ERRORS_IN_TAG],
            "num_errors": summary.get("num_errors", 0) + 1}])
        future.add_done_callback(lambda f: f.exception() is None or logger.warning(
            "group %s was cancelled and its failure status was not written: %s", uid, f.exception()))

    cancelled = {"num_sessions": n, "num_failed_sessions": n, "num_trajectories": 0}
    try:
        own = {name: [value] for name, value in inputs.fields.items()} if inputs is not None and inputs.fields \
            else None
        await writes.put([uid], partition_id, fields=own, tags=[running])
        results = await asyncio.gather(*[_session(agent_loop, prompt, sampling_params, s, kwargs) for s in range(n)],
                                       return_exceptions=True)
    except asyncio.CancelledError:  # gather cancelled every session and waited for them to settle
        settle_cancelled(cancelled)
        raise
    ok = {s: r for s, r in enumerate(results) if not isinstance(r, BaseException)}
    failed = {s: r for s, r in enumerate(results) if isinstance(r, BaseException)}
    for s, exc in failed.items():
        if not isinstance(exc, (Exception, asyncio.CancelledError)):
            raise exc  # KeyboardInterrupt / SystemExit: not a session failure
        logger.warning("group %s session %d failed: %s", uid, s, _error_text(exc))
    errors = [f"session {s}: {_error_text(e)}" for s, e in sorted(failed.items())]
    summary = {"num_sessions": n, "num_failed_sessions": len(failed), "errors": errors[:MAX_ERRORS_IN_TAG],
               "num_errors": len(errors)}
    try:
        batch = postprocess_group(uid, ok, global_steps)
        if inputs is not None and inputs.tags:
            for tag in batch.tags:
                tag.update(inputs.tags)
    except Exception as exc:
        await settle(PromptStatus.FAILURE, {**summary, "num_trajectories": 0,
                                            "errors": [f"postprocess: {_error_text(exc)}", *errors][:MAX_ERRORS_IN_TAG],
                                            "num_errors": len(errors) + 1})
        raise
    try:
        if batch.keys:  # one batch put of every trajectory of the group
            meta = await writes.put(batch.keys, partition_id, fields=batch.rows, tags=batch.tags)
        else:
            meta = KVBatchMeta(partition_id, [], [])
    except LateWriteError:
        logger.warning("group %s was cleared from partition %r while its sessions ran; %d trajectories dropped",
                       uid, partition_id, len(batch))
        return KVBatchMeta(partition_id, [], [], {"uid": uid, "status": "cleared", "num_failed_sessions": len(failed),
                                                  "errors": errors, "dropped_trajectories": len(batch)})
    except asyncio.CancelledError:  # the trajectories are written all the same; the group did not finish
        settle_cancelled({**summary, "num_trajectories": len(batch)})
        raise
    final = PromptStatus.FAILURE if failed else PromptStatus.FINISHED
    written = await settle(final, {**summary, "num_trajectories": len(batch)})
    return KVBatchMeta.adopt(partition_id, meta.keys, meta.tags,  # the store's meta: already our own copies
                             {"uid": uid, "status": final.value if written else "cleared",
                              "num_failed_sessions": len(failed), "errors": errors})


async def run_groups(store: Any, uids: Sequence[str], prompts: Sequence[Any], n: int, agent_loop: AgentLoop,
                     global_steps: int, partition_id: str = "train",
                     sampling_params: Mapping[str, Any] | None = None,
                     row_kwargs: Sequence[Mapping[str, Any]] | None = None,
                     inputs: Sequence[PromptInputs | None] | None = None) -> list[KVBatchMeta]:
    """Run :func:`run_group` for every (uid, prompt) concurrently; ``row_kwargs[i]`` go to prompt i's sessions,
    ``inputs[i]`` is what its group stores once (:class:`PromptInputs`).

    Every group settles before this returns; the first exception that is not a session failure (for example a
    post-processing error) is re-raised after all groups settled.
    """
    if len(uids) != len(prompts):
        raise ValueError(f"run_groups: {len(uids)} uids but {len(prompts)} prompts; they must be equal")
    if row_kwargs is not None and len(row_kwargs) != len(prompts):
        raise ValueError(f"run_groups: row_kwargs has {len(row_kwargs)} entries, expected {len(prompts)}")
    if inputs is not None and len(inputs) != len(prompts):
        raise ValueError(f"run_groups: inputs has {len(inputs)} entries, expected {len(prompts)}")
    writes = GroupWrites(store, combine=True)  # the groups' puts of one event-loop turn go as few batch puts
    try:
        results = await asyncio.gather(*[
            _run_group(writes, u, p, n, agent_loop, global_steps, partition_id, sampling_params,
                       dict(row_kwargs[i]) if row_kwargs is not None else {}, inputs[i] if inputs else None)
            for i, (u, p) in enumerate(zip(uids, prompts))], return_exceptions=True)
    finally:
        writes.flush()  # cancelled: the failure statuses the groups queued are written before this returns
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return list(results)
