"""Shared fixtures. Distributed tests run worker scripts from tests/dist/ under torchrun (gloo, CPU)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DIST_DIR = Path(__file__).resolve().parent / "dist"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 300, env: dict | None = None) -> str:
    """Run ``script`` (a path, or a file name under tests/dist/) on ``nproc`` local ranks; return its stdout.

    Fails the calling test with the workers' output when the launch exits non-zero or times out.
    """
    path = Path(script)
    if not path.is_absolute():
        path = DIST_DIR / path
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
        str(path), *map(str, args),
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun {path.name} x{nproc} timed out after {timeout}s\n{exc.stdout}\n{exc.stderr}")
    if proc.returncode != 0:
        pytest.fail(f"torchrun {path.name} x{nproc} exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-6000:]}\n"
                    f"STDERR:\n{proc.stderr[-6000:]}")
    return proc.stdout


@pytest.fixture
def torchrun():
    """The :func:`run_torchrun` launcher as a fixture."""
    return run_torchrun
