"""Learning results as distributions: the shipped task for N seeds per backend layout, summarised per layout.

    python scripts/learning_curves.py --seeds 0 1 2 3 4 --steps 300 --val-freq 50 --out-dir runs/curves
    python scripts/learning_curves.py --summarise-only --out-dir runs/curves      # re-read finished runs

Each (layout, seed) is one ``torchrun --nproc_per_node=2 scripts/train.py`` of the shipped config, run one after
another, into ``OUT_DIR/<layout>/seed<k>``; a run whose metrics already reach the last step is kept, not re-run.
Per layout the summary gives the median and min-max over seeds of the greedy validation score at every validation
step, and the step at which the training reward (``reward/score/mean``) first reaches ``--reward-threshold``
(or "not reached"). It writes ``learning_curves.json``, ``learning_curves.md`` (the table) and
``learning_curves.png`` (median curve and min-max band per layout) into OUT_DIR.

A validation in the record of step 1 is the one taken before training (step 0) unless validation runs every step.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rldispatch.metrics import MetricsError, read_metrics  # noqa: E402

__all__ = ["LAYOUTS", "RunCurves", "StudyError", "run_curves", "first_reach", "spread", "summarise_layout",
           "summarise", "markdown_table", "plot_curves", "run_study", "main"]

# layout name -> train.py overrides (every layout runs on 2 ranks)
LAYOUTS: dict[str, tuple[str, ...]] = {
    "fsdp-dp2": ("actor.backend=fsdp",),
    "megatron-dp2": ("actor.backend=megatron", "actor.megatron.tp=1"),
    "megatron-tp2": ("actor.backend=megatron", "actor.megatron.tp=2"),
    # asynchronous training (docs/async.md): one warm-up batch ahead, partial rollout, drop at span > 8
    "fsdp-dp2-colocate_async": ("actor.backend=fsdp", "trainer.mode=colocate_async"),
    "megatron-dp2-colocate_async": ("actor.backend=megatron", "actor.megatron.tp=1", "trainer.mode=colocate_async"),
    # rank 1 generates, rank 0 trains (FSDP on one rank); a global step is the step's 2 mini-batches
    "fsdp-separate_async": ("actor.backend=fsdp", "trainer.mode=separate_async"),
}
#: vLLM's CPU attention needs a head size of 32 or more (docs/vllm.md): the engines compared on grpo_tiny with
#: 2 heads of 32 instead of 4 of 16, the embedded engine on the same model as the baseline
_H32 = ("model.num_heads=2", "model.num_kv_heads=1")
_VLLM = ("rollout.engine=vllm",)
LAYOUTS.update({
    "fsdp-dp2-h32": ("actor.backend=fsdp", *_H32),
    "fsdp-dp2-h32-vllm": ("actor.backend=fsdp", *_H32, *_VLLM),
    "fsdp-dp2-h32-colocate_async": ("actor.backend=fsdp", *_H32, "trainer.mode=colocate_async"),
    "fsdp-dp2-h32-colocate_async-vllm": ("actor.backend=fsdp", *_H32, "trainer.mode=colocate_async", *_VLLM),
    "fsdp-h32-separate_async-vllm": ("actor.backend=fsdp", *_H32, "trainer.mode=separate_async", *_VLLM),
})
#: a vision-language policy (grpo_vl_tiny, --override model.hf_path=<absolute folder>): the colors task and its
#: blank-picture control, the same rows with grey pictures
LAYOUTS.update({
    "fsdp-dp2-vl": ("actor.backend=fsdp",),
    "fsdp-dp2-vl-blank": ("actor.backend=fsdp", "data.task=colors_blank"),
})
NPROC = 2
VAL_KEY = "val/score/mean"
REWARD_KEY = "reward/score/mean"
DEFAULT_CONFIG = "grpo_tiny"


class StudyError(ValueError):
    """A run folder or an option that the study cannot use; the message names it and what was expected."""


@dataclass(frozen=True)
class RunCurves:
    """One run's curves: greedy val score by step (0 = before training) and train reward by step."""

    seed: int
    val: dict[int, float]
    reward: dict[int, float]
    last_step: int


