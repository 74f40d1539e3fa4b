"""Thin wrapper: ``python scripts/make_task_data.py ...`` is ``rldispatch data ...`` (see rldispatch/commands/data.py)."""
import sys

from rldispatch.commands.data import main

if __name__ == "__main__":
    sys.exit(main())
