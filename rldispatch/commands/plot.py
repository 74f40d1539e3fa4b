"""Draw the training curves of a run (RUN_DIR/metrics.jsonl) to a PNG.

    python scripts/plot_metrics.py runs/tiny [--out runs/tiny/metrics.png] [--keys reward/mean kl ...]
    python scripts/plot_metrics.py runs/a runs/b --keys reward/score/mean   # several runs, overlaid

One panel per family of keys that exists (reward, KL, entropy, policy loss, grad norm, lr, balance, throughput,
bytes received, lengths, clip fraction, stage times); ``--keys`` plots exactly the given keys instead. When a step
was logged twice (a resumed run), the last record wins.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from rldispatch.metrics import MetricsError, read_metrics

# (panel title, regex on the key); a key goes to the first panel that matches it.
PANELS: tuple[tuple[str, str], ...] = (
    ("stage times (s)", r"^tim(e|ing)"),  # first, so timing_s/reward is a time, not a reward
    ("reward", r"reward|score"),
    ("KL", r"(^|[/_])kl"),
    ("entropy", r"entropy"),
    ("grad norm", r"grad_norm"),
    ("learning rate", r"(^|/)lr$"),
    ("balance (max/mean)", r"balance"),
    ("throughput", r"tokens_per_s|throughput|tok_per_s"),
    ("bytes received", r"bytes"),
    ("lengths", r"length"),
    ("clip fraction", r"clipfrac|clip_frac"),
    ("policy loss", r"loss"),
)
MAX_LINES = 8


def group_keys(keys: list[str]) -> dict[str, list[str]]:
    """Map panel title -> the keys drawn in it (only panels with keys, in panel order)."""
    out: dict[str, list[str]] = {}
    for key in keys:
        if key == "step":
            continue
        for title, pattern in PANELS:
            if re.search(pattern, key):
                out.setdefault(title, []).append(key)
                break
    return {t: out[t] for t, _ in PANELS if t in out}


def series(records: list[dict]) -> tuple[list[int], dict[str, list[float]]]:
    """Steps (sorted, last record per step wins) and one list of values per key (NaN where absent)."""
    by_step: dict[int, dict] = {}
    for rec in records:
        by_step[int(rec["step"])] = rec
    steps = sorted(by_step)
    keys = sorted({k for rec in by_step.values() for k, v in rec.items()
                   if k != "step" and (v is None or isinstance(v, (int, float)))})
    values = {}
    for k in keys:
        col = []
        for s in steps:
            v = by_step[s].get(k)
            col.append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan)
        values[k] = col
    return steps, values


def plot(run_dir: str | Path | list, out: str | Path | None = None, keys: list[str] | None = None
         ) -> tuple[Path, dict]:
    """Write the PNG; return its path and the panel -> keys map that was drawn.

    ``run_dir`` may be a list of runs: each panel then overlays every run's curves, labelled by run folder.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [run_dir] if isinstance(run_dir, (str, Path)) else list(run_dir)
    data = []
    for run in runs:
        records = read_metrics(run)
        if not records:
            raise MetricsError(f"{run}: metrics file has no records")
        data.append((Path(run).name, *series(records)))
    present = sorted({k for _, _, values in data for k in values})
    if keys:
        missing = [k for k in keys if k not in present]
        if missing:
            raise MetricsError(f"--keys {missing} not in the metrics; available: {present}")
        panels = {k: [k] for k in keys}
    else:
        panels = group_keys(present)
    if not panels:
        raise MetricsError(f"{runs}: no numeric metric to plot; keys present: {present}")
    n = len(panels)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, ks) in zip(axes.flat, panels.items()):
        base = [k for k in ks if not k.endswith(("/min", "/max", "/std"))] or ks
        for name, steps, values in data:
            for k in [k for k in base if k in values][:MAX_LINES]:
                pts = [(s, v) for s, v in zip(steps, values[k]) if not math.isnan(v)]
                sparse = len(pts) < len(steps) / 2  # e.g. validation every N steps: draw the points themselves
                label = f"{name}: {k}" if len(data) > 1 else k
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, linewidth=1.2,
                        marker="o" if sparse else None, markersize=4)
                stem = k[: -len("/mean")] if k.endswith("/mean") else None
                if len(data) == 1 and stem and f"{stem}/min" in values and f"{stem}/max" in values:
                    ax.fill_between(steps, values[f"{stem}/min"], values[f"{stem}/max"], alpha=0.15)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(", ".join(str(r) for r in runs), fontsize=9)
    fig.tight_layout()
    first = Path(runs[0])
    path = Path(out) if out else (first if first.is_dir() else first.parent) / "metrics.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path, panels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", nargs="+",
                    help="run directory holding metrics.jsonl (or the file itself); several runs are overlaid")
    ap.add_argument("--out", default=None, help="PNG path (default: the first RUN_DIR/metrics.png)")
    ap.add_argument("--keys", nargs="+", default=None, help="plot exactly these keys, one panel each")
    args = ap.parse_args(argv)
    try:
        path, panels = plot(args.run_dir, args.out, args.keys)
    except MetricsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for title, ks in panels.items():
        print(f"{title}: {', '.join(ks)}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
