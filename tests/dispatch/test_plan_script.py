"""scripts/plan.py: the plan of a config on a world size, printed without GPUs or torch.distributed."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _load_script():
    spec = importlib.util.spec_from_file_location("rldispatch_plan_script", REPO / "scripts" / "plan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plan_script_prints_topology_dp_and_balance(capsys, tmp_path):
    plan = _load_script()
    out_json = tmp_path / "plan.json"
    rc = plan.main(["--config", str(REPO / "configs" / "grpo_tiny.yaml"), "--world", "8", "--synthetic", "bimodal",
                    "--json", str(out_json), "actor.backend=megatron", "actor.megatron.tp=2", "actor.megatron.pp=2",
                    "data.train_batch_size=16", "rollout.n=4", "actor.ppo_mini_batch_size=4",
                    "actor.micro_batch_size_per_gpu=4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "-> dp=2" in out and "== logical DP = 2" in out
    assert out.count("yes") == 2  # one reporting rank per replica in the topology table
    assert "workload max/mean per step: before" in out and "dispatch/balance_after" in out
    data = json.loads(out_json.read_text())
    assert len(data["ranks"]) == 2 and data["metrics"]["dispatch/balance_after"] <= data["metrics"][
        "dispatch/balance_before"]
    assert sum(r["samples"] for r in data["ranks"]) == 16 * 4


def test_plan_script_reads_lengths_and_refuses_bad_configs(capsys, tmp_path):
    plan = _load_script()
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("# prompt_len response_len\n" + "\n".join(f"{5 + i % 3} {i % 11 + 1}" for i in range(30)))
    rc = plan.main(["--config", str(REPO / "configs" / "grpo_tiny.yaml"), "--world", "4", "--lengths", str(lengths),
                    "actor.use_dynamic_bsz=true", "actor.max_token_len_per_gpu=80", "actor.fsdp.ulysses_sp=2",
                    "rollout.n=4", "actor.ppo_mini_batch_size=4", "data.max_response_length=16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "30 trajectories" in out and "+2 padding" in out and "token budget 160" in out
    rc = plan.main(["--config", str(REPO / "configs" / "grpo_tiny.yaml"), "--world", "6", "actor.fsdp.ulysses_sp=4"])
    assert rc == 2 and "ulysses_sp (4)" in capsys.readouterr().err
