"""Shared fixtures and the hypothesis profiles. Distributed tests run worker scripts from tests/dist/ under torchrun.

Hypothesis profiles (``HYPOTHESIS_PROFILE``, default ``ci``):

* ``ci``: derandomized (the same examples on every run and every machine), no example database, each test's own
  ``max_examples`` budget, no deadline (shared CPUs make timings meaningless), failing examples printed as blobs.
* ``explore``: fresh random seeds, every test's budget multiplied by ``HYPOTHESIS_EXPLORE_FACTOR`` (default 10);
  ``make test-explore`` runs the property tests (marker ``property``) this way to hunt for new counterexamples.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from hypothesis import settings

__all__ = ["run_torchrun", "run_process_tree", "launched_pids", "HYPOTHESIS_PROFILES", "LAUNCH_MARKER_ENV"]

REPO = Path(__file__).resolve().parent.parent
DIST_DIR = Path(__file__).resolve().parent / "dist"

HYPOTHESIS_PROFILES = ("ci", "explore")
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True, max_examples=50)
settings.register_profile("explore", derandomize=False, database=None, deadline=None, print_blob=True,
                          max_examples=500)
_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if _PROFILE not in HYPOTHESIS_PROFILES:
    raise ValueError(f"HYPOTHESIS_PROFILE={_PROFILE!r} is not a known profile; expected one of {HYPOTHESIS_PROFILES}")
# loaded before any test module is imported, so every @settings(...) in the tests inherits from this profile
settings.load_profile(_PROFILE)


def _explore_factor() -> int:
    raw = os.environ.get("HYPOTHESIS_EXPLORE_FACTOR", "10")
    try:
        factor = int(raw)
    except ValueError:
        factor = 0
    if factor < 1:
        raise ValueError(f"HYPOTHESIS_EXPLORE_FACTOR={raw!r}: expected an integer >= 1 (the multiplier of each "
                         "property test's max_examples under the explore profile)")
    return factor


#: what the checkout may gain while the suite runs (caches and the environment, never a run's outputs)
_SCRATCH_PARTS = {".git", ".venv", ".venv-vllm", "__pycache__", ".pytest_cache", ".hypothesis"}


def checkout_files(root: Path = REPO) -> dict[str, tuple[int, int]]:
    """Every file of the checkout that git does not track, outside caches and the venv, with (size, mtime in ns).

    Tracked files are left out: a developer may edit sources while the suite runs; what a test could leave behind
    is new files (run folders, generated data)."""
    try:
        tracked = set(subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True,
                                     timeout=60).stdout.decode().split("\0"))
    except (OSError, subprocess.SubprocessError):  # not a git checkout: every file counts
        tracked = set()
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SCRATCH_PARTS and not d.endswith(".egg-info")]
        for name in filenames:
            path = Path(dirpath, name)
            rel = str(path.relative_to(root))
            if rel not in tracked:
                st = path.stat()
                found[rel] = (st.st_size, st.st_mtime_ns)
    return found


@pytest.fixture(scope="session", autouse=True)
def checkout_untouched():
    """The suite writes only under temporary folders: a file it adds, changes or removes in the checkout (a run
    folder, generated data) fails the session, so ``make test`` before or after ``make run`` behaves the same."""
    before = checkout_files()
    yield
    after = checkout_files()
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    if changed:
        pytest.fail(f"the test suite wrote into the checkout ({len(changed)} file(s)): {changed[:10]}; tests must "
                    "write under a temporary folder (tmp_path)", pytrace=False)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "property: a hypothesis property test (selected by make test-explore)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark hypothesis tests ``property``; under the explore profile, scale each one's example budget."""
    factor = _explore_factor() if _PROFILE == "explore" else 1
    scaled: set[int] = set()
    for item in items:
        fn = getattr(item, "obj", None)
        if not getattr(fn, "is_hypothesis_test", False):
            continue
        item.add_marker(pytest.mark.property)
        if factor == 1 or id(fn) in scaled:
            continue
        # a test's own @settings(max_examples=...) wins over the profile, so the budget is scaled on the test itself
        own = getattr(fn, "_hypothesis_internal_use_settings", None)
        if own is None:
            raise RuntimeError(f"{item.nodeid}: hypothesis no longer exposes the test's settings; "
                               "update tests/conftest.py for this hypothesis version")
        fn._hypothesis_internal_use_settings = settings(own, max_examples=own.max_examples * factor)
        scaled.add(id(fn))


