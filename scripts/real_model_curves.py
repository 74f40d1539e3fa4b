"""Learning against the wall clock: a real model's runs (one folder per seed), their greedy val and train reward.

    python scripts/real_model_curves.py runs/smollm2/seed0 runs/smollm2/seed1 runs/smollm2/seed2 \
        --minutes 60 --out-dir docs/results

Each run's ``metrics.jsonl`` must carry ``progress/elapsed_s`` (wall seconds since training began, validations
included; the trainer writes it every step). The validation before the first step is placed at minute 0. Per seed
the summary gives the val score at the minute marks (the last validation at or before each), the best within
``--minutes``, and whether the target is met: some validation within ``--minutes`` at least ``--gain`` above the
step-0 value and at least ``--ratio`` times it. Across seeds: median and min-max on a one-minute grid (each seed's
last value carried forward). Writes ``curves.json``, ``curves.md`` (the table) and ``curves.png`` into OUT_DIR.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

VAL, REWARD, ELAPSED = "val/score/mean", "reward/score/mean", "progress/elapsed_s"


def load_run(run: Path) -> dict:
    """The run's val points and train-reward points as (minute, value), in order."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not records:
        sys.exit(f"{run}/metrics.jsonl is empty")
    missing = [int(r["step"]) for r in records if ELAPSED not in r]
    if missing:
        sys.exit(f"{run}/metrics.jsonl: steps {missing[:5]} have no {ELAPSED} (written by the trainer since it was "
                 f"added; a run without it cannot be drawn against the clock)")
    val0 = records[0].get(VAL)
    if val0 is None:
        sys.exit(f"{run}: the first record has no {VAL} (the validation before training)")
    val = [(0.0, float(val0))]
    val += [(r[ELAPSED] / 60, float(r[VAL])) for r in records[1:] if VAL in r]
    reward = [(r[ELAPSED] / 60, float(r[REWARD])) for r in records if REWARD in r]
    steps = [(r[ELAPSED] / 60, int(r["step"])) for r in records]
    return {"run": str(run), "val": val, "reward": reward, "steps": steps}


def at(points: list[tuple[float, float]], minute: float) -> float | None:
    """The last value at or before ``minute`` (None before the first)."""
    found = [v for t, v in points if t <= minute + 1e-9]
    return found[-1] if found else None


def summarise_run(run: dict, minutes: float, marks: list[float], gain: float, ratio: float) -> dict:
    val0 = run["val"][0][1]
    inside = [(t, v) for t, v in run["val"] if t <= minutes]
    met = [(t, v) for t, v in inside if v - val0 >= gain and v >= ratio * val0]
    return {"run": run["run"], "val0": val0, "val_at": {f"{m:g}": at(run["val"], m) for m in marks},
            "best": max(v for _, v in inside), "steps_within": max([s for t, s in run["steps"] if t <= minutes],
                                                                      default=0),
            "target_met": bool(met), "target_first_minute": round(met[0][0], 1) if met else None}


def grid(runs: list[dict], key: str, minutes: float, smooth: int = 1) -> dict[str, list]:
    """Median, min and max over runs of each run's last ``key`` value, every minute (``smooth``: mean of the last
    ``smooth`` points of a run)."""
    xs, med, lo, hi = [], [], [], []
    for m in range(int(minutes) + 1):
        vals = []
        for r in runs:
            pts = [v for t, v in r[key] if t <= m + 1e-9][-smooth:]
            if pts:
                vals.append(sum(pts) / len(pts))
        if len(vals) == len(runs):
            xs.append(m)
            med.append(statistics.median(vals))
            lo.append(min(vals))
            hi.append(max(vals))
    return {"minute": xs, "median": med, "min": lo, "max": hi}


def markdown(summary: dict) -> str:
    marks = summary["marks"]
    head = (["seed run", "steps in window", "val @ 0 min"] + [f"val @ {m:g} min" for m in marks]
            + ["best in window", "target met (first minute)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summary["runs"]:
        cells = [Path(s["run"]).name, str(s["steps_within"]), f"{s['val0']:.3f}"]
        cells += ["–" if s["val_at"][f"{m:g}"] is None else f"{s['val_at'][f'{m:g}']:.3f}" for m in marks]
        cells += [f"{s['best']:.3f}", f"yes ({s['target_first_minute']})" if s["target_met"] else "no"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, title in ((axes[0], "val", "greedy val accuracy (strict)"),
                           (axes[1], "reward", "train reward (mean, last 5 steps)")):
        g = summary["grid"][key]
        (line,) = ax.plot(g["minute"], g["median"], linewidth=1.8, label=f"median of {len(runs)} seeds", zorder=3)
        ax.fill_between(g["minute"], g["min"], g["max"], color=line.get_color(), alpha=0.18, linewidth=0,
                        label="min-max", zorder=1)
        for r in runs:
            ax.plot([t for t, _ in r[key]], [v for _, v in r[key]], linewidth=0.6, alpha=0.5, color="grey",
                    marker="o" if key == "val" else None, markersize=2.5)
        ax.axvline(summary["minutes"], color="grey", linestyle=":", linewidth=1.0)
        ax.set_title(title)
        ax.set_xlabel("wall-clock minutes since training began")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders, one per seed")
    ap.add_argument("--minutes", type=float, default=60.0, help="the time window of the target")
    ap.add_argument("--gain", type=float, default=0.15, help="absolute rise over the step-0 val the target asks")
    ap.add_argument("--ratio", type=float, default=3.0, help="multiple of the step-0 val the target asks")
    ap.add_argument("--out-dir", type=Path, required=True)
    args = ap.parse_args(argv)
    runs = [load_run(r) for r in args.runs]
    marks = [m for m in (15.0, 30.0, 45.0, args.minutes) if m <= args.minutes]
    summary = {"minutes": args.minutes, "gain": args.gain, "ratio": args.ratio, "marks": marks,
               "runs": [summarise_run(r, args.minutes, marks, args.gain, args.ratio) for r in runs],
               "grid": {"val": grid(runs, "val", args.minutes), "reward": grid(runs, "reward", args.minutes, 5)},
               "points": runs}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "curves.json").write_text(json.dumps(summary, indent=1))
    (args.out_dir / "curves.md").write_text(markdown(summary))
    plot(summary, runs, args.out_dir / "curves.png")
    print(markdown(summary), end="")
    met = sum(s["target_met"] for s in summary["runs"])
    print(f"target (+{100 * args.gain:g} points and {args.ratio:g}x the step-0 val within {args.minutes:g} min): "
          f"{met} of {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
