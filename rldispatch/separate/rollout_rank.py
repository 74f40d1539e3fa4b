"""A separate_async rollout rank's loop: generate what the trainer posts, ship finished groups, take new weights."""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from backends.rollout import build_rollout_engine
from protocol.fields import IMAGE_GRID_THW, PIXEL_VALUES
from protocol.rollout.agent_loop import PromptInputs, register_prompts
from protocol.rollout.tokenizer import load_tokenizer, resolve_tokenizer
from protocol.store import LocalStore
from protocol.store.keys import is_prompt_key
from rldispatch.config import RunConfig, vision_config
from rldispatch.rollout import DRIVE_SLICE_S, TRAIN, LocalRollout
from rldispatch.separate.transport import (HEARTBEAT_S, POLL_S, TERMINAL, Mailbox, Split, pack_groups,
                                           receive_weights, record_checksum, weights_checksum)

__all__ = ["RolloutRank"]

logger = logging.getLogger(__name__)


class RolloutRank:
    """A rollout rank: generates the prompts training rank 0 posts, ships each group to the training rank that owns
    it when it is terminal, loads the weights of every global step, and stops when told (or when the trainer is
    silent for ``trainer.dist_timeout_s`` while there is nothing to generate)."""

    def __init__(self, cfg: RunConfig, split: Split):
        self.cfg, self.split = cfg, split
        self.index = split.rank - split.train_ranks
        self.mail = Mailbox(split.store, split.rank)
        self.trainers = list(range(split.train_ranks))  # every training rank may own groups (and acknowledges them)
        self.owner: dict[str, int] = {}  # uid -> the training rank its group goes to
        tokenizer = load_tokenizer(resolve_tokenizer(cfg.data.tokenizer, cfg.model.hf_path))
        self.vl = vision_config(cfg)  # a vision-language policy: its prompts come with their images
        engine = build_rollout_engine(cfg.rollout.engine, self.vl or cfg.model, tokenizer, device=split.device,
                                      seed=cfg.trainer.seed, rank=self.index, options=cfg.rollout)
        self.store = LocalStore()
        self.rollout = LocalRollout(cfg, engine, tokenizer, self.store, rank=self.index,
                                    partial=cfg.rollout.partial_rollout is not False,
                                    vision=self.vl.vision if self.vl is not None else None)
        self.image_uids: set[str] = set()  # groups whose prompt key holds images (shipped with them)
        # per owner: payloads sent and not yet acknowledged (gloo send works cannot be polled), kept alive, and how
        # many it has received
        self.sends: dict[int, list[tuple[torch.Tensor, Any]]] = {t: [] for t in self.trainers}
        self.acked = {t: 0 for t in self.trainers}
        self.started = time.perf_counter()
        self._beat = 0.0

    def _stats(self) -> dict[str, float]:
        return {"busy_s": self.rollout.busy_s, "wall_s": time.perf_counter() - self.started}

    def serve(self) -> int:
        """Run until the trainer says stop; returns the exit code (0)."""
        heard = None  # the silence limit starts with the trainer's first message (its start-up and first
        # validation involve no rollout rank, however long they take)
        try:
            while True:
                for src in self.trainers:
                    messages = self.mail.poll(src)
                    if messages and src == 0:
                        heard = time.monotonic()
                    for message in messages:
                        if message[0] == "stop":
                            return self._stop()
                        getattr(self, f"_on_{message[0]}")(src, *message[1:])
                if self.rollout.in_flight():
                    self.rollout.drive(DRIVE_SLICE_S)
                    self._ship()
                else:
                    if heard is not None and time.monotonic() - heard > self.split.timeout_s:
                        raise TimeoutError(f"rollout rank {self.split.rank}: nothing to generate and no message "
                                           f"from the trainer for {self.split.timeout_s:.0f}s "
                                           "(trainer.dist_timeout_s)")
                    time.sleep(POLL_S)
                if time.perf_counter() - self._beat > HEARTBEAT_S:
                    self._beat = time.perf_counter()
                    self.mail.post(0, ("stats", self._stats()))
        finally:
            self.rollout.cancel()
            self.rollout.close()

    # ---- messages ---------------------------------------------------------------------------------------------
    def _on_submit(self, _src: int, step: int, seed_batch: int | None,
                   items: list[tuple[str, Any, dict, int, PromptInputs | None]]) -> None:
        """Generate the prompts ``items`` ((uid, prompt, session kwargs, owner, what the group stores once: a
        vision-language prompt's images)), dispatched at ``step``."""
        uids = [u for u, *_ in items]
        self.owner.update((u, owner) for u, _, _, owner, _ in items)
        inputs = [i for *_, i in items]
        kwargs = [dict(kw) for _, _, kw, _, _ in items]
        for uid, kw, given in zip(uids, kwargs, inputs):
            if given is not None:  # the images travelled once, flattened, in the inputs
                kw["images"] = (given.fields[PIXEL_VALUES].view(-1, self.vl.vision.patch_dim),
                                given.fields[IMAGE_GRID_THW].view(-1, 3))
                self.image_uids.add(uid)
        register_prompts(self.store, uids, step, TRAIN)
        self.rollout.submit([p for _, p, *_ in items], uids, TRAIN, step, kwargs, seed_batch=seed_batch,
                            wait=False, inputs=inputs if any(i is not None for i in inputs) else None)

    def _on_weights(self, _src: int, version: int, spec: list[tuple[str, list[int], str]], sizes: list[int]) -> None:
        """Receive the broadcast that follows this message and load it as weights ``version``."""
        engine = self.rollout.engine
        engine.load_weights(receive_weights(self.split.weights, spec, sizes, self.split.device), version=version)
        if self.cfg.debug.weight_checksums:
            record_checksum(self.cfg.trainer.run_dir, "rollout", self.split.rank, version,
                            weights_checksum(engine.get_weights()))

    # ---- generation -------------------------------------------------------------------------------------------
    def _ship(self) -> None:
        """Send every terminal group to the training rank that owns it (announce, then the payload over the
        bridge); forget it."""
        listing = self.store.kv_list(TRAIN)[TRAIN]
        ready = [k for k, tag in listing.items() if is_prompt_key(k) and tag.get("status") in TERMINAL]
        by_owner: dict[int, list[str]] = {}
        for uid in ready:
            by_owner.setdefault(self.owner.pop(uid), []).append(uid)
        for owner, uids in sorted(by_owner.items()):
            header, payload = pack_groups(self.store, uids, self.image_uids.intersection(uids))
            self.image_uids.difference_update(uids)
            header["stats"] = self._stats()
            self.mail.post(owner, ("groups", header))
            if payload.numel():
                self.sends[owner].append((payload, self.split.bridge.send([payload], owner, 0)))
            self.store.kv_clear(header["keys"] + uids, TRAIN)

    def _on_ack(self, src: int, received: int) -> None:
        """Training rank ``src`` has received ``received`` payloads in all: their sends are complete."""
        while self.acked[src] < received:
            self.sends[src].pop(0)[1].wait()
            self.acked[src] += 1

    def _stop(self) -> int:
        """Cancel what is in flight, clear every key, tell the trainer how many keys were left (0)."""
        self.rollout.cancel()
        for sends in self.sends.values():
            for _, work in sends:
                work.wait()  # every owner receives every payload announced to it before the stop
        self.sends = {t: [] for t in self.trainers}
        known = list(self.store.kv_list(TRAIN).get(TRAIN, {}))
        if known:
            self.store.kv_clear(known, TRAIN)
        report = {"cleared": len(known), "left": self.store.num_keys(), **self._stats()}
        for t in self.trainers:  # every training rank drains its mailbox until it hears this
            self.mail.post(t, ("stopped", report))
        logger.info("rollout rank %d stopped: %d key(s) of groups in flight cleared", self.split.rank, len(known))
        return 0
