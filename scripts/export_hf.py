"""Thin wrapper: ``python scripts/export_hf.py ...`` is ``rldispatch export ...`` (see rldispatch/commands/export.py)."""
import sys

from rldispatch.commands.export import main

if __name__ == "__main__":
    sys.exit(main())
