"""trainer.mode=separate_async's transport: the torchrun world split into training ranks and rollout ranks, and
what travels between them.

The last ``trainer.separate_async.rollout_ranks`` ranks only generate; the others only train. Each side gets a
default process group of its own (the training ranks' is what the engines, the topology, the logical DP and every
step collective see, so FSDP and Megatron run on the training ranks as on a world of that size), built from the
launch's rendezvous store under its own prefix. Between the sides:

* a **mailbox** on the rendezvous store carries small pickled messages between any two ranks (prompts to generate,
  the announcement of a transfer, acknowledgements, heartbeats with the rollout's busy time, stop), read by
  polling, so neither side blocks on the other;
* the **bridge** (a gloo group of every rank of the launch) carries each finished group's trajectories from the
  rollout rank that generated it straight to the training rank that owns it (the reporting rank of its DP replica,
  as in the other modes), which holds them in its shard of the training store: no rank funnels them;
* the **weights group** (NCCL on GPU, gloo on CPU; training rank 0 and the rollout ranks) broadcasts the weights
  from training rank 0 after every global step.

The training side's schedule is :class:`rldispatch.schedules.separate_async.SeparateAsyncSchedule`; the rollout side
runs :meth:`rldispatch.separate.rollout_rank.RolloutRank.serve`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from tensordict import TensorDict

from protocol.batch.nested import nested_from_values
from protocol.fields import PROMPT_IMAGE_FIELDS
from protocol.store import LocalStore
from protocol.store.keys import TERMINAL_STATUSES, is_prompt_key
from rldispatch.config import ConfigError, RunConfig
from rldispatch.rollout import TRAIN

__all__ = ["Split", "split_world", "Mailbox", "pack_groups", "unpack_fields", "flat_weights", "unflat_weights",
           "broadcast_weights", "receive_weights", "weights_checksum", "record_checksum", "HEARTBEAT_S", "POLL_S",
           "TERMINAL"]

logger = logging.getLogger(__name__)
#: a rollout rank reports its busy time (and that it is alive) at least this often
HEARTBEAT_S = 0.5
TERMINAL = {s.value for s in TERMINAL_STATUSES}
POLL_S = 0.002  # sleep between two looks at an empty mailbox


@dataclass
class Split:
    """This process's place in the split world (``role`` ``train`` or ``rollout``) and the links between sides."""

    role: str
    rank: int  # global rank
    world: int  # global world size
    train_ranks: int
    store: Any  # the launch's rendezvous store
    bridge: Any = None  # gloo group of every rank (bridge rank = global rank)
    weights: Any = None  # the weights group: training rank 0 and the rollout ranks (None on other training ranks)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout_s: float = 300.0

    @property
    def weights_rank(self) -> int:
        """This rank's place in the weights group: 0 for training rank 0, 1 + i for rollout rank i."""
        return 0 if self.role == "train" else 1 + self.rank - self.train_ranks

    @property
    def rollout_globals(self) -> list[int]:
        """The rollout ranks' global ranks (their bridge and mailbox addresses)."""
        return list(range(self.train_ranks, self.world))


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
    split.bridge = dist.ProcessGroupGloo(dist.PrefixStore("rldispatch/bridge", store), rank, world, timeout)
    if role == "rollout" or rank == 0:
        members, me = rollout + 1, split.weights_rank
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
def pack_groups(store: LocalStore, uids: list[str], image_uids: Sequence[str] = ()) -> tuple[dict, torch.Tensor]:
    """The finished groups ``uids`` of ``store`` as (header, payload): the prompt tags, every trajectory key with its
    tag, and each field's values and offsets in one uint8 buffer (the header says where); the images that those of
    ``image_uids`` hold on their prompt keys (stored once per group) follow, as ``prompt_fields``."""
    listing = store.kv_list(TRAIN)[TRAIN]
    wanted = set(uids)
    keys = [k for k in listing if not is_prompt_key(k) and k.split("_", 1)[0] in wanted]
    with_images = [u for u in uids if u in set(image_uids)]
    header: dict[str, Any] = {"uids": uids, "prompt_tags": [listing[u] for u in uids], "keys": keys,
                              "tags": [listing[k] for k in keys], "image_uids": with_images}
    chunks: list[torch.Tensor] = []
    header["fields"] = _pack(store, keys, None, chunks)
    header["prompt_fields"] = _pack(store, with_images, list(PROMPT_IMAGE_FIELDS), chunks)
    payload = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
    header["nbytes"] = payload.numel()
    return header, payload


