"""The plot subcommand: stage times ranked by size with the rest folded into "other", integer step ticks, and a
min/max band lighter than its median line."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rldispatch.commands.plot import BAND_ALPHA, MAX_STAGES, STAGE_PANEL, STAGE_TOTAL, _median, rank_stages, render
from rldispatch.metrics import MetricsLogger

pytest.importorskip("matplotlib")

value = st.one_of(st.floats(0.0, 100.0), st.just(math.nan))


@st.composite
def stage_tables(draw):
    n_steps = draw(st.integers(1, 6))
    n_stages = draw(st.integers(1, 12))
    values = {f"timing_s/s{i:02d}": draw(st.lists(value, min_size=n_steps, max_size=n_steps)) for i in range(n_stages)}
    values[STAGE_TOTAL] = [1e6] * n_steps  # the total: never ranked among the stages
    return values, draw(st.integers(2, 9))


def _nan0(x: float) -> float:
    return 0.0 if math.isnan(x) else x


@settings(max_examples=200)
@given(stage_tables())
def test_rank_stages_orders_by_median_and_keeps_the_sum(table):
    values, top = table
    stages = [k for k in values if k != STAGE_TOTAL]
    out = rank_stages(values, list(values), top=top)
    labels = [label for label, _ in out]
    assert STAGE_TOTAL not in labels
    assert len(out) == min(len(stages), top)
    named = [label for label in labels if not label.startswith("other")]
    folded = [k for k in stages if k not in named]
    assert (len(folded) > 0) == (len(stages) > top) and sorted(named + folded) == sorted(stages)
    if folded:
        assert labels[-1] == f"other ({len(folded)})"
    key = [(-_median(values[k]) if not math.isnan(_median(values[k])) else math.inf) for k in named]
    assert key == sorted(key)  # largest median first; stages never present go last
    worst_named = max(key, default=-math.inf)
    assert all((-_median(values[k]) if not math.isnan(_median(values[k])) else math.inf) >= worst_named
               for k in folded)
    for i in range(len(values[STAGE_TOTAL])):
        # every stage is drawn once, by name or inside "other": the drawn lines add up to all stages
        drawn = sum(_nan0(ys[i]) for _, ys in out)
        want = sum(_nan0(values[k][i]) for k in stages)
        # summation order differs: error <= (number of terms) x ulp of the largest partial sum
        assert math.isclose(drawn, want, rel_tol=0, abs_tol=len(stages) * 2.0 ** -52 * max(want, 1.0) * 4)


def test_rank_stages_refuses_a_top_without_room_for_other():
    with pytest.raises(ValueError, match="top must be >= 2"):
        rank_stages({"timing_s/a": [1.0]}, ["timing_s/a"], top=1)


def _write_run(path, steps: int = 7) -> dict[str, float]:
    """A run with 11 stages of fixed sizes plus the step total, and reward mean/min/max."""
    sizes = {f"timing_s/stage{i:02d}": 0.1 * (i + 1) for i in range(11)}
    sizes["timing_s/update"] = 5.0  # the largest, and alphabetically late: it must still come first
    with MetricsLogger(path) as log:
        for s in range(1, steps + 1):
            log.log(s, {**sizes, STAGE_TOTAL: sum(sizes.values()) + 0.5, "reward/score/mean": s / 10,
                        "reward/score/min": 0.0, "reward/score/max": 1.0})
    return sizes


def test_stage_panel_draws_the_largest_first_then_other_then_the_total(tmp_path):
    sizes = _write_run(tmp_path / "run")
    fig, panels = render(tmp_path / "run")
    ranked = sorted(sizes, key=lambda k: -sizes[k])
    assert panels[STAGE_PANEL] == ranked + [STAGE_TOTAL]
    ax = next(a for a in fig.axes if a.get_title() == STAGE_PANEL)
    labels = [line.get_label() for line in ax.get_lines()]
    named = [k.removeprefix("timing_s/") for k in ranked[: MAX_STAGES - 1]]
    assert labels == named + [f"other ({len(sizes) - MAX_STAGES + 1})", "step (total)"]
    other = ax.get_lines()[MAX_STAGES - 1].get_ydata()
    assert other[0] == pytest.approx(sum(sorted(sizes.values())[: len(sizes) - MAX_STAGES + 1]))


def test_step_ticks_are_integers_and_the_band_is_lighter_than_its_line(tmp_path):
    _write_run(tmp_path / "run", steps=3)  # three steps: matplotlib's default locator would put ticks at 1.5, 2.5
    fig, _ = render(tmp_path / "run")
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    ax = next(a for a in fig.axes if a.get_title() == "reward")
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == "reward/score/mean"]
    (band,) = ax.collections
    assert band.get_alpha() == BAND_ALPHA < (line.get_alpha() or 1.0)
    assert tuple(band.get_facecolor()[0][:3]) == pytest.approx(__import__("matplotlib.colors").colors.to_rgb(
        line.get_color()))
    assert line.get_zorder() > band.get_zorder()
