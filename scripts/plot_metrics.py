"""Thin wrapper: ``python scripts/plot_metrics.py ...`` is ``rldispatch plot ...`` (see rldispatch/commands/plot.py)."""
import sys

from rldispatch.commands.plot import main

if __name__ == "__main__":
    sys.exit(main())
