"""Third-party warnings known to be harmless in this project, filtered once at start-up, each with the reason.

Only messages listed here are hidden, each matched by category, text and the module that issues it, so a new
warning (ours or a library's) still reaches the console. Warnings that were ours to fix are fixed at the source
instead (megatron-core's ``cuda_graph_scope`` default is passed explicitly in ``backends/megatron/model.py``;
checkpoint folders are emptied before a save in ``backends/checkpoint_dir.py``).

    from rldispatch.known_warnings import install
    install()            # before megatron-core is imported: several of its warnings fire at import time
"""
from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass

__all__ = ["KnownWarning", "KNOWN_WARNINGS", "KNOWN_LOG_LINES", "QUIET_LOGGERS", "DEPRECATED_COLLECTIVES",
           "add_warning_filters", "install", "is_known"]


@dataclass(frozen=True)
class KnownWarning:
    """One harmless warning: ``warnings`` category, regex on the message start, regex on the issuing module."""

    category: type[Warning]
    message: str
    module: str
    why: str
    cpu_only: bool = False  # harmless only without a GPU: filtered only when CUDA is absent


# torch 2.13 renamed these collectives (`*_single`); see DEPRECATED_COLLECTIVES for the test that keeps our own
# code off the old names, so the filter below can only ever hide megatron-core's calls.
DEPRECATED_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "_all_gather_base",
                          "_reduce_scatter_base")

KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(
        UserWarning, r"(Transformer Engine and Apex are|Apex is) not installed", r"megatron\.core(\.|$)",
        why="megatron-core announces at import that it uses its plain-torch kernels (norm, multi-tensor apply, "
            "Adam); the engine picks the local layer spec whenever transformer-engine is absent "
            "(backends.megatron.model.te_available), so the fallback is the configuration we run and test."),
    KnownWarning(
        FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        r"torch\.distributed\.c10d_logger$",
        why="torch 2.13 renamed the collectives to all_gather_single / reduce_scatter_single and the old names call "
            "the new ones unchanged; megatron-core 0.16.1 (distributed optimizer, TP all-gathers) still uses the old "
            "names. Our code calls neither (tests/rldispatch/test_known_warnings.py checks the source)."),
    KnownWarning(
        UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        r"megatron\.core\.optimizer\.optimizer$",
        why="the distributed optimizer's zero_grad() sets .grad = None on its fp32 shards, which are views of the "
            "parameters; those gradients are assigned by hand from the grad buffer every step, never by autograd, "
            "so nothing is lost (multi-step parity of the distributed optimizer with a reference Adam is tested "
            "in tests/dist/megatron_parity_worker.py)."),
    KnownWarning(
        FutureWarning, r"`load_state_dict` is deprecated and will be removed",
        r"megatron\.core\.dist_checkpointing(\.|$)",
        why="megatron-core 0.16.1's torch_dist strategy loads through torch.distributed.checkpoint.load_state_dict, "
            "the old name of torch's load(); the files read are the same (resume == uninterrupted is tested)."),
    KnownWarning(
        FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor",
        r"torch\.distributed\.checkpoint(\.|$)",
        why="megatron-core's dist-checkpointing hands torch's planner ShardedTensor metadata on load; torch plans to "
            "replace that type with DTensor, nothing about the saved or loaded values changes."),
    KnownWarning(
        UserWarning, r"When using (async grad allreduce|sequence parallelism) it is recommended to set the "
                     r"environment variable CUDA_DEVICE_MAX_CONNECTIONS",
        r"megatron\.core\.tensor_parallel\.layers$", cpu_only=True,
        why="with TP > 1 megatron-core asks for one CUDA hardware queue so its gradient all-reduce overlaps the "
            "backward in order; on the CPU (gloo) there are no CUDA queues, so it does not apply. On a GPU the "
            "warning stays: export CUDA_DEVICE_MAX_CONNECTIONS=1 for megatron runs with TP > 1."),
)

# torch.logging lines (not `warnings`): (logger name, regex on the message, why)
KNOWN_LOG_LINES: tuple[tuple[str, str, str], ...] = (
    ("torch.fx._symbolic_trace", r"is_fx_tracing will return true",
     "torch.nested.nested_tensor_from_jagged calls torch's own is_fx_tracing(), which logs this once per process; "
     "nothing here is traced with torch.fx or torch.export."),
)

# loggers whose INFO lines repeat what the run's config already says (megatron-core prints its DDP and optimizer
# configs and the gradient-bucket layout on every rank-0 start); their warnings and errors still show
QUIET_LOGGERS: tuple[str, ...] = ("megatron.core",)


class _DropMessages(logging.Filter):
    """A logging filter that drops records whose message matches one of ``patterns``."""

    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(p.search(text) for p in self.patterns)


_INSTALLED: dict[str, bool] = {"done": False}


def add_warning_filters() -> None:
    """Put one ``ignore`` filter per :data:`KNOWN_WARNINGS` entry in front of the current ``warnings`` filters."""
    import torch

    on_gpu = torch.cuda.is_available()
    for known in KNOWN_WARNINGS:
        if known.cpu_only and on_gpu:
            continue
        warnings.filterwarnings("ignore", message=known.message, category=known.category, module=known.module)


def install() -> None:
    """Hide the known warnings and log lines in this process (idempotent); call before megatron-core's import."""
    if _INSTALLED["done"]:
        return
    add_warning_filters()
    by_logger: dict[str, list[str]] = {}
    for name, pattern, _ in KNOWN_LOG_LINES:
        by_logger.setdefault(name, []).append(pattern)
    for name, patterns in by_logger.items():
        logging.getLogger(name).addFilter(_DropMessages(patterns))
    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET or logger.level < logging.WARNING:
            logger.setLevel(logging.WARNING)
    _INSTALLED["done"] = True


def is_known(text: str) -> bool:
    """Whether a console line carries one of the known messages (for tests that scan a run's output)."""
    return any(re.search(k.message, text) for k in KNOWN_WARNINGS) or \
        any(re.search(p, text) for _, p, _ in KNOWN_LOG_LINES)