def _pack(store: LocalStore, keys: list[str], fields: list[str] | None, chunks: list[torch.Tensor]) -> list:
    """Append ``fields`` (None: all) of ``keys`` to ``chunks``; the header entries that say where they are."""
    entries: list = []
    if not keys:
        return entries
    for name, (values, offsets) in store.kv_batch_get_packed(keys, TRAIN, fields).items():
        entry = [name, str(values.dtype).removeprefix("torch."), list(values.shape), None]
        chunks.append(values.contiguous().reshape(-1).view(torch.uint8))
        if offsets is not None:
            entry[3] = offsets.numel()
            chunks.append(offsets.to(torch.int64).contiguous().view(torch.uint8))
        entries.append(entry)
    return entries


def unpack_fields(header: dict, payload: torch.Tensor) -> tuple[TensorDict | None, TensorDict | None]:
    """The fields of :func:`pack_groups`'s trajectory keys and of its ``image_uids`` prompt keys, as the store's
    batches (jagged where they were; None for no keys)."""
    at, out = 0, []
    for keys, entries in ((header["keys"], header["fields"]), (header["image_uids"], header["prompt_fields"])):
        fields = {}
        for name, dtype, shape, n_offsets in entries:
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
        out.append(TensorDict(fields, batch_size=[len(keys)]) if keys else None)
    return out[0], out[1]


def flat_weights(weights: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype], device: torch.device
                  ) -> tuple[list[tuple[str, list[int], str]], list[torch.Tensor]]:
    """The weights cast to the rollout engine's ``dtypes``, one flat buffer per dtype, in name order."""
    spec, by_dtype = [], {}
    for name in sorted(weights):
        t = weights[name].detach().to(dtypes[name])
        spec.append((name, list(t.shape), str(t.dtype).removeprefix("torch.")))
        by_dtype.setdefault(t.dtype, []).append(t.reshape(-1))
    flats = [torch.cat(parts).to(device) for _, parts in sorted(by_dtype.items(), key=lambda kv: str(kv[0]))]
    return spec, flats


def dtypes_of(spec: list[tuple[str, list[int], str]]) -> list[str]:
    return sorted({dtype for _, _, dtype in spec})


def unflat_weights(spec: list[tuple[str, list[int], str]], flats: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The named weights of :func:`flat_weights`' buffers (views into them)."""
    by_dtype = dict(zip(dtypes_of(spec), flats))
    at = {dtype: 0 for dtype in by_dtype}
    weights = {}
    for name, shape, dtype in spec:
        n = int(torch.Size(shape).numel())
        weights[name] = by_dtype[dtype][at[dtype]:at[dtype] + n].view(shape)
        at[dtype] += n
    return weights


def broadcast_weights(group: Any, flats: list[torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
    """Start broadcasting ``flats`` from the group's rank 0; the (buffer, work) pairs to wait on later."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return [(f, group.broadcast([f], opts)) for f in flats]


def receive_weights(group: Any, spec: list[tuple[str, list[int], str]], sizes: list[int], device: torch.device
                    ) -> dict[str, torch.Tensor]:
    """Receive the broadcast of :func:`broadcast_weights` (the sender's ``spec`` and buffer sizes) as named weights."""
    flats = []
    for dtype, size in zip(dtypes_of(spec), sizes):
        buf = torch.empty(size, dtype=getattr(torch, dtype), device=device)
        for _, work in broadcast_weights(group, [buf]):
            work.wait()
        flats.append(buf)
    return unflat_weights(spec, flats)


def weights_checksum(weights: dict[str, torch.Tensor]) -> str:
    """sha256 over the weights' raw bytes in name order (equal on two sides only if every value is)."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def record_checksum(run_dir: str, side: str, rank: int, version: int, checksum: str) -> None:
    path = Path(run_dir) / "weight_sync.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps({"side": side, "rank": rank, "version": version, "checksum": checksum}) + "\n")
