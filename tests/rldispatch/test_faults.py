"""Fault injection on the main job (scripts/train.py, 2 gloo ranks under torchrun): a stuck peer, a killed launcher,
SIGTERM, killed and damaged checkpoint saves, a reused run dir, and non-finite updates.

Each launch is a real run of the shipped tiny config; processes are found by the launch marker in their environment
(tests/conftest.py), and every launch is taken down with all its processes whatever happens.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import LAUNCH_MARKER_ENV, REPO, _free_port, _kill_launch, launched_pids

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TRAIN = str(REPO / "scripts" / "train.py")
CONFIG = str(REPO / "configs" / "grpo_tiny.yaml")
TIMEOUT_S = 10  # trainer.dist_timeout_s of these runs: far above any wait of a healthy tiny step (< 1 s)


@pytest.fixture(scope="module")
def data_args(tmp_path_factory) -> list[str]:
    """One generated data set for every launch of the module (the first launch writes it)."""
    d = tmp_path_factory.mktemp("data")
    return [f"data.train_files=[{d}/train.parquet]", f"data.val_files=[{d}/val.parquet]"]


def _args(data_args: list[str], run_dir: Path, *extra: str) -> list[str]:
    return ["--config", CONFIG, "trainer.progress_bar=false", "trainer.tensorboard=false", "data.val_batch_size=4",
            "data.train_size=64", "data.val_size=8", f"trainer.dist_timeout_s={TIMEOUT_S}",
            f"trainer.run_dir={run_dir}", *data_args, *extra]


class Launch:
    """torchrun x2 started in the background (output to files), so a test can signal it while it trains."""

    def __init__(self, args: list[str]):
        self.marker = os.urandom(8).hex()
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", TRAIN, *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), LAUNCH_MARKER_ENV: self.marker}
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=self._err, env=env, cwd=tempfile.gettempdir(),
                                     start_new_session=True)

    def workers(self) -> dict[int, int]:
        """rank -> pid of the live workers."""
        out = {}
        for pid in launched_pids(self.marker):
            try:
                env = dict(kv.split(b"=", 1) for kv in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                           if b"=" in kv)
            except OSError:
                continue
            if b"RANK" in env and pid != self.proc.pid:
                out[int(env[b"RANK"])] = pid
        return out

    def output(self) -> str:
        text = []
        for f in (self._out, self._err):
            f.seek(0)
            text.append(f.read().decode(errors="replace"))
        return "\n".join(text)

    def wait_for(self, what: str, cond, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not within {timeout}s\n{self.output()[-6000:]}")
            if self.proc.poll() is not None and not cond():
                pytest.fail(f"{what}: the launch exited {self.proc.returncode} first\n{self.output()[-6000:]}")
            time.sleep(0.2)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launch did not end within {timeout}s\n{self.output()[-6000:]}")

    def close(self) -> list[int]:
        """Take every process of the launch down; the pids that were still alive besides torchrun."""
        left = _kill_launch(self.proc, self.marker)
        return left


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run(args: list[str], timeout: float = 120) -> tuple[int, str]:
    launch = Launch(args)
    try:
        code = launch.wait(timeout)
        return code, launch.output()
    finally:
        assert launch.close() == [], "a worker outlived the launch"


@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_stuck_peer_ends_the_job_within_the_timeout(data_args, tmp_path, mode):
    """SIGSTOP rank 1 mid-run: rank 0's next collective times out after trainer.dist_timeout_s and the error names
    its rank, step and stage (the launch would otherwise wait 30 minutes). colocate_async shares sync's world and
    its timeout (the sample stage's look at the buffer is one more collective of that group), so it is not run
    again here. In separate_async rank 1 is the rollout rank: the training rank (a world of its own, hence "0/1") hears nothing from it for the timeout, or its weight
    broadcast times out, and shutdown does not wait again for a rank that stopped answering. It trains on Megatron,
    whose parallel_state then lives on the training ranks' world."""
    run_dir = tmp_path / "run"
    # separate_async trains on Megatron here (its e2e test is FSDP's): parallel_state lives on the training sub-world
    extra = ["actor.backend=megatron"] if mode == "separate_async" else []
    launch = Launch(_args(data_args, run_dir, "trainer.total_steps=200", f"trainer.mode={mode}", *extra))
    try:
        launch.wait_for("the first step", lambda: len(_records(run_dir)) >= 1, 120)
        stuck = launch.workers()[1]
        os.kill(stuck, signal.SIGSTOP)
        # bounded by the timeout plus the time to raise and print (no progress is possible without rank 1)
        where = "[rank 0/1] in step" if mode == "separate_async" else "[rank 0/2] in step"
        launch.wait_for("rank 0's timeout error", lambda: where in launch.output(), TIMEOUT_S + 45)
        os.kill(stuck, signal.SIGCONT)  # the launcher's SIGTERM reaches a stopped process only once it runs again
        code = launch.wait(60)
    finally:
        left = launch.close()
    out = launch.output()
    assert code != 0
    assert left == []
    assert "stage '" in out and ("timed out" in out.lower() or "timeout" in out.lower()), out[-4000:]


def test_killed_launcher_leaves_no_worker(data_args, tmp_path):
    """SIGKILL torchrun alone: its workers die with it (parent-death signal) instead of training on as orphans."""
    run_dir = tmp_path / "run"
    launch = Launch(_args(data_args, run_dir, "trainer.total_steps=200"))
    try:
        launch.wait_for("the first step", lambda: len(_records(run_dir)) >= 1, 120)
        assert len(launch.workers()) == 2
        os.kill(launch.proc.pid, signal.SIGKILL)
        launch.proc.wait(10)
        deadline = time.monotonic() + 20
        while launch.workers() and time.monotonic() < deadline:
            time.sleep(0.2)
        orphans = launch.workers()
    finally:
        launch.close()
    assert orphans == {}, f"workers {orphans} outlived their killed launcher"


def test_sigterm_saves_at_the_step_boundary_then_resume_falls_back_past_damaged_checkpoints(data_args, tmp_path):
    """SIGTERM both workers (a scheduler's preemption): they finish the step, checkpoint it and exit 143. A killed
    later save (a ``.partial`` folder) and a damaged newest checkpoint are skipped by resume=auto, which resumes
    from the newest intact one and re-logs only the steps it redoes; a fresh run into the folder is refused."""
    run_dir = tmp_path / "run"
    launch = Launch(_args(data_args, run_dir, "trainer.total_steps=200", "trainer.save_freq=1"))
    try:
        launch.wait_for("two steps", lambda: len(_records(run_dir)) >= 2, 150)
        for pid in launch.workers().values():
            os.kill(pid, signal.SIGTERM)
        launch.wait(90)
    finally:
        assert launch.close() == []
    out = launch.output()
    assert "exitcode  : 143" in out and "SIGTERM received; checkpoint saved" in out, out[-4000:]
    ckpts = run_dir / "checkpoints"
    last = len(_records(run_dir))
    assert (ckpts / "latest").read_text() == f"step_{last}"  # the signal's step was saved, and named only then
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == sorted(f"step_{i}" for i in range(1, last + 1))

    # what a save killed mid-write leaves behind, and a newest checkpoint damaged after it was written
    shutil.copytree(ckpts / f"step_{last}", ckpts / f"step_{last + 1}.partial")
    (ckpts / f"step_{last + 1}.partial" / "engine_state.pt").write_bytes(b"trunc")
    (ckpts / f"step_{last}" / "engine_state.pt").write_bytes(b"trunc")
    before = _records(run_dir)
    code, out = _run(_args(data_args, run_dir, f"trainer.total_steps={last + 1}", "trainer.resume=auto",
                           "actor.optim.lr=0.0005"))
    assert code == 0, out[-6000:]
    assert f"skipping {ckpts / f'step_{last + 1}.partial'}: an unfinished save" in out
    assert f"skipping checkpoint {ckpts / f'step_{last}'}" in out
    assert f"resumed from {ckpts / f'step_{last - 1}'} at step {last - 1}; dropped 1 metrics records" in out
    assert "actor.optim.lr changed 0.001 -> 0.0005 (applied)" in out
    after = _records(run_dir)
    assert [r["step"] for r in after] == list(range(1, last + 2))  # no step logged twice
    assert after[:last - 1] == before[:last - 1]
    assert [r["actor/lr"] for r in after[last - 1:]] == [0.0005, 0.0005]

    # the finished run's folder is not reused by a fresh run: exit code 2, nothing of the old run touched
    code, out = _run(_args(data_args, run_dir, "trainer.total_steps=2"))
    assert code != 0 and "exitcode  : 2" in out, out[-4000:]
    assert f"config error: trainer.run_dir='{run_dir}' already holds a run" in out
    assert _records(run_dir) == after  # (refused resume changes: test_run_dir_claim_and_resume_config_comparison)


def _checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)["model"]


