"""scripts/learning_curves.py: per-layout spreads over seeds, the first step a reward threshold is reached, the
summary files from existing run folders, and a real tiny study (2 seeds x 1 layout x 2 steps under torchrun)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rldispatch.metrics import MetricsLogger

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "learning_curves.py"


def _load():
    spec = importlib.util.spec_from_file_location("_script_learning_curves", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the script executes
    spec.loader.exec_module(mod)
    return mod


lc = _load()


@settings(max_examples=200)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=30))
def test_spread_is_ordered_and_the_median_splits_the_values(xs):
    sp = lc.spread(xs)
    assert sp["min"] == min(xs) and sp["max"] == max(xs) and sp["n"] == len(xs)
    assert sp["min"] <= sp["median"] <= sp["max"]
    below = sum(x <= sp["median"] for x in xs)
    above = sum(x >= sp["median"] for x in xs)
    assert below >= len(xs) / 2 and above >= len(xs) / 2  # the defining property of a median
    if len(xs) % 2:
        assert sp["median"] in xs


@given(st.dictionaries(st.integers(1, 300), st.floats(0.0, 1.0), min_size=0, max_size=40), st.floats(0.0, 1.0))
def test_first_reach_is_the_earliest_step_at_or_over_the_threshold(reward, thr):
    got = lc.first_reach(reward, thr)
    over = [s for s, v in reward.items() if v >= thr]
    assert got == (min(over) if over else None)


def test_run_curves_reads_the_step1_val_as_before_training():
    recs = [{"step": 1, "reward/score/mean": 0.2, "val/score/mean": 0.28}, {"step": 2, "reward/score/mean": 0.5},
            {"step": 2, "reward/score/mean": 0.6, "val/score/mean": 0.7}]  # step 2 logged twice: the last wins
    c = lc.run_curves(recs, seed=3, val_freq=2)
    assert c.val == {0: 0.28, 2: 0.7} and c.reward == {1: 0.2, 2: 0.6} and c.last_step == 2
    assert lc.run_curves(recs, seed=3, val_freq=1).val == {1: 0.28, 2: 0.7}
    with pytest.raises(lc.StudyError, match="no record"):
        lc.run_curves([], seed=0)


def _fake_run(folder: Path, rewards: list[float], vals: dict[int, float], val_freq: int = 2) -> None:
    with MetricsLogger(folder) as log:
        for step, r in enumerate(rewards, 1):
            rec = {"reward/score/mean": r}
            want = 0 if step == 1 else step
            if want in vals:
                rec["val/score/mean"] = vals[want]
            log.log(step, rec)
    (folder / "config.json").write_text(json.dumps({"trainer": {"val_freq": val_freq}}))


def test_summarise_only_writes_table_json_and_png(tmp_path):
    _fake_run(tmp_path / "fsdp-dp2" / "seed0", [0.2, 0.995, 1.0, 1.0], {0: 0.3, 2: 0.8, 4: 1.0})
    _fake_run(tmp_path / "fsdp-dp2" / "seed1", [0.2, 0.5, 0.999, 1.0], {0: 0.3, 2: 0.6, 4: 0.9})
    _fake_run(tmp_path / "fsdp-dp2" / "seed2", [0.2, 0.4, 0.6, 0.995], {0: 0.3, 2: 0.5, 4: 0.7})
    _fake_run(tmp_path / "megatron-tp2" / "seed0", [0.2, 0.3, 0.4, 0.5], {0: 0.3, 2: 0.4, 4: 0.5})
    (tmp_path / "wall_times.json").write_text(json.dumps({"fsdp-dp2/seed0": 10.0, "fsdp-dp2/seed1": 12.0}))
    assert lc.main(["--summarise-only", "--out-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "learning_curves.json").read_text())
    fsdp = summary["layouts"]["fsdp-dp2"]
    assert fsdp["val"]["2"] == {"median": 0.6, "min": 0.5, "max": 0.8, "n": 3}
    assert fsdp["first_reach"] == {"0": 2, "1": 3, "2": 4} and fsdp["reached"] == "3/3"
    assert fsdp["wall_s"]["median"] == 11.0
    assert summary["layouts"]["megatron-tp2"]["first_reach_spread"] is None
    assert "megatron-dp2" not in summary["layouts"]  # no runs: no row, not a row of zeros
    table = (tmp_path / "learning_curves.md").read_text().splitlines()
    assert table[0].startswith("| layout | seeds | val @ 0 | val @ 2 | val @ 4 |")
    assert table[2].startswith("| fsdp-dp2 | 3 | 0.300 | 0.600 [0.500–0.800] | 0.900 [0.700–1.000] | 3 [2–4] (3/3")
    assert "| megatron-tp2 | 1 |" in table[3] and "not reached" in table[3]
    assert (tmp_path / "learning_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_summarise_only_without_runs_and_bad_folders_are_errors(tmp_path):
    assert lc.main(["--summarise-only", "--out-dir", str(tmp_path)]) == 2
    (tmp_path / "fsdp-dp2" / "seed_a").mkdir(parents=True)
    with pytest.raises(lc.StudyError, match="seed<k>"):
        lc.load_layout(tmp_path / "fsdp-dp2")
    assert lc.main(["--steps", "0", "--summarise-only", "--out-dir", str(tmp_path)]) == 2


@pytest.mark.dist
@pytest.mark.slow
def test_tiny_study_runs_and_keeps_finished_runs(tmp_path, process_tree):
    """A seed x FSDP DP=2 x 2 steps for real; a second call keeps the finished run and only re-summarises. (The
    summary over several seeds: test_summarise_only_writes_table_json_and_png.)"""
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    cmd = [sys.executable, str(SCRIPT), "--seeds", "0", "--steps", "2", "--layouts", "fsdp-dp2",
           "--val-freq", "2", "--out-dir", str(tmp_path)]
    proc = process_tree(cmd, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "learning_curves.json").read_text())
    lay = summary["layouts"]["fsdp-dp2"]
    assert lay["seeds"] == [0] and set(lay["val"]) == {"0", "2"} and lay["val"]["2"]["n"] == 1
    assert set(json.loads((tmp_path / "wall_times.json").read_text())) == {"fsdp-dp2/seed0"}
    again = process_tree(cmd, timeout=600, env=env, cwd=tmp_path)
    assert again.returncode == 0 and again.stdout.count("finished earlier, kept") == 1, again.stdout