def run_curves(records: list[dict], seed: int, val_freq: int | None = None) -> RunCurves:
    """The val and train-reward curves of one run's metric records (the last record of a step wins).

    The val in the record of step 1 is the pre-training one (step 0) unless ``val_freq == 1``; with
    ``val_freq=None`` it is read from the run's config (``trainer.val_freq``) by the caller, or taken as not 1.
    """
    by_step: dict[int, dict] = {int(r["step"]): r for r in records}
    if not by_step:
        raise StudyError(f"seed {seed}: the metrics hold no record")
    val, reward = {}, {}
    for step in sorted(by_step):
        rec = by_step[step]
        if isinstance(rec.get(REWARD_KEY), (int, float)):
            reward[step] = float(rec[REWARD_KEY])
        if isinstance(rec.get(VAL_KEY), (int, float)):
            val[0 if step == 1 and val_freq != 1 else step] = float(rec[VAL_KEY])
    return RunCurves(seed=seed, val=val, reward=reward, last_step=max(by_step))


def first_reach(reward: dict[int, float], threshold: float) -> int | None:
    """The first step whose train reward is >= ``threshold``; None when no step reaches it."""
    for step in sorted(reward):
        if reward[step] >= threshold:
            return step
    return None


def spread(values: list[float]) -> dict[str, float | int]:
    """Median, min and max of ``values`` (the median of an even count is the mean of the middle two)."""
    if not values:
        raise StudyError("spread() of no values")
    xs = sorted(values)
    mid = len(xs) // 2
    med = xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])
    return {"median": med, "min": xs[0], "max": xs[-1], "n": len(xs)}


def summarise_layout(runs: list[RunCurves], threshold: float) -> dict:
    """Per val step present in every run: median / min / max over seeds; first-reach steps; the reward curve spread.

    Val steps missing from some run (a run stopped early) are reported with the seeds that have them in ``n``.
    """
    if not runs:
        raise StudyError("summarise_layout() of no runs")
    val_steps = sorted({s for r in runs for s in r.val})
    val = {s: spread([r.val[s] for r in runs if s in r.val]) for s in val_steps}
    reward_steps = sorted({s for r in runs for s in r.reward})
    reward = {s: spread([r.reward[s] for r in runs if s in r.reward]) for s in reward_steps}
    reach = {r.seed: first_reach(r.reward, threshold) for r in runs}
    reached = [s for s in reach.values() if s is not None]
    return {
        "seeds": [r.seed for r in runs],
        "last_step": {r.seed: r.last_step for r in runs},
        "val": val,
        "reward": reward,
        "first_reach": reach,
        "first_reach_spread": spread([float(s) for s in reached]) if reached else None,
        "reached": f"{len(reached)}/{len(runs)}",
        "final_reward_last10": spread([_mean_last(r.reward, 10) for r in runs if r.reward]) if any(
            r.reward for r in runs) else None,
    }


def _mean_last(series: dict[int, float], k: int) -> float:
    steps = sorted(series)[-k:]
    return sum(series[s] for s in steps) / len(steps)


def _seed_of(folder: Path) -> int:
    name = folder.name
    if not name.startswith("seed") or not name[4:].isdigit():
        raise StudyError(f"{folder}: run folders are named seed<k> (e.g. seed0), got {name!r}")
    return int(name[4:])


def _val_freq(run_dir: Path) -> int | None:
    cfg = run_dir / "config.json"
    if not cfg.exists():
        return None
    return int(json.loads(cfg.read_text()).get("trainer", {}).get("val_freq", 0))


def load_layout(layout_dir: Path) -> list[RunCurves]:
    """Every ``seed<k>`` run under ``layout_dir`` that has metrics, sorted by seed."""
    runs = []
    for folder in sorted(layout_dir.glob("seed*"), key=lambda p: _seed_of(p)):
        if not (folder / "metrics.jsonl").exists():
            continue
        runs.append(run_curves(read_metrics(folder), _seed_of(folder), _val_freq(folder)))
    return runs


