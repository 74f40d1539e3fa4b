"""The torchrun launcher of tests/conftest.py: a timed-out or leaking launch leaves no process behind."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist]


def _alive(pid: int, tag: str) -> bool:
    """True while ``pid`` is a live (non-zombie) process whose command line mentions ``tag``."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and tag.encode() in cmdline


def _processes_mentioning(tag: str) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid() and _alive(int(p), tag)]


def test_timeout_kills_torchrun_its_workers_and_their_children(torchrun, tmp_path):
    # workers that ignore SIGTERM, one with a child in a session of its own; a loaded machine may need longer
    # than the first timeout just to start them, so the timeout grows until the workers were seen running
    for timeout in (8, 20, 60):
        with pytest.raises(pytest.fail.Exception, match=f"timed out after {timeout}s") as info:
            torchrun("launcher_check_worker.py", 2, "hang", str(tmp_path), timeout=timeout)
        pids = {f.stem: int(f.read_text()) for f in tmp_path.glob("*.pid")}
        assert _processes_mentioning(str(tmp_path)) == [], info.value
        if {"0", "1", "child"} <= set(pids):
            break
    else:
        pytest.fail(f"the workers never started within 60 s (pid files {sorted(pids)})")
    assert not any(_alive(pid, str(tmp_path)) for pid in pids.values())
    assert "killed it and the processes" in str(info.value)


def test_a_clean_exit_that_leaves_a_process_fails_and_kills_it(torchrun, tmp_path):
    with pytest.raises(pytest.fail.Exception, match="exited 0 but left processes"):
        torchrun("launcher_check_worker.py", 2, "orphan", str(tmp_path), timeout=120)
    child = int((tmp_path / "child.pid").read_text())
    assert not _alive(child, str(tmp_path))
    assert _processes_mentioning(str(tmp_path)) == []
