"""The task-data, plotting and trace-report scripts, run as a user runs them (subprocess) and in-process for errors."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import tempfile
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from tensordict import TensorDict

from protocol.rollout.tasks import make_rows
from rldispatch.metrics import MetricsLogger
from rldispatch.trace import TraceRecorder

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, str(SCRIPTS / name), *map(str, args)], capture_output=True, text=True,
                          cwd=tempfile.gettempdir(), env=env, timeout=120)


def load_script(name: str):
    """The script as a module (by file path: a foreign ``scripts`` package shadows ours in site-packages)."""
    spec = importlib.util.spec_from_file_location(f"_script_{name[:-3]}", SCRIPTS / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_make_task_data_writes_parquet(tmp_path):
    out = tmp_path / "data" / "reverse"
    proc = run_script("make_task_data.py", "--out-dir", out, "--task", "reverse", "--train", 20, "--val", 5,
                      "--seed", 7, "--max-len", 5)
    assert proc.returncode == 0, proc.stderr
    train = pq.read_table(out / "train.parquet").to_pylist()
    assert train == make_rows("reverse", 20, 7, "train", max_len=5)
    assert len(pq.read_table(out / "val.parquet")) == 5
    mod = load_script("make_task_data.py")
    assert mod.main(["--out-dir", str(tmp_path / "x"), "--min-len", "4", "--max-len", "2"]) == 2
    with pytest.raises(SystemExit):
        mod.main(["--out-dir", str(tmp_path / "x"), "--task", "nope"])


def _write_trace(path: Path) -> None:
    keys = ["aaaa_0_0", "aaaa_1_0", "bbbb_0_0"]
    tags = [{"prompt_len": 3, "response_len": n, "seq_len": 3 + n, "global_steps": 2, "min_global_steps": 2,
             "max_global_steps": 2, "is_padding": False} for n in (2, 4, 1)]
    td = TensorDict({"responses": torch.nested.nested_tensor([torch.ones(n, dtype=torch.int64) for n in (2, 4, 1)],
                                                             layout=torch.jagged)}, batch_size=[3])
    with TraceRecorder(path, sample_uid="aaaa") as tr:
        tr.record("dataset", None, ["aaaa"], [{"is_prompt": True, "global_steps": 2}], producer="dataloader")
        tr.record("rollout", td, keys, tags, producer="agent_loop", consumer="reward")


def test_trace_report_renders_an_aligned_table(tmp_path):
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace)
    proc = run_script("trace_report.py", trace)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:4] == ["step", "rank", "stage", "field"] and set(lines[1]) <= {"-", " "}
    assert len(lines) == 4
    body = {line.split()[2]: line for line in lines[2:]}
    assert "agent_loop" in body["rollout"] and "[2,4]" in body["rollout"] and "aaaa: 0_0,1_0" in body["rollout"]
    assert "bbbb" not in proc.stdout
    starts = [lines[0].index("field"), *(ln.index(ln.split()[3]) for ln in lines[2:])]
    assert len(set(starts)) == 1  # the field column is aligned
    mod = load_script("trace_report.py")
    out = tmp_path / "report.txt"
    assert mod.main([str(trace), "--stage", "rollout", "--out", str(out)]) == 0
    assert "rollout" in out.read_text() and "dataset" not in out.read_text()
    assert mod.main([str(trace), "--step", "99"]) == 1
    assert mod.main([str(tmp_path / "missing.jsonl")]) == 2


def test_plot_metrics_writes_png(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run) as log:
        for s in range(1, 6):
            log.log(s, {"reward/mean": s / 10, "reward/min": 0.0, "reward/max": s / 5, "actor/pg_loss": 1 / s,
                        "actor/entropy": 4.0 - s / 10, "actor/grad_norm": 0.5, "timing_s/gen": 0.1,
                        "weird_thing": 1.0})
        log.log(3, {"reward/mean": 0.9})  # a resumed run logs step 3 again; the last record wins
    proc = run_script("plot_metrics.py", run, "--out", tmp_path / "curves.png")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "reward: reward/max, reward/mean, reward/min" in proc.stdout
    assert "policy loss: actor/pg_loss" in proc.stdout and "weird_thing" not in proc.stdout
    mod = load_script("plot_metrics.py")
    steps, values = mod.series([{"step": 2, "a": 1.0}, {"step": 1, "a": None}, {"step": 2, "a": 3.0}])
    assert steps == [1, 2] and values["a"][1] == 3.0 and values["a"][0] != values["a"][0]
    assert mod.main([str(run), "--keys", "weird_thing"]) == 0 and (run / "metrics.png").exists()
    assert mod.main([str(run), "--keys", "nope"]) == 2
    assert mod.main([str(tmp_path / "empty")]) == 2


def test_plot_metrics_overlays_several_runs(tmp_path):
    for name, scale in (("a", 1.0), ("b", 0.5)):
        with MetricsLogger(tmp_path / name) as log:
            for s in range(1, 4):
                log.log(s, {"reward/mean": scale * s, "timing_s/reward": 0.1, **({"val/score": 0.3} if s == 1 else {})})
    mod = load_script("plot_metrics.py")
    path, panels = mod.plot([tmp_path / "a", tmp_path / "b"], tmp_path / "both.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert panels["reward"] == ["reward/mean", "val/score"]  # timing_s/reward is a stage time, not a reward
    assert panels["stage times (s)"] == ["timing_s/reward"]
    assert mod.main([str(tmp_path / "a"), str(tmp_path / "b"), "--keys", "reward/mean", "--out",
                     str(tmp_path / "k.png")]) == 0
