"""trainer.mode=separate_async: the torchrun world split into training ranks and rollout ranks.

The last ``trainer.separate_async.rollout_ranks`` ranks only generate; the others only train. Each side gets a
default process group of its own (the training ranks' is what the engines, the topology, the logical DP and every
step collective see, so FSDP and Megatron run on the training ranks as on a world of that size), built from the
launch's rendezvous store under its own prefix. Between the sides:

* a **mailbox** on the rendezvous store carries small pickled messages (prompts to generate, the announcement of a
  transfer, heartbeats with the rollout's busy time, stop), read by polling, so neither side blocks on the other;
* the **bridge** (a gloo group of training rank 0 and the rollout ranks) carries the finished groups' trajectories
  (rollout -> training rank 0, which holds them in the training store);
* the **weights group** (NCCL on GPU, gloo on CPU; same members) broadcasts the weights from training rank 0 after
  every global step.

The training side's schedule is :class:`SeparateAsyncSchedule` (colocate_async's prompt stream, replay buffer,
resume and shutdown, with generation somewhere else); the rollout side runs :meth:`RolloutRank.serve`.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from protocol.batch.nested import nested_from_values
from protocol.rollout.agent_loop import build_agent_loop, builtin_tools, register_prompts, run_groups
from protocol.rollout.tokenizer import load_tokenizer, resolve_tokenizer
from protocol.store import LocalStore
from protocol.store.errors import LateWriteError
from protocol.store.keys import TERMINAL_STATUSES, is_prompt_key
from protocol.store.meta import KVBatchMeta
from rldispatch.config import ConfigError, RunConfig
from rldispatch.faults import FaultInjectingLoop, fails
from rldispatch.rollout import RolloutWorker, VersionedGenerate
from rldispatch.schedule import DRIVE_SLICE_S, TRAIN, ColocateAsyncSchedule

__all__ = ["Split", "split_world", "Mailbox", "RolloutRank", "SeparateAsyncSchedule", "weights_checksum",
           "HEARTBEAT_S"]

logger = logging.getLogger(__name__)
#: a rollout rank reports its busy time (and that it is alive) at least this often
HEARTBEAT_S = 0.5
_TERMINAL = {s.value for s in TERMINAL_STATUSES}
_POLL_S = 0.002  # sleep between two looks at an empty mailbox


@dataclass
class Split:
    """This process's place in the split world (``role`` ``train`` or ``rollout``) and the links between sides."""

    role: str
    rank: int  # global rank
    world: int  # global world size
    train_ranks: int
    store: Any  # the launch's rendezvous store
    bridge: Any = None  # gloo group of training rank 0 + the rollout ranks (None on other training ranks)
    weights: Any = None  # the weights group (same members; NCCL on GPU)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout_s: float = 300.0

    @property
    def bridge_rank(self) -> int:
        """0 for training rank 0, 1 + i for rollout rank i."""
        return 0 if self.role == "train" else 1 + self.rank - self.train_ranks

    @property
    def rollout_ranks(self) -> int:
        return self.world - self.train_ranks


def split_world(cfg: RunConfig) -> Split:
    """Rendezvous with every rank of the launch, then give each side its default process group and build the
    bridge and weights groups. ``trainer.separate_async.rollout_ranks`` must leave at least one training rank."""
    timeout = timedelta(seconds=float(cfg.trainer.dist_timeout_s))
    if "RANK" not in os.environ:
        raise ConfigError("trainer.mode=separate_async needs a torchrun launch of at least 2 ranks (rollout and "
                          "training ranks apart); a plain python run is a world of one")
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    rollout = cfg.trainer.separate_async.rollout_ranks
    if rollout >= world:
        raise ConfigError(f"trainer.separate_async.rollout_ranks={rollout} leaves no training rank in a world of "
                          f"{world} (torchrun --nproc_per_node); it must be < {world}")
    use_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
    device = torch.device("cpu")
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    train = world - rollout
    role = "train" if rank < train else "rollout"
    side_rank, side_world = (rank, train) if role == "train" else (rank - train, rollout)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.PrefixStore(f"rldispatch/{role}", store),
                            rank=side_rank, world_size=side_world, timeout=timeout)
    split = Split(role, rank, world, train, store, device=device, timeout_s=float(cfg.trainer.dist_timeout_s))
    if role == "rollout" or rank == 0:
        members, me = rollout + 1, split.bridge_rank
        split.bridge = dist.ProcessGroupGloo(dist.PrefixStore("rldispatch/bridge", store), me, members, timeout)
        if use_cuda:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            split.weights = dist.ProcessGroupNCCL(dist.PrefixStore("rldispatch/weights", store), me, members, opts)
        else:
            split.weights = dist.ProcessGroupGloo(dist.PrefixStore("rldispatch/weights", store), me, members,
                                                  timeout)
    logger.info("separate_async: rank %d of %d is a %s rank (%d training, %d rollout)", rank, world, role, train,
                rollout)
    return split


