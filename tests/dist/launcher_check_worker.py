"""Worker for the launcher's own tests: leaves processes behind that only SIGKILL of the right targets ends.

``hang DIR``: every rank writes ``DIR/<rank>.pid``, rank 0 also starts a child in a session of its own
(``DIR/child.pid``); all of them ignore SIGTERM and sleep until killed. ``orphan DIR``: rank 0 starts such a
child and every rank exits 0 at once, as a worker that leaks a process would.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SLEEPER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank == 0:
        child = subprocess.Popen([sys.executable, "-c", SLEEPER, str(out)], start_new_session=True)
        (out / "child.pid").write_text(str(child.pid))
    if mode == "orphan":
        return
    (out / f"{rank}.pid").write_text(str(os.getpid()))
    print(f"rank {rank} sleeping", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
