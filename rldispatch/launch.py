"""Launching a rank: the process group (gloo on CPU, NCCL on GPUs) and the watch on the launcher. (separate_async
splits the world instead: :func:`rldispatch.separate.transport.split_world`.)"""
from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistContext", "init_distributed", "die_with_parent"]

logger = logging.getLogger(__name__)


def die_with_parent() -> None:
    """Under a launcher (torchrun), end this worker when the launcher dies, so no orphan keeps training.

    Linux delivers SIGKILL on the parent's death (``PR_SET_PDEATHSIG``); elsewhere nothing is set up.
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        logger.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this worker outlives a killed launcher",
                       ctypes.get_errno())
    if parent == 1 or os.getppid() != parent:  # the launcher died before the call
        os._exit(1)


@dataclass
class DistContext:
    rank: int
    world: int
    device: torch.device
    link: Any = None  # trainer.mode=separate_async: the split world's links to the rollout ranks

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_pref: str, timeout_s: float | None = None) -> DistContext:
    """gloo on CPU, NCCL on GPUs; a plain ``python scripts/train.py`` runs as a world of one.

    ``timeout_s`` (``trainer.dist_timeout_s``) bounds every collective: a stuck or dead peer ends the job.
    """
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=float(timeout_s))}
        dist.init_process_group("nccl" if use_cuda else "gloo", **kwargs)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), device)
