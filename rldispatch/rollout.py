"""This rank's generation: a rollout engine (:mod:`backends.rollout`), the agent loop over it, and the event loop
its sessions run on, kept across steps. The trainer (validation, and training in sync and colocate_async) and a
separate_async rollout rank generate through it alike."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

from backends.rollout import RolloutEngine, VersionedGenerate
from protocol.fields import IMAGE_GRID_THW, PIXEL_VALUES
from protocol.rollout.agent_loop import PromptInputs, build_agent_loop, builtin_tools, run_groups
from rldispatch.config import RunConfig
from rldispatch.faults import FaultInjectingLoop, fails

__all__ = ["LocalRollout", "run_to_end", "session_kwargs", "prompt_inputs", "prompt_owners", "TRAIN", "VAL",
           "DRIVE_SLICE_S"]

TRAIN, VAL = "train", "val"
#: how long an asynchronous schedule lets generation run between two looks at what finished (each look may be a
#: sync or a mailbox poll)
DRIVE_SLICE_S = 0.02


def run_to_end(loop: asyncio.AbstractEventLoop, coro: Any, cancel_left: bool = True) -> Any:
    """``coro``'s result, run on ``loop``, which the caller keeps across steps (``asyncio.run`` makes and tears down
    a loop per call); tasks it leaves behind are cancelled and awaited, as ``asyncio.run`` does with them, unless
    ``cancel_left`` is false (an asynchronous schedule's generation outlives the call)."""
    try:
        return loop.run_until_complete(coro)
    finally:
        left = asyncio.all_tasks(loop) if cancel_left else set()
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))


def prompt_owners(count: int, holders: Sequence[int]) -> list[int]:
    """The rank that generates (or, in separate_async, receives) and holds prompt ``i`` of a submission of ``count``:
    the reporting rank of DP replica ``i % DP`` (``holders``: each replica's reporting rank, in DP order)."""
    return [holders[i % len(holders)] for i in range(count)]


def session_kwargs(cfg: RunConfig, rows: Sequence[dict], uids: Sequence[str], partition: str,
                   images: bool = True) -> list[dict]:
    """What each prompt's sessions get besides the prompt: the tool loop's ``tools_kwargs`` of its row, a
    vision-language row's processed images (``images``; left out with ``images=False``, for a prompt whose images
    travel in its :func:`prompt_inputs`), and ``inject_failure`` for the groups ``debug.inject_rollout_failures``
    picks (training prompts only)."""
    frac = cfg.debug.inject_rollout_failures if partition == TRAIN else 0.0
    out = []
    for row, uid in zip(rows, uids):
        kw: dict[str, Any] = {}
        mm = row.get("multi_modal_inputs")
        if mm and images:
            kw["images"] = (mm["pixel_values"], mm["image_grid_thw"])
        if cfg.rollout.agent_loop == "tool":
            kw["tools_kwargs"] = (row.get("extra_info") or {}).get("tools_kwargs") or {}
        if fails(uid, frac):
            kw["inject_failure"] = True
        out.append(kw)
    return out


def prompt_inputs(rows: Sequence[dict], vision: Any) -> list[PromptInputs | None] | None:
    """What each row's group stores once: a vision-language row's images on its prompt key, and their attention
    spans (``vision``: the policy's :class:`~backends.model.vision.VisionConfig`) as every trajectory's
    ``vision_spans`` tag. None when no row has images."""
    if not any(row.get("multi_modal_inputs") for row in rows):
        return None
    if vision is None:
        raise ValueError("rows with images need the policy's vision tower (a vision-language model.hf_path)")
    from backends.model.vision import attention_spans

    out: list[PromptInputs | None] = []
    for row in rows:
        mm = row.get("multi_modal_inputs")
        out.append(PromptInputs(
            {PIXEL_VALUES: mm["pixel_values"].reshape(-1).float(), IMAGE_GRID_THW: mm["image_grid_thw"].reshape(-1)},
            {"vision_spans": attention_spans(vision, mm["image_grid_thw"])}) if mm else None)
    return out


