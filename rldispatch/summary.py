"""The few lines a run prints when it ends: how far it got, how validation moved, and where its outputs are."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RunSummary", "VAL_KEY"]

#: The validation metric the summary follows (the mean rule-based score of greedy responses).
VAL_KEY = "val/score/mean"


@dataclass
class RunSummary:
    """Collects a run's validation scores step by step; :meth:`text` formats the closing summary.

    >>> s = RunSummary(start_step=0)
    >>> s.record(0, {"val/score/mean": 0.25}); s.record(3, {"val/score/mean": 0.75}); s.record(5, {"val/score/mean": 0.5})
    >>> s.val_line()
    'val score (val/score/mean): 0.250 (step 0) -> best 0.750 (step 3) -> last 0.500 (step 5)'
    """

    start_step: int
    val: list[tuple[int, float]] = field(default_factory=list)

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """Note ``metrics``' validation score at ``step``, if it has one."""
        if VAL_KEY in metrics:
            self.val.append((int(step), float(metrics[VAL_KEY])))

    def val_line(self) -> str:
        if not self.val:
            return "val score: not measured in this run (trainer.val_freq=0 validates before the first and after " \
                   "the last step only)"
        (s0, v0), (sl, vl) = self.val[0], self.val[-1]
        sb, vb = max(self.val, key=lambda sv: (sv[1], -sv[0]))
        return (f"val score ({VAL_KEY}): {v0:.3f} (step {s0}) -> best {vb:.3f} (step {sb}) -> "
                f"last {vl:.3f} (step {sl})")

    def text(self, end_step: int, total_steps: int, seconds: float, run_dir: Path, metrics_file: Path,
             exit_code: int) -> str:
        """The summary: steps done, validation first -> best -> last, wall time, and where the outputs are."""
        ckpt_root = Path(run_dir) / "checkpoints"
        ckpts = sorted((p for p in ckpt_root.glob("step_*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
        done = end_step - self.start_step
        how = "finished" if end_step >= total_steps else f"stopped early (exit status {exit_code})"
        lines = [
            f"run {how}: {done} step(s) this run, step {end_step} of {total_steps}"
            + (f" (resumed at step {self.start_step})" if self.start_step else ""),
            self.val_line(),
            f"wall time: {_duration(seconds)} ({seconds / max(done, 1):.2f} s per step)",
            f"metrics:     {metrics_file}",
            f"checkpoints: {ckpts[-1] if ckpts else 'none written'}"
            + (f" (and {len(ckpts) - 1} earlier in {ckpt_root})" if len(ckpts) > 1 else ""),
            f"plot:        rldispatch plot {run_dir}",
        ]
        if ckpts:
            lines.append(f"export:      rldispatch export --checkpoint {ckpts[-1]} --out <folder>")
        return "\n".join(lines)


def _duration(seconds: float) -> str:
    m, s = divmod(max(seconds, 0.0), 60.0)
    h, m = divmod(int(m), 60)
    return f"{h}h {m:02d}m {s:04.1f}s" if h else f"{m}m {s:04.1f}s" if m else f"{s:.1f}s"