class Mailbox:
    """Ordered pickled messages between bridge ranks through the rendezvous store: ``post`` never blocks, ``poll``
    returns what has arrived (nothing blocks on a peer that is busy)."""

    def __init__(self, store: Any, me: int):
        self.store = dist.PrefixStore("rldispatch/mail", store)
        self.me = me
        self._sent: dict[int, int] = {}
        self._read: dict[int, int] = {}

    def post(self, dst: int, message: Any) -> None:
        seq = self._sent.get(dst, 0)
        self.store.set(f"{self.me}-{dst}/{seq}", pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        self._sent[dst] = seq + 1

    def poll(self, src: int) -> list[Any]:
        """Every message ``src`` posted here that has not been read yet, in order."""
        out = []
        while True:
            key = f"{src}-{self.me}/{self._read.get(src, 0)}"
            if not self.store.check([key]):
                return out
            out.append(pickle.loads(self.store.get(key)))
            self.store.delete_key(key)
            self._read[src] = self._read.get(src, 0) + 1


# ---- what travels -------------------------------------------------------------------------------------------------
def _pack_groups(store: LocalStore, uids: list[str]) -> tuple[dict, torch.Tensor]:
    """The finished groups ``uids`` of ``store`` as (header, payload): the prompt tags, every trajectory key with its
    tag, and each field's values and offsets in one uint8 buffer (the header says where)."""
    listing = store.kv_list(TRAIN)[TRAIN]
    wanted = set(uids)
    keys = [k for k in listing if not is_prompt_key(k) and k.split("_", 1)[0] in wanted]
    header: dict[str, Any] = {"uids": uids, "prompt_tags": [listing[u] for u in uids], "keys": keys,
                              "tags": [listing[k] for k in keys], "fields": []}
    chunks: list[torch.Tensor] = []
    if keys:
        for name, (values, offsets) in store.kv_batch_get_packed(keys, TRAIN, None).items():
            entry = [name, str(values.dtype).removeprefix("torch."), list(values.shape), None]
            chunks.append(values.contiguous().reshape(-1).view(torch.uint8))
            if offsets is not None:
                entry[3] = offsets.numel()
                chunks.append(offsets.to(torch.int64).contiguous().view(torch.uint8))
            header["fields"].append(entry)
    payload = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
    header["nbytes"] = payload.numel()
    return header, payload


def _unpack_fields(header: dict, payload: torch.Tensor) -> TensorDict | None:
    """The fields of :func:`_pack_groups`'s keys, as the store's batch (jagged where they were)."""
    if not header["keys"]:
        return None
    at, fields = 0, {}
    for name, dtype, shape, n_offsets in header["fields"]:
        dt = getattr(torch, dtype)
        size = int(torch.Size(shape).numel()) * dt.itemsize
        values = payload[at:at + size].clone().view(dt).reshape(shape)  # a copy of its own: aligned for its dtype
        at += size
        if n_offsets is None:
            fields[name] = values
        else:
            offsets = payload[at:at + n_offsets * 8].clone().view(torch.int64)
            at += n_offsets * 8
            fields[name] = nested_from_values(values, offsets)
    return TensorDict(fields, batch_size=[len(header["keys"])])


def _flat_weights(weights: dict[str, torch.Tensor], like: dict[str, torch.Tensor], device: torch.device
                  ) -> tuple[list[tuple[str, list[int], str]], list[torch.Tensor]]:
    """The weights cast to the rollout model's dtypes (``like``), one flat buffer per dtype, in name order."""
    spec, by_dtype = [], {}
    for name in sorted(weights):
        t = weights[name].detach().to(like[name].dtype)
        spec.append((name, list(t.shape), str(t.dtype).removeprefix("torch.")))
        by_dtype.setdefault(t.dtype, []).append(t.reshape(-1))
    flats = [torch.cat(parts).to(device) for _, parts in sorted(by_dtype.items(), key=lambda kv: str(kv[0]))]
    return spec, flats


def _dtypes_of(spec: list[tuple[str, list[int], str]]) -> list[str]:
    return sorted({dtype for _, _, dtype in spec})


def weights_checksum(weights: dict[str, torch.Tensor]) -> str:
    """sha256 over the weights' raw bytes in name order (equal on two sides only if every value is)."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _record_checksum(run_dir: str, side: str, rank: int, version: int, checksum: str) -> None:
    path = Path(run_dir) / "weight_sync.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps({"side": side, "rank": rank, "version": version, "checksum": checksum}) + "\n")


# ---- the rollout side ---------------------------------------------------------------------------------------------
class RolloutRank:
    """A rollout rank: generates the prompts the trainer posts, ships each group to training rank 0 when it is
    terminal, loads the weights of every global step, and stops when told (or when the trainer is silent for
    ``trainer.dist_timeout_s`` while there is nothing to generate)."""

    def __init__(self, cfg: RunConfig, split: Split):
        self.cfg, self.split = cfg, split
        self.index = split.rank - split.train_ranks
        self.mail = Mailbox(split.store, split.bridge_rank)
        self.tokenizer = load_tokenizer(resolve_tokenizer(cfg.data.tokenizer, cfg.model.hf_path))
        self.worker = RolloutWorker(cfg.model, self.tokenizer, device=split.device, seed=cfg.trainer.seed,
                                    rank=self.index)
        self.store = LocalStore()
        self.loop = asyncio.new_event_loop()
        partial = cfg.rollout.partial_rollout is not False
        generate = VersionedGenerate(self.worker, cfg.rollout.partial_rollout_chunk if partial else None)
        kwargs = {"max_turns": cfg.rollout.max_turns, "tools": builtin_tools()} \
            if cfg.rollout.agent_loop == "tool" else {}
        self.agent_loop = build_agent_loop(cfg.rollout.agent_loop, generate, tokenizer=self.tokenizer,
                                           max_response_length=cfg.data.max_response_length, **kwargs)
        self.tasks: list[asyncio.Task] = []
        # payloads sent to the trainer and not yet acknowledged (gloo send works cannot be polled), kept alive
        self.sends: list[tuple[torch.Tensor, Any]] = []
        self.acked = 0  # payloads the trainer has received
        self.busy_s = 0.0
        self.started = time.perf_counter()
        self._beat = 0.0

    def _stats(self) -> dict[str, float]:
        return {"busy_s": self.busy_s, "wall_s": time.perf_counter() - self.started}

    def serve(self) -> int:
        """Run until the trainer says stop; returns the exit code (0)."""
        heard = None  # the silence limit starts with the trainer's first message (its start-up and first
        # validation involve no rollout rank, however long they take)
        try:
            while True:
                messages = self.mail.poll(0)
                if messages:
                    heard = time.monotonic()
                for message in messages:
                    if message[0] == "stop":
                        return self._stop()
                    getattr(self, f"_on_{message[0]}")(*message[1:])
                self.tasks = [t for t in self.tasks if not t.done()]
                if self.tasks:
                    self._drive(DRIVE_SLICE_S)
                    self._ship()
                else:
                    if heard is not None and time.monotonic() - heard > self.split.timeout_s:
                        raise TimeoutError(f"rollout rank {self.split.rank}: nothing to generate and no message "
                                           f"from the trainer for {self.split.timeout_s:.0f}s "
                                           "(trainer.dist_timeout_s)")
                    time.sleep(_POLL_S)
                if time.perf_counter() - self._beat > HEARTBEAT_S:
                    self._beat = time.perf_counter()
                    self.mail.post(0, ("stats", self._stats()))
        finally:
            self._cancel()
            self.loop.close()

    # ---- messages ---------------------------------------------------------------------------------------------
    def _on_submit(self, step: int, seed_batch: int | None, items: list[tuple[str, Any, dict]]) -> None:
        """Generate the prompts ``items`` ((uid, raw prompt, session kwargs)), dispatched at ``step``."""
        uids = [u for u, _, _ in items]
        register_prompts(self.store, uids, step, TRAIN)
        if seed_batch is not None:
            self.worker.reseed(self.cfg.trainer.seed * 7919 + seed_batch * 2, rank=self.index)
        loop = FaultInjectingLoop(self.agent_loop) if any(kw.get("inject_failure") for _, _, kw in items) \
            else self.agent_loop
        groups = run_groups(self.store, uids, [p for _, p, _ in items], self.cfg.rollout.n, loop, step, TRAIN,
                            self._sampling(), row_kwargs=[kw for _, _, kw in items])
        self.tasks.append(self.loop.create_task(groups))

    def _sampling(self) -> dict:
        r = self.cfg.rollout
        return {"temperature": r.temperature, "top_p": r.top_p, "max_tokens": self.cfg.data.max_response_length}

    def _on_weights(self, version: int, spec: list[tuple[str, list[int], str]], sizes: list[int]) -> None:
        """Receive the broadcast that follows this message and load it as weights ``version``."""
        flats = []
        for dtype, size in zip(_dtypes_of(spec), sizes):
            buf = torch.empty(size, dtype=getattr(torch, dtype), device=self.split.device)
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self.split.weights.broadcast([buf], opts).wait()
            flats.append(buf)
        at = {dtype: 0 for dtype in _dtypes_of(spec)}
        by_dtype = dict(zip(_dtypes_of(spec), flats))
        weights = {}
        for name, shape, dtype in spec:
            n = int(torch.Size(shape).numel())
            weights[name] = by_dtype[dtype][at[dtype]:at[dtype] + n].view(shape)
            at[dtype] += n
        self.worker.load_weights(weights, version=version)
        if self.cfg.debug.weight_checksums:
            _record_checksum(self.cfg.trainer.run_dir, "rollout", self.split.rank, version,
                             weights_checksum(self.worker.get_weights()))

    # ---- generation -------------------------------------------------------------------------------------------
    def _drive(self, seconds: float) -> None:
        t0 = time.perf_counter()
        done, _ = self.loop.run_until_complete(asyncio.wait(self.tasks, timeout=seconds))
        self.busy_s += time.perf_counter() - t0
        for task in done:
            task.result()  # an error that is not a session failure stops the rank (and the launch)

    def _ship(self) -> None:
        """Send every terminal group to training rank 0 (announce, then the payload over the bridge); forget it."""
        listing = self.store.kv_list(TRAIN)[TRAIN]
        ready = [k for k, tag in listing.items() if is_prompt_key(k) and tag.get("status") in _TERMINAL]
        if not ready:
            return
        header, payload = _pack_groups(self.store, ready)
        header["stats"] = self._stats()
        self.mail.post(0, ("groups", header))
        if payload.numel():
            self.sends.append((payload, self.split.bridge.send([payload], 0, 0)))
        self.store.kv_clear(header["keys"] + ready, TRAIN)

    def _on_ack(self, received: int) -> None:
        """The trainer has received ``received`` payloads in all: their sends are complete."""
        while self.acked < received:
            self.sends.pop(0)[1].wait()
            self.acked += 1

    def _cancel(self) -> None:
        left = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for task in left:
            task.cancel()
        if left:
            self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        self.tasks = []

    def _stop(self) -> int:
        """Cancel what is in flight, clear every key, tell the trainer how many keys were left (0)."""
        self._cancel()
        for _, work in self.sends:
            work.wait()  # the trainer receives every payload announced before the stop
        self.sends = []
        known = list(self.store.kv_list(TRAIN).get(TRAIN, {}))
        if known:
            self.store.kv_clear(known, TRAIN)
        self.mail.post(0, ("stopped", {"cleared": len(known), "left": self.store.num_keys(), **self._stats()}))
        logger.info("rollout rank %d stopped: %d key(s) of groups in flight cleared", self.split.rank, len(known))
        return 0


# ---- the training side --------------------------------------------------------------------------------------------
class SeparateAsyncSchedule(ColocateAsyncSchedule):
    """colocate_async's prompt stream, buffer, resume and shutdown, with generation on the rollout ranks.

    Training rank 0 registers each submitted prompt's pending tag in the training store and posts the prompt to a
    rollout rank (round robin); the finished groups come back to it and are written into its store; the sample
    stage looks at the buffer after each look at the mailbox and a tag sync, as colocate_async does after each
    slice of generation. The weights of every global step are broadcast to the rollout ranks (the broadcast is
    waited for at the next one, so the trainer does not wait for a rollout rank to reach a pause)."""

    name = "separate_async"
    keeps_generating = False  # no training generation on the trainer's own loop (validation runs there)

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        self.warmup = trainer.cfg.trainer.separate_async.num_warmup_batches
        self.split: Split = trainer.ctx.link
        self.main = self.split.bridge is not None
        self.mail = Mailbox(self.split.store, 0) if self.main else None
        self.peers = list(range(1, self.split.rollout_ranks + 1))
        self.heard = {p: time.monotonic() for p in self.peers}
        self.reports = {p: {"busy_s": 0.0, "wall_s": 0.0} for p in self.peers}
        self._window = dict(self.reports)
        self._weights: list[tuple[torch.Tensor, Any]] = []
        self.received_groups = 0
        self.silent: set[int] = set()  # rollout ranks that stopped answering (shutdown does not wait for them)
        self.payloads = {p: 0 for p in self.peers}  # payloads received from each rollout rank (acknowledged)

    # ---- submission ---------------------------------------------------------------------------------------------
    def _submit(self, count: int, step: int, seed_batch: int | None, numbers: list[int] | None = None
                ) -> tuple[list[dict], list[str]]:
        t = self.t
        rows, uids = self._take_prompts(count, numbers)
        if self.main and uids:
            register_prompts(t.store, uids, step, TRAIN)
            frac = t.cfg.debug.inject_rollout_failures
            for p in self.peers:
                items = []
                for i in range(p - 1, len(uids), len(self.peers)):
                    kw: dict[str, Any] = {}
                    if t.cfg.rollout.agent_loop == "tool":
                        kw["tools_kwargs"] = (rows[i].get("extra_info") or {}).get("tools_kwargs") or {}
                    if fails(uids[i], frac):
                        kw["inject_failure"] = True
                    items.append((uids[i], rows[i]["raw_prompt"], kw))
                if items:
                    self.mail.post(p, ("submit", step, seed_batch, items))
        return rows, uids

    def begin(self) -> None:
        self.sync_weights(self.t.engine.get_weights(), self.t.step)  # before any prompt: the rollout has no weights
        super().begin()

    # ---- the mailbox ----------------------------------------------------------------------------------------------
    def _receive(self) -> int:
        """Read the mailbox (training rank 0): write the groups that arrived into the store; returns how many."""
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
                    raise RuntimeError(f"rollout rank {self.split.train_ranks + p - 1} sent {message[0]!r} before "
                                       "the trainer stopped it")
            if self.payloads[p] != payloads:
                self.mail.post(p, ("ack", self.payloads[p]))
            if now - self.heard[p] > self.split.timeout_s:
                self.silent.add(p)
                raise TimeoutError(f"rollout rank {self.split.train_ranks + p - 1} sent nothing for "
                                   f"{now - self.heard[p]:.0f}s (trainer.dist_timeout_s={self.split.timeout_s:g})")
        return got

    def _accept(self, peer: int, header: dict, keep: bool = True) -> int:
        payload = torch.empty(header["nbytes"], dtype=torch.uint8)
        if header["nbytes"]:
            self.split.bridge.recv([payload], peer, 0).wait()
            self.payloads[peer] += 1
        if not keep:
            return 0
        store, uids = self.t.store, header["uids"]
        try:
            if header["keys"]:
                store.kv_batch_put(header["keys"], TRAIN, _unpack_fields(header, payload), header["tags"])
            store.kv_batch_put(uids, TRAIN, tags=header["prompt_tags"])
        except LateWriteError:  # cleared meanwhile (shutdown): nothing of it is trained
            logger.warning("groups %s arrived after they were cleared; dropped", uids[:3])
            return 0
        self.received_groups += len(uids)
        return len(uids)

    def _drive(self, seconds: float) -> None:
        """Nothing generates here: the rollout ranks do."""

    def _idle(self, _poll: float) -> None:
        got = self._receive() if self.main else 0
        self.t.store.sync()  # every training rank decides from the same listing
        if not got:
            time.sleep(_POLL_S)

    def sample(self, st: Any, batch_size: int) -> KVBatchMeta:
        if self.main:
            self._receive()
        return super().sample(st, batch_size)

    # ---- weights ----------------------------------------------------------------------------------------------
    def sync_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Broadcast ``weights`` (version ``version``) from training rank 0 to the rollout ranks."""
        if not self.main:
            return
        for _, work in self._weights:  # the previous sync reached every rollout rank
            work.wait()
        spec, flats = _flat_weights(weights, self.t.rollout.model.state_dict(), self.split.device)
        for p in self.peers:
            self.mail.post(p, ("weights", version, spec, [f.numel() for f in flats]))
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._weights = [(f, self.split.weights.broadcast([f], opts)) for f in flats]
        if self.t.cfg.debug.weight_checksums:
            local = {name: weights[name].detach().to(self.t.rollout.model.state_dict()[name].dtype)
                     for name in weights}
            _record_checksum(self.t.cfg.trainer.run_dir, "trainer", self.split.rank, version,
                             weights_checksum(local))

    # ---- metrics ----------------------------------------------------------------------------------------------
    def step_metrics(self, st: Any, seconds: float) -> dict[str, float]:
        out = super().step_metrics(st, seconds)
        out.pop("async/tasks_in_flight", None)
        if self.main:
            self._receive()
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
    def end(self) -> int:
        """Stop the rollout ranks (they cancel what is in flight and clear their keys), receive and drop what they
        sent meanwhile, then clear the training store as colocate_async does; no rank waits past
        ``trainer.dist_timeout_s`` for another."""
        failures = []
        if self.main:
            for p in self.peers:
                self.mail.post(p, ("stop",))
            for p in self.peers:
                if p in self.silent:
                    failures.append(f"rollout rank {self.split.train_ranks + p - 1} stopped answering")
                    continue
                deadline = time.monotonic() + self.split.timeout_s
                stopped = None
                while stopped is None:
                    for message in self.mail.poll(p):
                        if message[0] == "groups":
                            self._accept(p, message[1], keep=False)
                        elif message[0] == "stopped":
                            stopped = message[1]
                    if stopped is None:
                        if time.monotonic() > deadline:
                            failures.append(f"rollout rank {self.split.train_ranks + p - 1} did not stop within "
                                            f"{self.split.timeout_s:g}s (trainer.dist_timeout_s)")
                            break
                        time.sleep(_POLL_S)
                if stopped is None:
                    self.silent.add(p)
                    continue
                logger.info("rollout rank %d stopped: %d key(s) of groups in flight cleared, %d left",
                            self.split.train_ranks + p - 1, stopped["cleared"], stopped["left"])
                if stopped["left"]:
                    failures.append(f"rollout rank {self.split.train_ranks + p - 1} left {stopped['left']} key(s)")
            if not self.silent:  # the last broadcast reached every rollout rank (a silent one never receives it)
                for _, work in self._weights:
                    work.wait()
            self._weights = []
        super().end()
        if failures:
            raise RuntimeError("separate_async shutdown: " + "; ".join(failures))
        return 0
