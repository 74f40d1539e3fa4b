"""A vLLM OpenAI-compatible server as a child process of the trainer: started in the engine's own Python
environment, watched until healthy, spoken to over loopback HTTP, stopped with its process group."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from backends.rollout.engine import RolloutError

__all__ = ["VllmServer", "EXTENSION_DIR", "free_port"]

#: the folder put on the server's PYTHONPATH: the worker extension, importable without this project's dependencies
EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"
#: environment variables of a torchrun worker that must not reach the engine (it would join the trainer's world)
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG: the trainer's death stops the server


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` with ``args``, run by ``python`` (the engine environment's
    interpreter) in its own process group, on a loopback port of its choosing; its output goes to ``log_path``.
    :meth:`wait_ready` blocks until it answers; :meth:`post` / :meth:`get` are JSON calls; :meth:`close` ends the
    process group."""

    #: starts on a fresh port after the port it was given was taken before it could bind it
    PORT_RETRIES = 3

    def __init__(self, python: str, args: list[str], env: dict[str, str], log_path: Path):
        self.python, self.args, self.log_path = python, args, log_path
        self.env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
        self.env.update(env)
        self.env["PYTHONPATH"] = os.pathsep.join([str(EXTENSION_DIR), *filter(None, [self.env.get("PYTHONPATH")])])
        self._log = open(log_path, "ab")
        self._retries = self.PORT_RETRIES
        #: the served model name, unique to this server: requests name it, and readiness checks it (a server of
        #: another rank that took this port meanwhile answers /health too)
        self.name = f"policy-{uuid.uuid4().hex[:12]}"
        self._spawn()

    def _spawn(self) -> None:
        self.started_at = time.monotonic()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_start = self._log.tell()
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port",
               str(self.port), "--served-model-name", self.name, *self.args]
        try:
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        except OSError as exc:
            self._log.close()
            raise RolloutError(f"cannot start the vLLM server with {self.python!r}: {exc}") from exc

    def _lost_its_port(self) -> bool:
        """Whether the server that just exited failed to bind its port (another process took it meanwhile)."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(self._log_start)
                return b"Address already in use" in fh.read()
        except OSError:
            return False

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def wait_ready(self, timeout_s: float) -> float:
        """Block until the server answers, naming its own model; the seconds since it was started. Its exit or
        ``timeout_s`` is an error
        that quotes the end of its log."""
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                if self._retries > 0 and self._lost_its_port():
                    self._retries -= 1
                    self._spawn()
                    continue
                raise RolloutError(f"the vLLM server exited with code {self.proc.returncode} while starting; the end "
                                   f"of {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    served = [m.get("id") for m in json.loads(r.read()).get("data", [])]
                if self.name in served:
                    return time.monotonic() - self.started_at
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() - t0 > timeout_s:
                self.close()
                raise RolloutError(f"the vLLM server did not answer within rollout.vllm.startup_timeout_s="
                                   f"{timeout_s:g} s; the end of {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.25)

    def _call(self, method: str, path: str, body: Any, timeout: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            raise RolloutError(f"vLLM server {method} {path} answered {exc.code}: "
                               f"{exc.read().decode(errors='replace')[:2000]}") from None
        except (urllib.error.URLError, OSError) as exc:
            alive = "running" if self.proc.poll() is None else f"exited with code {self.proc.returncode}"
            raise RolloutError(f"vLLM server {method} {path} failed ({exc}); the server is {alive}; the end of "
                               f"{self.log_path}:\n{self.log_tail()}") from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:  # some endpoints (the LoRA adapters') answer plain text
            return raw.decode(errors="replace")

    def post(self, path: str, body: Any = None, timeout: float = 600.0) -> Any:
        return self._call("POST", path, {} if body is None else body, timeout)

    def get(self, path: str, timeout: float = 60.0) -> Any:
        return self._call("GET", path, None, timeout)

    def close(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace_s``."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        try:  # the engine core and workers may linger in the group a moment longer
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()
