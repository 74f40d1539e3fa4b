"""The installable entry point: ``rldispatch COMMAND``, ``python -m rldispatch``, shipped configs found by name."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rldispatch.cli import COMMANDS, main
from rldispatch.config import ConfigError, resolve_config_path

REPO = Path(__file__).resolve().parents[2]


def _module(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rldispatch", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_usage_and_unknown_command(capsys):
    assert main([]) == 2 and "commands:" in capsys.readouterr().out
    assert main(["--help"]) == 0
    assert main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'nope'" in err and all(name in err for name in COMMANDS)


def test_every_command_has_a_module_with_main():
    import importlib

    for name, (module, _) in COMMANDS.items():
        assert callable(importlib.import_module(f"rldispatch.commands.{module}").main), name


def test_shipped_config_by_name_from_any_folder(tmp_path):
    assert resolve_config_path("grpo_tiny").name == "grpo_tiny.yaml"
    with pytest.raises(ConfigError, match=r"no shipped config of that name \(shipped: \[.*'grpo_tiny'"):
        resolve_config_path("grpo_nonexistent")
    proc = _module("plan", "--config", "grpo_tiny", "--world", "8", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "logical DP" in proc.stdout or "dp" in proc.stdout.lower()


def test_wheel_ships_the_configs_and_the_console_script(tmp_path):
    # built from a copy: a build in the checkout would leave build/ and *.egg-info/ there
    src = tmp_path / "src"
    # (not the environments: .venv-vllm alone is 3.5 GB)
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", ".venv-*", "runs", "data", "build",
                                                             "models", "__pycache__", "*.egg-info", ".pytest_cache",
                                                             ".hypothesis"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("rldispatch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "rldispatch/configs/grpo_tiny.yaml" in names
    assert {"protocol/__init__.py", "dispatch/__init__.py", "backends/__init__.py", "rldispatch/cli.py"} <= set(names)
    assert not any(n.startswith("trainer/") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "rldispatch = rldispatch.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
