"""The folder a checkpoint is written to: empty before every save, so one folder never mixes two saves.

A save into a folder that already holds an older (or a half-written) checkpoint of the same step would leave the old
shard files, RNG files and metadata next to the new ones; megatron-core then warns "Overwriting old incomplete /
corrupted checkpoint". Both engines call :func:`prepare_checkpoint_dir` first: rank 0 removes what an earlier save
left there, and refuses to touch a folder that holds anything a checkpoint does not (the path may be a mistake).
"""
from __future__ import annotations

import fnmatch
import os
import shutil

import torch.distributed as dist

__all__ = ["CHECKPOINT_ENTRIES", "NotACheckpointDir", "foreign_entries", "prepare_checkpoint_dir"]

# every name written directly under a checkpoint folder (torch DCP, megatron-core dist-checkpointing, the engines'
# side files, and the trainer's run record run.json)
CHECKPOINT_ENTRIES = ("*.distcp", ".metadata", "metadata.json", "common.pt", "engine_state.pt", "rng",
                      "rng_rank*.pt", "*.tmp", "run.json")


class NotACheckpointDir(ValueError):
    """The save path exists and holds files no checkpoint writes; nothing is deleted."""


def foreign_entries(path: str) -> list[str]:
    """Names under ``path`` that no checkpoint save writes (empty when absent or a checkpoint's own files only)."""
    if not os.path.isdir(path):
        return []
    return sorted(n for n in os.listdir(path) if not any(fnmatch.fnmatch(n, p) for p in CHECKPOINT_ENTRIES))


def prepare_checkpoint_dir(path: str) -> None:
    """Make ``path`` an empty folder on rank 0 (removing an earlier checkpoint there), then barrier all ranks.

    Raises :class:`NotACheckpointDir` on every rank when the folder holds foreign files, before anything is removed.
    """
    rank = dist.get_rank()
    problem = ""
    if rank == 0:
        if os.path.exists(path) and not os.path.isdir(path):
            problem = f"checkpoint path {path!r} exists and is a file, expected a folder"
        else:
            foreign = foreign_entries(path)
            if foreign:
                problem = (f"checkpoint path {path!r} already holds {foreign[:6]}, which no checkpoint writes; "
                           "refusing to overwrite it: choose another trainer.run_dir or move those files")
            elif os.path.isdir(path):
                shutil.rmtree(path)
            if not problem:
                os.makedirs(path)
    verdict = [problem]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise NotACheckpointDir(verdict[0])
