"""The closing summary of a run (rldispatch/summary.py)."""
from pathlib import Path

from rldispatch.summary import RunSummary


def test_summary_of_a_resumed_run_stopped_early(tmp_path: Path):
    for step in (4, 6, 10):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step_6")
    s = RunSummary(start_step=4)
    s.record(5, {"reward/score/mean": 1.0})  # no val score: not recorded
    s.record(6, {"val/score/mean": 0.5})
    s.record(8, {"val/score/mean": 0.5})  # a tie keeps the earlier step as the best
    text = s.text(end_step=8, total_steps=20, seconds=125.0, run_dir=tmp_path, metrics_file=tmp_path / "m.jsonl",
                  exit_code=143).splitlines()
    assert text[0] == "run stopped early (exit status 143): 4 step(s) this run, step 8 of 20 (resumed at step 4)"
    assert text[1] == "val score (val/score/mean): 0.500 (step 6) -> best 0.500 (step 6) -> last 0.500 (step 8)"
    assert text[2] == "wall time: 2m 05.0s (31.25 s per step)"
    assert text[4] == f"checkpoints: {tmp_path / 'checkpoints' / 'step_10'} (and 2 earlier in {tmp_path / 'checkpoints'})"
    assert text[-1] == f"export:      rldispatch export --checkpoint {tmp_path / 'checkpoints' / 'step_10'} --out <folder>"


def test_summary_without_validation_or_checkpoints(tmp_path: Path):
    text = RunSummary(start_step=0).text(end_step=0, total_steps=0, seconds=0.5, run_dir=tmp_path,
                                         metrics_file=tmp_path / "metrics.jsonl", exit_code=0)
    assert "val score: not measured in this run" in text and "checkpoints: none written" in text
    assert "export:" not in text and text.startswith("run finished: 0 step(s) this run, step 0 of 0")