# ------------------------------------------------------------------------------------------------ torchrun launcher
LAUNCH_MARKER_ENV = "RLDISPATCH_TEST_LAUNCH"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_pids(marker: str) -> list[int]:
    """Live processes whose environment carries ``LAUNCH_MARKER_ENV=marker``: torchrun and every worker it started.

    torchrun puts each worker in a session of its own, so neither the launcher's process group nor its parent
    links (lost once torchrun dies) reach all of them; the environment marker is inherited by every descendant.
    """
    needle = f"{LAUNCH_MARKER_ENV}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # exited meanwhile, or not ours
            continue
        if needle in env:
            found.append(int(entry))
    return found


def _kill_launch(proc: subprocess.Popen, marker: str) -> list[int]:
    """SIGKILL torchrun's process group and every process carrying the launch marker; reap torchrun.

    Returns the pids that were still alive besides torchrun (the workers).
    """
    stragglers: set[int] = set()
    for _ in range(100):
        if proc.poll() is None:  # not reaped yet, so its pid (and process group id) cannot have been reused
            for kill in (os.killpg, os.kill):
                try:
                    kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        pids = [p for p in launched_pids(marker) if p != proc.pid]
        stragglers.update(pids)
        for pid in pids:  # each worker leads a session and a process group of its own: kill the group, then it
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            continue
        if not pids:
            break
    return sorted(stragglers)


def _read(f) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")


def run_process_tree(cmd: list[str], *, timeout: float, env: dict | None = None, cwd: str | Path | None = None,
                     what: str | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` and every process it starts as one unit; return its exit status and output (text).

    ``cwd`` defaults to a fresh temporary folder, so a config's relative paths (``runs/``, ``data/``) land there and
    never in the checkout.

    The command starts in a session of its own with a marker in its environment. On timeout, on any exception
    (pytest-timeout, Ctrl-C) and after every exit, the command and all of its descendants are SIGKILLed, whatever
    session they moved to. Fails the calling test on timeout, or when a process outlived the command. ``env`` is
    added to the current environment.
    """
    what = what or Path(cmd[0]).name
    marker = uuid.uuid4().hex
    full_env = {**os.environ, **(env or {}), LAUNCH_MARKER_ENV: marker}
    # output goes to files, not pipes: a leaked process holding a pipe open would keep the read from ending
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.TemporaryDirectory(prefix="launch-") as scratch:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=full_env, cwd=cwd or scratch,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:  # pytest-timeout, Ctrl-C: take the launch down before unwinding
            _kill_launch(proc, marker)
            raise
        leftover = _kill_launch(proc, marker)
        stdout, stderr = (_read(f) for f in (out, err))
    if timed_out:
        pytest.fail(f"{what} timed out after {timeout}s (killed it and the processes {leftover})\n"
                    f"STDOUT:\n{stdout[-6000:]}\nSTDERR:\n{stderr[-6000:]}")
    if leftover:
        pytest.fail(f"{what} exited {proc.returncode} but left processes {leftover} running (killed)\n"
                    f"STDOUT:\n{stdout[-6000:]}\nSTDERR:\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 300, env: dict | None = None) -> str:
    """Run ``script`` (a path, or a file name under tests/dist/) on ``nproc`` local ranks; return its stdout.

    Fails the calling test with the workers' output when the launch exits non-zero, times out or leaves a process
    behind; torchrun and all of its workers go down together (see :func:`run_process_tree`).
    """
    path = Path(script)
    if not path.is_absolute():
        path = DIST_DIR / path
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
        str(path), *map(str, args),
    ]
    what = f"torchrun {path.name} x{nproc}"
    proc = run_process_tree(cmd, timeout=timeout, what=what,
                            env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})})
    if proc.returncode != 0:
        pytest.fail(f"{what} exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-6000:]}\n"
                    f"STDERR:\n{proc.stderr[-6000:]}")
    return proc.stdout


@pytest.fixture
def torchrun():
    """The :func:`run_torchrun` launcher as a fixture."""
    return run_torchrun


@pytest.fixture
def process_tree():
    """:func:`run_process_tree` as a fixture: for tests that start a script which itself launches processes."""
    return run_process_tree


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo process group in this process for the test's duration (an engine built in the test itself)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