class LocalRollout:
    """Generates prompt groups into ``store`` on this rank: ``submit`` starts them (and waits, or leaves them
    running), ``drive`` lets running ones advance, ``cancel`` ends them.

    ``partial``: a response is generated ``rollout.partial_rollout_chunk`` tokens at a time, so a weight sync between
    chunks makes the rest use the new weights (partial rollout). ``rank`` seeds the sampling stream; ``holders`` and
    ``me`` (this rank) say which prompts of a submission this rank generates (:meth:`mine`, :func:`prompt_owners`);
    ``vision``: a vision-language policy's tower config (its rows' images are stored once per group)."""

    def __init__(self, cfg: RunConfig, engine: RolloutEngine, tokenizer: Any, store: Any, *, partial: bool,
                 rank: int = 0, holders: Sequence[int] = (0,), me: int = 0, vision: Any = None):
        self.cfg, self.engine, self.store, self.rank, self.vision = cfg, engine, store, rank, vision
        self.holders, self.me = list(holders), me
        self.loop = asyncio.new_event_loop()
        kwargs = {"max_turns": cfg.rollout.max_turns, "tools": builtin_tools()} \
            if cfg.rollout.agent_loop == "tool" else {}
        generate = VersionedGenerate(engine, cfg.rollout.partial_rollout_chunk if partial else None)
        self.agent_loop = build_agent_loop(cfg.rollout.agent_loop, generate, tokenizer=tokenizer,
                                           max_response_length=cfg.data.max_response_length, **kwargs)
        self.tasks: list[asyncio.Task] = []
        self.busy_s = 0.0  # seconds spent generating (driving the event loop) so far

    def sampling(self, partition: str) -> dict:
        """Training prompts sample at ``rollout.temperature`` / ``top_p``; validation is greedy."""
        if partition == VAL:
            return {"temperature": 0.0, "top_p": 1.0, "max_tokens": self.cfg.data.max_response_length}
        r = self.cfg.rollout
        return {"temperature": r.temperature, "top_p": r.top_p, "max_tokens": self.cfg.data.max_response_length}

    def submit(self, prompts: Sequence[Any], uids: Sequence[str], partition: str, step: int,
               row_kwargs: Sequence[dict], *, seed_batch: int | None, wait: bool = True,
               cancel_left: bool = True, inputs: Sequence[PromptInputs | None] | None = None) -> None:
        """Generate ``rollout.n`` sessions (one for validation) of each prompt, dispatched at ``step``; ``inputs``:
        what each group stores once (:func:`prompt_inputs`).

        ``seed_batch`` restarts the sampling stream as batch ``seed_batch`` of ``partition`` (None: the stream goes
        on). ``wait``: run to the end (tasks left on the loop are cancelled unless ``cancel_left`` is false);
        otherwise the groups run whenever the loop is driven."""
        if not uids:
            return
        if seed_batch is not None:
            self.engine.reseed(self.cfg.trainer.seed * 7919 + seed_batch * 2 + (partition == VAL), rank=self.rank)
        loop = FaultInjectingLoop(self.agent_loop) if any(kw.get("inject_failure") for kw in row_kwargs) \
            else self.agent_loop
        groups = run_groups(self.store, list(uids), list(prompts), self.cfg.rollout.n if partition == TRAIN else 1,
                            loop, step, partition, self.sampling(partition), row_kwargs=list(row_kwargs),
                            inputs=inputs)
        if wait:
            t0 = time.perf_counter()
            run_to_end(self.loop, groups, cancel_left=cancel_left)
            self.busy_s += time.perf_counter() - t0
        else:
            self.tasks.append(self.loop.create_task(groups))

    def mine(self, count: int) -> list[int]:
        """Positions of a submission's prompts this rank generates."""
        return [i for i, owner in enumerate(prompt_owners(count, self.holders)) if owner == self.me]

    def submit_share(self, rows: Sequence[dict], uids: Sequence[str], partition: str, step: int, *,
                     seed_batch: int | None, wait: bool = True, cancel_left: bool = True) -> list[int]:
        """:meth:`submit` of this rank's share (:meth:`mine`) of dataset ``rows``; returns its positions."""
        mine = self.mine(len(rows))
        picked_rows, picked_uids = [rows[i] for i in mine], [uids[i] for i in mine]
        # a vision-language row comes with its prompt ids (image tokens expanded); a text row with its messages
        self.submit([r.get("prompt_ids", r["raw_prompt"]) for r in picked_rows], picked_uids, partition, step,
                    session_kwargs(self.cfg, picked_rows, picked_uids, partition), seed_batch=seed_batch, wait=wait,
                    cancel_left=cancel_left, inputs=prompt_inputs(picked_rows, self.vision))
        return mine

    def in_flight(self) -> int:
        """Submissions still running."""
        self.tasks = [task for task in self.tasks if not task.done()]
        return len(self.tasks)

    def drive(self, seconds: float) -> float:
        """Let the running submissions advance for up to ``seconds`` (less when they all end first); returns the
        seconds spent. An error that is not a session failure (those are in the group's tag) is raised here."""
        if not self.in_flight():
            return 0.0
        t0 = time.perf_counter()
        done, _ = self.loop.run_until_complete(asyncio.wait(self.tasks, timeout=seconds))
        spent = time.perf_counter() - t0
        self.busy_s += spent
        for task in done:
            task.result()
        return spent

    def cancel(self) -> int:
        """Cancel every session on the loop; returns how many tasks were still running."""
        left = [task for task in asyncio.all_tasks(self.loop) if not task.done()]
        for task in left:
            task.cancel()
        if left:
            self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        self.tasks = []
        return len(left)

    def close(self) -> None:
        """Release the engine (a server process, for an inference engine) and the event loop."""
        self.engine.close()
        self.loop.close()