def test_nonfinite_updates_are_rolled_back_or_stop_the_run(data_args, tmp_path):
    """actor.optim.eps=1e-50 is > 0 but 0 in float32: a parameter whose gradient is 0 gets 0/0 = NaN in AdamW's
    first update. With on_nonfinite=skip every such update is rolled back (weights of step 1 and 2 are the finite
    initial ones, the loss stays finite, actor/nonfinite counts them); with stop the run ends naming the step."""
    run_dir = tmp_path / "skip"
    code, out = _run(_args(data_args, run_dir, "trainer.total_steps=2", "trainer.save_freq=1",
                           "actor.optim.eps=1e-50"))
    assert code == 0, out[-6000:]
    records = _records(run_dir)
    assert [r["actor/nonfinite"] for r in records] == [2.0, 2.0]  # both optimizer steps of each step
    assert all(r["actor/loss"] is not None for r in records)
    assert "rolled back to the pre-step weights and optimizer state" in out
    w1, w2 = (_checkpoint_weights(run_dir / "checkpoints" / f"step_{i}") for i in (1, 2))
    assert w1.keys() == w2.keys() and w1
    for name in w1:
        assert torch.isfinite(w1[name]).all(), name
        assert torch.equal(w1[name], w2[name]), name

    code, out = _run(_args(data_args, tmp_path / "stop", "trainer.total_steps=2", "actor.optim.eps=1e-50",
                           "trainer.on_nonfinite=stop"))
    assert code != 0
    assert "NonFiniteUpdateError: step 1: 2 of 2 optimizer steps gave non-finite weights or loss" in out, out[-4000:]


