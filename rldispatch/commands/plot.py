"""Draw the training curves of a run (RUN_DIR/metrics.jsonl) to a PNG.

    python scripts/plot_metrics.py runs/tiny [--out runs/tiny/metrics.png] [--keys reward/mean kl ...]
    python scripts/plot_metrics.py runs/a runs/b --keys reward/score/mean   # several runs, overlaid

One panel per family of keys that exists (reward, KL, entropy, policy loss, grad norm, lr, balance, throughput,
bytes received, lengths, clip fraction, stage times); ``--keys`` plots exactly the given keys instead. When a step
was logged twice (a resumed run), the last record wins. Stage times are drawn largest first (by median over the
steps), the smallest folded into one "other" line, with the step's total as a dashed line; a ``/mean`` key is
drawn over a light band between its ``/min`` and ``/max``; steps are integers on the x axis.
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
STAGE_PANEL = "stage times (s)"
STAGE_TOTAL = "timing_s/step"  # the whole step; drawn as the reference line, not ranked with the stages
MAX_STAGES = 7  # stages drawn by name; the rest are summed into "other"
BAND_ALPHA = 0.12  # min/max band: light enough that the median line over it stays the thing one reads

__all__ = ["PANELS", "STAGE_PANEL", "STAGE_TOTAL", "MAX_STAGES", "BAND_ALPHA", "group_keys", "series", "rank_stages",
           "render", "plot", "main"]


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


def _median(xs: list[float]) -> float:
    vals = sorted(x for x in xs if not math.isnan(x))
    if not vals:
        return math.nan
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else 0.5 * (vals[mid - 1] + vals[mid])


def rank_stages(values: dict[str, list[float]], keys: list[str], top: int = MAX_STAGES
                ) -> list[tuple[str, list[float]]]:
    """The stage-time lines to draw: (label, per-step values), largest median first.

    ``keys`` are the panel's stage keys; :data:`STAGE_TOTAL` is left out of the ranking. When there are more than
    ``top`` stages, the ``top - 1`` largest are kept by name and the others summed per step into ``"other (n)"``
    (NaN, a stage absent at a step, counts as 0 there; a step where all folded stages are absent stays NaN), so the
    lines drawn always add up to the sum of all stages. Ties keep the key order.
    """
    if top < 2:
        raise ValueError(f"top must be >= 2 (one named stage and 'other'), got {top}")
    stages = [k for k in keys if k != STAGE_TOTAL and k in values]
    med = {k: _median(values[k]) for k in stages}
    ranked = sorted(stages, key=lambda k: (math.isnan(med[k]), 0.0 if math.isnan(med[k]) else -med[k]))
    if len(ranked) <= top:
        return [(k, values[k]) for k in ranked]
    kept, rest = ranked[: top - 1], ranked[top - 1:]
    other = []
    for i in range(len(values[rest[0]])):
        col = [values[k][i] for k in rest]
        other.append(math.nan if all(math.isnan(x) for x in col) else sum(x for x in col if not math.isnan(x)))
    return [(k, values[k]) for k in kept] + [(f"other ({len(rest)})", other)]


def _draw_stages(ax, data: list, ks: list[str]) -> None:
    """Stage times of every run: the largest first, the rest as "other", the step total dashed."""
    for name, steps, values in data:
        prefix = f"{name}: " if len(data) > 1 else ""
        for label, ys in rank_stages(values, [k for k in ks if k in values]):
            pts = [(s, v) for s, v in zip(steps, ys) if not math.isnan(v)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=prefix + label.removeprefix("timing_s/"),
                    linewidth=1.2)
        if STAGE_TOTAL in values and STAGE_TOTAL in ks:
            pts = [(s, v) for s, v in zip(steps, values[STAGE_TOTAL]) if not math.isnan(v)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=prefix + "step (total)", color="black",
                    linestyle="--", linewidth=1.0)


def _draw_lines(ax, data: list, ks: list[str]) -> None:
    """Each key of every run as a line; a ``/mean`` key with ``/min`` and ``/max`` over a light band of its colour."""
    base = [k for k in ks if not k.endswith(("/min", "/max", "/std"))] or ks
    for name, steps, values in data:
        for k in [k for k in base if k in values][:MAX_LINES]:
            pts = [(s, v) for s, v in zip(steps, values[k]) if not math.isnan(v)]
            sparse = len(pts) < len(steps) / 2  # e.g. validation every N steps: draw the points themselves
            label = f"{name}: {k}" if len(data) > 1 else k
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, linewidth=1.6, zorder=3,
                              marker="o" if sparse else None, markersize=4)
            stem = k[: -len("/mean")] if k.endswith("/mean") else None
            if len(data) == 1 and stem and f"{stem}/min" in values and f"{stem}/max" in values:
                ax.fill_between(steps, values[f"{stem}/min"], values[f"{stem}/max"], color=line.get_color(),
                                alpha=BAND_ALPHA, linewidth=0, zorder=1, label=f"{stem} min–max")


def render(run_dir: str | Path | list, keys: list[str] | None = None):
    """Build the figure without saving it; return (figure, panel -> keys map in drawing order).

    ``run_dir`` may be a list of runs: each panel then overlays every run's curves, labelled by run folder. The
    stage-time panel lists its keys largest first (by median over the first run's steps), the step total last.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

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
    if STAGE_PANEL in panels and not keys:
        merged = {k: v for _, _, values in reversed(data) for k, v in values.items()}  # the first run wins
        stages = panels[STAGE_PANEL]
        order = [k for k, _ in rank_stages(merged, stages, top=len(stages) + 2)]
        panels[STAGE_PANEL] = order + [k for k in stages if k not in order]
    n = len(panels)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, ks) in zip(axes.flat, panels.items()):
        if title == STAGE_PANEL and not keys:
            _draw_stages(ax, data, ks)
        else:
            _draw_lines(ax, data, ks)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(", ".join(str(r) for r in runs), fontsize=9)
    fig.tight_layout()
    return fig, panels


def plot(run_dir: str | Path | list, out: str | Path | None = None, keys: list[str] | None = None
         ) -> tuple[Path, dict]:
    """Write the PNG (default: the first RUN_DIR/metrics.png); return its path and the panel -> keys map drawn."""
    import matplotlib.pyplot as plt

    fig, panels = render(run_dir, keys)
    runs = [run_dir] if isinstance(run_dir, (str, Path)) else list(run_dir)
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
