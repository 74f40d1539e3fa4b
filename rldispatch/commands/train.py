"""The main job: one GRPO run under torchrun, on either backend, from one YAML config.

    torchrun --nproc_per_node=2 -m rldispatch train --config grpo_tiny [key=value ...]
    torchrun --nproc_per_node=2 scripts/train.py --config configs/grpo_tiny.yaml [key=value ...]   (same)
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from rldispatch.known_warnings import install as install_known_warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML file (defaults are embedded; see rldispatch/config.py)")
    parser.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. actor.backend=megatron actor.megatron.tp=2")
    args = parser.parse_args(argv)
    install_known_warnings()  # before megatron-core is imported: some of its harmless warnings fire at import
    # before the config is read: loading it may say what it settled (rank 0 at INFO, the others only warnings)
    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from rldispatch.config import ConfigError, check_environment, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        check_environment(cfg)  # every rank alike, before any of them joins the process group
    except ConfigError as exc:
        return config_error(exc)

    from rldispatch.lifecycle import run

    try:
        return run(cfg)
    except ConfigError as exc:  # settings checked against the world size, the run dir or a checkpoint's config
        return config_error(exc)


# how long ranks other than 0 wait before printing the error themselves: the launcher stops every worker once one
# exits, so rank 0 (which prints at once) must not be killed by an earlier exit of another rank
_OTHER_RANKS_WAIT_S = 3.0


def config_error(exc: Exception) -> int:
    """Print ``config error: ...`` as the last line of this worker's output and return exit code 2.

    Rank 0 prints at once; another rank waits a little first, so it prints only an error rank 0 did not have
    (torchrun stops it after rank 0 exits)."""
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        time.sleep(_OTHER_RANKS_WAIT_S)
    sys.stdout.flush()
    prefix = f"[rank {rank}] " if rank else ""
    print(f"{prefix}config error: {exc}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
    sys.exit(main())