# ------------------------------------------------------------------------------------------------ in-process units
def _adamw_model(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, eps=1e-8)


def _step(model, opt, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()


def test_snapshot_restores_weights_and_optimizer_state_exactly():
    """After a step has made state, a rolled-back step leaves weights and every state tensor bit-identical."""
    from backends.optim import StepSnapshot

    model, opt = _adamw_model()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    _step(model, opt, x)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    snap = StepSnapshot(model.parameters(), [opt])
    _step(model, opt, x)
    assert not torch.equal(model.weight, weights["weight"])  # the step did change them
    snap.restore()
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for p, st in opt.state.items():
        for k, v in st.items():
            assert torch.equal(v, state[id(p)][k]), k


def test_rolled_back_first_step_then_a_step_equals_a_fresh_optimizers_first_step():
    """Rolling back the very first step zeroes the state it created; the next step is exactly what a never-stepped
    AdamW would do (zero moments and step are its lazy initial state)."""
    from backends.optim import StepSnapshot, all_finite

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    model, opt = _adamw_model()
    model.weight.data[0] = 0.0
    model.bias.data.zero_()
    snap = StepSnapshot(model.parameters(), [opt])
    opt.param_groups[0]["eps"] = 0.0
    _step(model, opt, torch.zeros(5, 4))  # zero input and zero bias: every gradient is 0, so 0/0 under eps=0
    assert not all_finite(model.parameters())
    snap.restore()
    opt.param_groups[0]["eps"] = 1e-8
    _step(model, opt, x)
    ref, ref_opt = _adamw_model()
    ref.weight.data[0] = 0.0
    ref.bias.data.zero_()
    _step(ref, ref_opt, x)
    for (k, v), (_, w) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(v, w), k


@pytest.mark.parametrize("override, key", [
    ("actor.optim.eps=0", "actor.optim.eps"), ("actor.optim.weight_decay=-1", "actor.optim.weight_decay"),
    ("actor.optim.betas=[1.5,0.9]", "actor.optim.betas[0]"), ("actor.optim.betas=[0.9,1.0]", "actor.optim.betas[1]"),
    ("actor.optim.lr=-0.1", "actor.optim.lr"), ("actor.optim.lr=1e39", "actor.optim.lr"),
    ("trainer.save_freq=-3", "trainer.save_freq"),
    ("trainer.val_freq=-1", "trainer.val_freq"), ("data.val_batch_size=0", "data.val_batch_size"),
    ("trainer.dist_timeout_s=0", "trainer.dist_timeout_s"), ("trainer.on_nonfinite=ignore", "trainer.on_nonfinite"),
    ("trainer.run_dir_exists=append", "trainer.run_dir_exists"),
])
def test_settings_that_would_fail_later_are_config_errors_naming_the_key(override, key):
    from rldispatch.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(CONFIG, [override])


def test_yaml_syntax_error_is_one_line_with_file_line_column(tmp_path):
    from rldispatch.config import ConfigError, load_config

    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  total_steps: 3\n  seed: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    msg = str(info.value)
    assert msg.startswith(f"{bad}:4:1: invalid YAML") and "\n" not in msg, msg


def test_run_dir_claim_and_resume_config_comparison(tmp_path):
    """A folder with another run's metrics is refused, kept on resume, emptied on overwrite; a resume refuses a
    model/layout/data-order change and returns the other changes to apply."""
    from types import SimpleNamespace

    from rldispatch.config import ConfigError
    from rldispatch.run_dir import check_resume_config, claim_run_dir

    run = tmp_path / "run"
    claim_run_dir(run, SimpleNamespace(resume="never", run_dir_exists="refuse"), is_main=True)  # empty: free
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(ConfigError, match="metrics.jsonl with 2 records; checkpoints step_2"):
        claim_run_dir(run, SimpleNamespace(resume="never", run_dir_exists="refuse"), is_main=True)
    claim_run_dir(run, SimpleNamespace(resume="auto", run_dir_exists="refuse"), is_main=True)
    assert (run / "metrics.jsonl").exists()
    claim_run_dir(run, SimpleNamespace(resume="never", run_dir_exists="overwrite"), is_main=True)
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()

    saved = {"model": {"hidden_size": 32}, "actor": {"backend": "fsdp", "optim": {"lr": 0.001}},
             "trainer": {"total_steps": 2, "resume": "never"}, "data": {"shuffle": True}}
    now = json.loads(json.dumps(saved))
    now["actor"]["optim"]["lr"], now["trainer"]["total_steps"], now["trainer"]["resume"] = 0.0005, 4, "auto"
    assert check_resume_config({"config": saved}, now, "ckpt") == [("actor.optim.lr", 0.001, 0.0005),
                                                                  ("trainer.total_steps", 2, 4)]
    for dotted, value, expect in [("model.hidden_size", 64, "model.hidden_size was 32, now 64"),
                                  ("data.shuffle", False, "data.shuffle was True, now False"),
                                  ("actor.backend", "megatron", "written by the fsdp backend")]:
        changed = json.loads(json.dumps(saved))
        section, name = dotted.split(".")
        changed[section][name] = value
        with pytest.raises(ConfigError, match=re.escape(expect)):
            check_resume_config({"config": saved}, changed, "ckpt")


def test_metrics_keep_through_drops_the_steps_a_resume_redoes(tmp_path):
    from rldispatch.metrics import MetricsLogger, read_metrics

    with MetricsLogger(tmp_path, tensorboard=False) as log:
        for step in (1, 2, 3):
            log.log(step, {"x": float(step)})
        assert log.keep_through(1) == 2
        log.log(2, {"x": 20.0})
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 20.0)]
