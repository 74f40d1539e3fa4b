"""The runnable examples in the dispatch modules' docstrings stay true."""
from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["dispatch.topology", "dispatch.balance", "dispatch.workload", "dispatch.padding", "dispatch.microbatch",
           "dispatch.plan", "dispatch.synthetic"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0


def test_dispatch_imports_no_backend_trainer_or_parallel_state():
    import subprocess
    import sys

    code = ("import sys, dispatch; bad = [m for m in sys.modules if m.split('.')[0] in ('backends', 'trainer') "
            "or m.startswith('megatron')]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
