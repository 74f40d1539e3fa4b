"""Thin wrapper: ``python scripts/train.py ...`` is ``rldispatch train ...`` (see rldispatch/commands/train.py)."""
import sys

from rldispatch.commands.train import main

if __name__ == "__main__":
    sys.exit(main())
