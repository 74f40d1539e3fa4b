"""Thin wrapper: ``python scripts/plot_metrics.py ...`` is ``rldispatch plot ...`` (see rldispatch/commands/plot.py)."""
import sys

from rldispatch.commands.plot import *  # noqa: F401,F403  (plot, render, series, ... for callers of the script)
from rldispatch.commands.plot import main

if __name__ == "__main__":
    sys.exit(main())
