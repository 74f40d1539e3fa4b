"""The exit path every torchrun worker in tests/dist/ shares: free what holds a process group, then destroy it.

A DDP Reducer keeps a reference to its process group and is freed with the GIL held. When it is the last holder
(the default group already destroyed, or never destroyed before interpreter exit) ``~ProcessGroupGloo`` joins its
worker threads under that GIL while one of them needs the GIL to release a finished work's tensors: a deadlock.
Dropping every such object first (the worker's frames and any exception's traceback, then a garbage collection)
leaves the default group as the last holder, and ``destroy_process_group`` releases it without the GIL.
"""
from __future__ import annotations

import gc
import sys
import traceback
from typing import Callable, NoReturn

import torch.distributed as dist

__all__ = ["run_worker"]


def run_worker(main: Callable[[], None]) -> NoReturn:
    """Run ``main``; on return or failure free its objects, destroy the process groups, exit with its status."""
    code: int | str | None = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # printed here so that the traceback (and the frames it holds) can be freed before exit
        traceback.print_exc()
        sys.stderr.flush()
        code = 1
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.exit(code)
