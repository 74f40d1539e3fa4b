"""The trainer on the reference system's data format: a GSM8K parquet as its preprocessing writes it, the built-in
``openai/gsm8k`` scorer, and a user's reward function with extra values, end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "scripts" / "train.py")


def _gsm8k_parquet(path: Path, n: int, split: str) -> str:
    """``n`` rows exactly in the reference system's GSM8K layout (short questions: the default prompt budget)."""
    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"{i} + {i % 7} = ? Answer after ####."}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + i % 7)},
             "extra_info": {"split": split, "index": i, "answer": f"#### {i + i % 7}", "question": f"{i} + {i % 7}"}}
            for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_steps_on_a_gsm8k_parquet_with_only_the_file_paths_set(tmp_path):
    train = _gsm8k_parquet(tmp_path / "gsm8k" / "train.parquet", 32, "train")
    val = _gsm8k_parquet(tmp_path / "gsm8k" / "test.parquet", 8, "test")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, TRAIN, f"data.train_files=[{train}]", f"data.val_files=[{val}]",
         f"trainer.run_dir={run_dir}", "trainer.total_steps=2"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # a random policy never writes "#### <answer>": the strict scorer gives 0 to every trajectory
        assert r["reward/score/mean"] == 0.0 and r["reward/score/max"] == 0.0, r
        assert r["samples/real"] == 16 * 8
    assert records[0]["val/score/mean"] == 0.0 and records[-1]["val/score/mean"] == 0.0
    assert sorted(p.name for p in (tmp_path / "gsm8k").iterdir()) == ["test.parquet", "train.parquet"]  # none made


CUSTOM = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    assert data_source == "openai/gsm8k" and extra_info["split"] in ("train", "test"), (data_source, extra_info)
    assert extra_info["answer"] == "#### " + ground_truth  # the row's extra_info, as the file holds it
    return {"score": len(solution_str) / 100.0 + bonus, "acc": solution_str.endswith(ground_truth),
            "length": len(solution_str), "pred": solution_str[-5:]}
'''


@pytest.mark.dist
@pytest.mark.slow
def test_custom_reward_function_and_dapo_manager_on_two_ranks(torchrun, tmp_path):
    train = _gsm8k_parquet(tmp_path / "d" / "train.parquet", 32, "train")
    val = _gsm8k_parquet(tmp_path / "d" / "test.parquet", 8, "test")
    fn = tmp_path / "my_reward.py"
    fn.write_text(CUSTOM)
    run_dir = tmp_path / "run"
    torchrun(TRAIN, 2, f"data.train_files=[{train}]", f"data.val_files=[{val}]", f"trainer.run_dir={run_dir}",
             "trainer.total_steps=2", "trainer.progress_bar=false", "trainer.tensorboard=false",
             f"custom_reward_function.path={fn}", "custom_reward_function.name=compute_score",
             "custom_reward_function.reward_kwargs.bonus=0.5", "reward.manager=dapo",
             "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4",
             "reward.overlong_buffer.penalty_factor=1.0", timeout=500)
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # every extra numeric value of the user's dict is a metric, averaged over both ranks' real samples
        for key in ("reward/extra/acc/mean", "reward/extra/length/mean", "reward/extra/overlong_reward/mean",
                    "reward/extra/overlong/mean"):
            assert key in r, (key, sorted(k for k in r if k.startswith("reward")))
        assert "reward/extra/pred/mean" not in r  # a string has no mean
        assert 0.0 <= r["reward/extra/acc/mean"] <= 1.0 and r["reward/extra/length/mean"] > 0
        assert -1.0 <= r["reward/extra/overlong_reward/mean"] <= 0.0
        # score = length / 100 + bonus + overlong penalty, averaged over the same samples
        expected = r["reward/extra/length/mean"] / 100 + 0.5 + r["reward/extra/overlong_reward/mean"]
        assert r["reward/score/mean"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
