"""The ``rldispatch`` console entry point: ``rldispatch train|plan|export|plot|trace|data|config|models [args]``.

    rldispatch train --config grpo_tiny actor.backend=megatron     # under torchrun: python -m rldispatch train ...
    rldispatch plan --config grpo_tiny --world 64
"""
from __future__ import annotations

import importlib
import sys

__all__ = ["COMMANDS", "main"]

# subcommand -> (module under rldispatch.commands, one-line help)
COMMANDS = {
    "train": ("train", "run GRPO from a YAML config (use torchrun for several ranks)"),
    "plan": ("plan", "print one step's dispatch plan for a config and a world size"),
    "export": ("export", "write a Hugging Face folder from a checkpoint of either backend"),
    "plot": ("plot", "draw a run's metrics to a PNG"),
    "trace": ("trace", "print the field-lineage table of a traced run"),
    "data": ("data", "write a built-in task's train/val parquet files"),
    "config": ("config", "print the resolved config, or every key's type, default and meaning (--table)"),
    "models": ("models", "prepare a known pretrained model as a local Hugging Face folder"),
}


def _usage() -> str:
    rows = "\n".join(f"  {name:<8} {text}" for name, (_, text) in COMMANDS.items())
    return f"usage: rldispatch COMMAND [args]\n\ncommands:\n{rows}\n\n'rldispatch COMMAND --help' for its options."


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"rldispatch: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"rldispatch.commands.{COMMANDS[name][0]}")
    return int(module.main(rest) or 0)
