"""Thin wrapper: ``python scripts/plan.py ...`` is ``rldispatch plan ...`` (see rldispatch/commands/plan.py)."""
import sys

from rldispatch.commands.plan import main

if __name__ == "__main__":
    sys.exit(main())
