"""trainer.mode=separate_async, the training side: generation on the rollout ranks, fed from the prompt stream.

Each submitted prompt has an owner: the reporting rank of DP replica ``i % DP`` for the submission's prompt ``i``,
the rank that would have generated it in the other modes. The owner registers the prompt's pending tag in its shard
of the training store; training rank 0 posts the prompts (with their owners) to the rollout ranks, round robin; a
finished group travels from its rollout rank straight to its owner, which writes it into its shard. The sample stage
looks at the buffer after each look at the mailboxes and a tag sync. The weights of every global step are broadcast
to the rollout ranks (the broadcast is waited for at the next one, so the trainer does not wait for a rollout rank to
reach a pause). The transport is :mod:`rldispatch.separate.transport`; the rollout ranks run
:mod:`rldispatch.separate.rollout_rank`.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from protocol.rollout.agent_loop import register_prompts
from protocol.store.errors import LateWriteError
from rldispatch.config import vision_config
from rldispatch.rollout import TRAIN, prompt_inputs, prompt_owners, session_kwargs
from rldispatch.schedules.base import Seams, register_schedule
from rldispatch.schedules.streaming import StreamingSchedule
from rldispatch.separate.transport import (POLL_S, Mailbox, Split, broadcast_weights, flat_weights, record_checksum,
                                           unpack_fields, weights_checksum)
from rldispatch.step_state import StepState

__all__ = ["SeparateAsyncSchedule"]

logger = logging.getLogger(__name__)


@register_schedule
class SeparateAsyncSchedule(StreamingSchedule):
    """The training side of the split world (module docstring)."""

    name = "separate_async"
    splits_world = True

    def __init__(self, seams: Seams, step: int):
        super().__init__(seams, step)
        self.split: Split = seams.link
        self.main = self.split.rank == 0  # posts the prompts, broadcasts the weights, hears the heartbeats
        self.mail = Mailbox(self.split.store, self.split.rank)
        self.peers = self.split.rollout_globals
        self.heard = {p: time.monotonic() for p in self.peers}
        self.reports = {p: {"busy_s": 0.0, "wall_s": 0.0} for p in self.peers}
        self._window = dict(self.reports)
        self._weights: list[tuple[torch.Tensor, Any]] = []
        self.received_groups = 0
        self.silent: set[int] = set()  # rollout ranks that stopped answering (shutdown does not wait for them)
        self.payloads = {p: 0 for p in self.peers}  # payloads received from each rollout rank (acknowledged)

    # ---- submission ---------------------------------------------------------------------------------------------
    def _submit(self, rows: list[dict], uids: list[str], step: int, seed_batch: int | None) -> None:
        owners = prompt_owners(len(uids), self.seams.holders)
        mine = [u for u, o in zip(uids, owners) if o == self.split.rank]
        if mine:  # pending tags where the groups will be, so the buffer counts them in flight at once
            register_prompts(self.seams.store, mine, step, TRAIN)
        if not (self.main and uids):
            return
        # a prompt's images travel once, in its inputs; the rollout rank gives them to its sessions
        kwargs = session_kwargs(self.seams.cfg, rows, uids, TRAIN, images=False)
        vl = vision_config(self.seams.cfg)
        inputs = prompt_inputs(rows, vl.vision if vl is not None else None) or [None] * len(rows)
        for n, p in enumerate(self.peers):
            picked = range(n, len(uids), len(self.peers))
            items = [(uids[i], rows[i].get("prompt_ids", rows[i]["raw_prompt"]), kwargs[i], owners[i], inputs[i])
                     for i in picked]
            if items:
                self.mail.post(p, ("submit", step, seed_batch, items))

    def begin(self, step: int) -> None:
        self.sync_weights(self.seams.actor_weights(), step)  # before any prompt: the rollout has no weights
        super().begin(step)

    # ---- the mailbox ----------------------------------------------------------------------------------------------
    def _receive(self) -> int:
        """Read this rank's mailboxes: write the groups it owns that arrived into its shard of the store; returns
        how many. Training rank 0 also takes the heartbeats and watches for a silent rollout rank."""
        got = 0
        now = time.monotonic()
        for p in self.peers:
            messages = self.mail.poll(p)
            if messages:
                self.heard[p] = now
            payloads = self.payloads[p]
            for message in messages:
                if message[0] == "groups":
                    got += self._accept(p, message[1])
                    self.reports[p] = message[1]["stats"]
                elif message[0] == "stats":
                    self.reports[p] = message[1]
                else:
                    raise RuntimeError(f"rollout rank {p} sent {message[0]!r} before the trainer stopped it")
            if self.payloads[p] != payloads:
                self.mail.post(p, ("ack", self.payloads[p]))
            if self.main and now - self.heard[p] > self.split.timeout_s:
                self.silent.add(p)
                raise TimeoutError(f"rollout rank {p} sent nothing for {now - self.heard[p]:.0f}s "
                                   f"(trainer.dist_timeout_s={self.split.timeout_s:g})")
        return got

    def _accept(self, peer: int, header: dict, keep: bool = True) -> int:
        payload = torch.empty(header["nbytes"], dtype=torch.uint8)
        if header["nbytes"]:
            self.split.bridge.recv([payload], peer, 0).wait()
            self.payloads[peer] += 1
        if not keep:
            return 0
        store, uids = self.seams.store, header["uids"]
        trajectories, images = unpack_fields(header, payload)
        try:
            if header["keys"]:
                store.kv_batch_put(header["keys"], TRAIN, trajectories, header["tags"])
            if images is not None:  # a vision-language group's images, once, on its prompt key
                store.kv_batch_put(header["image_uids"], TRAIN, images)
            store.kv_batch_put(uids, TRAIN, tags=header["prompt_tags"])
        except LateWriteError:  # cleared meanwhile (shutdown): nothing of it is trained
            logger.warning("groups %s arrived after they were cleared; dropped", uids[:3])
            return 0
        self.received_groups += len(uids)
        return len(uids)

    def _idle(self, _poll: float) -> None:
        got = self._receive()
        self.seams.store.sync()  # every training rank decides from the same listing
        if not got:
            time.sleep(POLL_S)

    def sample(self, st: StepState, batch_size: int):
        self._receive()
        return super().sample(st, batch_size)

    # ---- weights ----------------------------------------------------------------------------------------------
    def sync_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Broadcast ``weights`` (version ``version``) from training rank 0 to the rollout ranks, cast to the rollout
        engine's dtypes."""
        if not self.main:
            return
        for _, work in self._weights:  # the previous sync reached every rollout rank
            work.wait()
        dtypes = self.seams.rollout.engine.weight_dtypes()
        spec, flats = flat_weights(weights, dtypes, self.split.device)
        for p in self.peers:
            self.mail.post(p, ("weights", version, spec, [f.numel() for f in flats]))
        self._weights = broadcast_weights(self.split.weights, flats)
        cfg = self.seams.cfg
        if cfg.debug.weight_checksums:
            local = {name: weights[name].detach().to(dtypes[name]) for name in weights}
            record_checksum(cfg.trainer.run_dir, "trainer", self.split.rank, version, weights_checksum(local))

    # ---- metrics ----------------------------------------------------------------------------------------------
    def step_metrics(self, st: StepState, seconds: float) -> dict[str, float]:
        out = super().step_metrics(st, seconds)
        st.stats.per_rank("async/groups_received", float(self.received_groups))  # the groups each rank owns
        self.received_groups = 0
        self._receive()
        if self.main:
            shares = []
            for p in self.peers:
                before, now = self._window[p], self.reports[p]
                wall = now["wall_s"] - before["wall_s"]
                if wall > 0:
                    shares.append(1.0 - (now["busy_s"] - before["busy_s"]) / wall)
            self._window = dict(self.reports)
            idle = seconds * max(sum(shares) / len(shares), 0.0) if shares else seconds
        else:
            idle = 0.0
        out["timing_s/rollout_idle"] = idle  # every training rank logs rank 0's figure (only rank 0 writes)
        return out

    # ---- shutdown ---------------------------------------------------------------------------------------------
    def _await_stop(self, p: int) -> dict | None:
        """Rollout rank ``p``'s ``stopped`` report, receiving (and dropping) the groups it sent meanwhile; None
        when it does not come within ``trainer.dist_timeout_s``."""
        deadline = time.monotonic() + self.split.timeout_s
        while True:
            for message in self.mail.poll(p):
                if message[0] == "groups":
                    self._accept(p, message[1], keep=False)
                elif message[0] == "stopped":
                    return message[1]
            if time.monotonic() > deadline:
                return None
            time.sleep(POLL_S)

    def end(self) -> int:
        """Stop the rollout ranks (training rank 0 tells them; they cancel what is in flight and clear their keys),
        receive and drop on every training rank what they sent it meanwhile, then clear the training store; no rank
        waits past ``trainer.dist_timeout_s`` for another."""
        failures = []
        if self.main:
            for p in self.peers:
                self.mail.post(p, ("stop",))
        for p in self.peers:
            if p in self.silent:
                failures.append(f"rollout rank {p} stopped answering")
                continue
            stopped = self._await_stop(p)
            if stopped is None:
                failures.append(f"rollout rank {p} did not stop within {self.split.timeout_s:g}s "
                                "(trainer.dist_timeout_s)")
                self.silent.add(p)
                continue
            if self.main:
                logger.info("rollout rank %d stopped: %d key(s) of groups in flight cleared, %d left", p,
                            stopped["cleared"], stopped["left"])
                if stopped["left"]:
                    failures.append(f"rollout rank {p} left {stopped['left']} key(s)")
        if self.main:
            if not self.silent:  # the last broadcast reached every rollout rank (a silent one never receives it)
                for _, work in self._weights:
                    work.wait()
            self._weights = []
        self._clear_store(self.seams.rollout.cancel())
        if failures:
            raise RuntimeError("separate_async shutdown: " + "; ".join(failures))
        return 0