def summarise(out_dir: Path, layouts: list[str], threshold: float) -> dict:
    """Summaries of every layout folder under ``out_dir`` that holds runs, plus the runs' wall times."""
    walls = _read_walls(out_dir)
    result = {"threshold": threshold, "machine": _machine(), "layouts": {}}
    for name in layouts:
        runs = load_layout(out_dir / name)
        if not runs:
            continue
        summary = summarise_layout(runs, threshold)
        wall = [walls[f"{name}/seed{r.seed}"] for r in runs if f"{name}/seed{r.seed}" in walls]
        summary["wall_s"] = spread(wall) if wall else None
        result["layouts"][name] = summary
    if not result["layouts"]:
        raise StudyError(f"no run folders with metrics under {out_dir}/<layout>/seed<k> for layouts {layouts}; "
                         "run without --summarise-only first, or point --out-dir at the study folder")
    return result


def _fmt(sp: dict | None, digits: int = 3) -> str:
    if sp is None:
        return "—"
    if sp["min"] == sp["max"]:
        return f"{sp['median']:.{digits}f}"
    return f"{sp['median']:.{digits}f} [{sp['min']:.{digits}f}–{sp['max']:.{digits}f}]"


def markdown_table(summary: dict, max_columns: int = 7) -> str:
    """The README table: one row per layout; greedy val median [min–max] at up to ``max_columns`` val steps."""
    layouts = summary["layouts"]
    steps = sorted({s for lay in layouts.values() for s in lay["val"]})
    if len(steps) > max_columns:  # keep the first, the last and evenly spaced ones between
        idx = sorted({round(i * (len(steps) - 1) / (max_columns - 1)) for i in range(max_columns)})
        steps = [steps[i] for i in idx]
    thr = summary["threshold"]
    head = (["layout", "seeds"] + [f"val @ {s}" for s in steps]
            + [f"train reward ≥ {thr:g} first at step", "train reward, last 10 steps", "wall time / run (s)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, lay in layouts.items():
        reach = lay["first_reach_spread"]
        reach_txt = "not reached" if reach is None else (
            f"{_fmt(reach, 0)} ({lay['reached']} seeds)")
        row = [name, str(len(lay["seeds"]))] + [_fmt(lay["val"].get(s)) for s in steps] + [
            reach_txt, _fmt(lay["final_reward_last10"]), _fmt(lay["wall_s"], 0)]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append(f"Median [min–max] over seeds; val = greedy validation score (step 0 = before training). "
                 f"Machine: {summary['machine']}.")
    return "\n".join(lines) + "\n"


def plot_curves(summary: dict, path: Path) -> Path:
    """Two panels: greedy val and train reward, per layout the median line over a light min–max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, title in ((axes[0], "val", "greedy val score"), (axes[1], "reward", "train reward (mean)")):
        for name, lay in summary["layouts"].items():
            steps = sorted(lay[key])
            med = [lay[key][s]["median"] for s in steps]
            (line,) = ax.plot(steps, med, label=f"{name} (median of {len(lay['seeds'])})", linewidth=1.6, zorder=3,
                              marker="o" if key == "val" else None, markersize=4)
            ax.fill_between(steps, [lay[key][s]["min"] for s in steps], [lay[key][s]["max"] for s in steps],
                            color=line.get_color(), alpha=0.15, linewidth=0, zorder=1)
        if key == "reward":
            ax.axhline(summary["threshold"], color="grey", linestyle=":", linewidth=1.0, label="threshold")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle("median and min–max over seeds", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {NPROC} ranks"


def _walls_file(out_dir: Path) -> Path:
    return out_dir / "wall_times.json"


def _read_walls(out_dir: Path) -> dict[str, float]:
    f = _walls_file(out_dir)
    return json.loads(f.read_text()) if f.exists() else {}


def _finished(run_dir: Path, steps: int) -> bool:
    try:
        records = read_metrics(run_dir)
    except (MetricsError, OSError):
        return False
    return bool(records) and max(int(r["step"]) for r in records) >= steps


def train_command(layout: str, seed: int, steps: int, val_freq: int, run_dir: Path, config: str,
                  extra: list[str]) -> list[str]:
    """The torchrun command line of one run."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={NPROC}", str(REPO / "scripts" / "train.py"), "--config", config,
            *LAYOUTS[layout], f"trainer.total_steps={steps}", f"trainer.val_freq={val_freq}",
            f"trainer.seed={seed}", f"trainer.run_dir={run_dir}", "trainer.progress_bar=false",
            "trainer.save_freq=0", *extra]


def _ensure_task_data(config: str, out_dir: Path, overrides: list[str]) -> list[str]:
    """The task data of the config with ``overrides`` (a layout may name its own task), generated with seed 0
    under ``out_dir/data`` when absent, so every seed trains and validates on the same rows (train.py would
    otherwise generate it with the first run's trainer.seed); returns the overrides that point the runs at it
    (none for a config without a task: its files are used as they are)."""
    from rldispatch.config import load_config

    d = load_config(config, overrides).data
    if not d.task:
        return []
    folder = out_dir / "data" / d.task
    train, val = folder / "train.parquet", folder / "val.parquet"  # what write_task_data names them
    if not (train.exists() and val.exists()):
        from protocol.rollout.tasks.data import write_task_data

        write_task_data(str(folder), d.task, train=d.train_size, val=d.val_size, seed=0)
    return [f"data.train_files=[{train}]", f"data.val_files=[{val}]"]


def run_study(layouts: list[str], seeds: list[int], steps: int, val_freq: int, out_dir: Path, config: str,
              extra: list[str], rerun: bool = False) -> None:
    """Run every (layout, seed) not yet finished, one after another; record each run's wall time."""
    walls = _read_walls(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for layout in layouts:
        for seed in seeds:
            run_dir = out_dir / layout / f"seed{seed}"
            if not rerun and _finished(run_dir, steps):
                print(f"[{layout} seed {seed}] finished earlier, kept ({run_dir})", flush=True)
                continue
            if run_dir.exists():
                import shutil

                shutil.rmtree(run_dir)  # a partial or stale run: its metrics would mix with the new one's
            data = _ensure_task_data(config, out_dir, [*LAYOUTS[layout], *extra])
            cmd = train_command(layout, seed, steps, val_freq, run_dir, config, [*data, *extra])
            print(f"[{layout} seed {seed}] {shlex.join(cmd)}", flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=out_dir, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise StudyError(f"[{layout} seed {seed}] train.py exited {proc.returncode} after {wall:.0f} s; "
                                 f"last output:\n{(proc.stdout + proc.stderr)[-3000:]}")
            walls[f"{layout}/seed{seed}"] = round(wall, 1)
            _walls_file(out_dir).write_text(json.dumps(walls, indent=2, sort_keys=True))
            print(f"[{layout} seed {seed}] done in {wall:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="trainer.seed of each run")
    ap.add_argument("--steps", type=int, default=300, help="trainer.total_steps of each run")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--val-freq", type=int, default=50, help="trainer.val_freq of each run")
    ap.add_argument("--out-dir", type=Path, default=Path("runs/learning_curves"))
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="the shipped task config every run starts from")
    ap.add_argument("--reward-threshold", type=float, default=0.99, help="train reward the first-reach step is of")
    ap.add_argument("--summarise-only", action="store_true", help="summarise the runs under --out-dir, run none")
    ap.add_argument("--rerun", action="store_true", help="run again even where a finished run exists")
    ap.add_argument("--override", nargs="*", default=[], help="extra key=value overrides for every run")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.val_freq < 0:
        print(f"error: --steps must be >= 1 and --val-freq >= 0, got {args.steps} and {args.val_freq}",
              file=sys.stderr)
        return 2
    out_dir = args.out_dir if args.out_dir.is_absolute() else Path.cwd() / args.out_dir
    try:
        if not args.summarise_only:
            t0 = time.perf_counter()
            run_study(args.layouts, args.seeds, args.steps, args.val_freq, out_dir, args.config, args.override,
                      rerun=args.rerun)
            print(f"study wall time: {time.perf_counter() - t0:.0f} s", flush=True)
        summary = summarise(out_dir, args.layouts, args.reward_threshold)
    except (StudyError, MetricsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    (out_dir / "learning_curves.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    table = markdown_table(summary)
    (out_dir / "learning_curves.md").write_text(table)
    png = plot_curves(summary, out_dir / "learning_curves.png")
    print(table)
    print(f"wrote {out_dir / 'learning_curves.json'}, {out_dir / 'learning_curves.md'}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
