"""The FSDP2 engine against a single-process plain-torch reference (torchrun, gloo, CPU; tiny model).

Launches are grouped (a launch costs ~20 s on a loaded 2-core machine): one 2-rank launch runs the parity,
option and bad-input checks and saves a checkpoint; this process then joins a 1-rank group to load it (2 -> 1)
and to check DP = 1; one 4-rank launch covers the HSDP and SP x DP meshes.
"""
from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest
import torch.distributed as dist

WORKER = Path(__file__).resolve().parent.parent / "dist" / "fsdp_engine_worker.py"

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _worker_module():
    spec = importlib.util.spec_from_file_location("fsdp_engine_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_single_rank(modes: str, path: str, capsys) -> str:
    """Run worker modes in this process as a 1-rank gloo group; return what rank 0 printed."""
    mod = _worker_module()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mod.run_modes(modes, path)
    finally:
        dist.destroy_process_group()
    return capsys.readouterr().out


def _assert_lines(out: str, expected: list[str]) -> None:
    lines = [l[3:] for l in out.splitlines() if l.startswith("OK ")]
    for e in expected:
        assert any(l.startswith(e) for l in lines), f"check {e!r} did not report OK; got {lines}"


def test_two_ranks_parity_options_errors_and_checkpoint_to_one_rank(torchrun, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    out = torchrun(WORKER, 2, "parity,options,critic,ckpt_save", "--path", str(ckpt), timeout=400)
    _assert_lines(out, [
        "sgd_parity dp=2", "adamw_parity", "infer_order_shift_temperature",       # tests 1, 3
        "equal_update micro1", "equal_update micro4", "equal_update budget24",    # test 2
        "equal_update padding_samples", "equal_update ulysses_sp=2",
        "entropy_and_kl_loss", "activation_checkpointing", "weights_round_trip", "lr_schedule",
        "nonfinite_skip", "bad_input_errors",                                      # test 5
        "critic_parity sp=1 micro=2 dp=2", "critic_parity sp=1 micro=5 dp=2",   # the critic: values, update
        "critic_parity sp=2 micro=3 dp=1", "critic_padding_moves_nothing",
        "ckpt_resume_bitwise world=2",                                             # test 4
    ])
    out1 = _run_single_rank("ckpt_load,dp1", str(ckpt), capsys)
    _assert_lines(out1, ["ckpt_reshard_load world=1", "sgd_parity dp=1", "topology_agrees"])


def test_four_ranks_hsdp_and_sequence_parallel_meshes(torchrun):
    out = torchrun(WORKER, 4, "mesh4", timeout=400)
    _assert_lines(out, ["equal_update dp4 dp=4", "equal_update hsdp2x2 dp=4", "equal_update sp2xdp2 dp=2",
                        "equal_update sp2_hsdp2x2 dp=2", "equal_update sp4_kv_repeat dp=1"])
