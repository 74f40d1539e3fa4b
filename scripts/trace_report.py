"""Thin wrapper: ``python scripts/trace_report.py ...`` is ``rldispatch trace ...`` (see rldispatch/commands/trace.py)."""
import sys

from rldispatch.commands.trace import main

if __name__ == "__main__":
    sys.exit(main())
