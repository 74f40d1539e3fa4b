"""The main job: one GRPO run under torchrun, on either backend, from one YAML config.

    torchrun --nproc_per_node=2 -m rldispatch train --config grpo_tiny [key=value ...]
    torchrun --nproc_per_node=2 scripts/train.py --config configs/grpo_tiny.yaml [key=value ...]   (same)
"""
from __future__ import annotations

import argparse
import os
import sys

from rldispatch.known_warnings import install as install_known_warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML file (defaults are embedded; see rldispatch/config.py)")
    parser.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. actor.backend=megatron actor.megatron.tp=2")
    args = parser.parse_args(argv)
    install_known_warnings()  # before megatron-core is imported: some of its harmless warnings fire at import

    from rldispatch.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"config error: {exc}", file=sys.stderr)
        return 2

    from rldispatch.grpo import run

    try:
        run(cfg)
    except ConfigError as exc:  # settings that only fail against the world size (topology, batch settings)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"config error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
