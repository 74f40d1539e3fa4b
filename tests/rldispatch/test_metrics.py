"""Padding-aware metric reductions, the stage timer and the JSONL metrics logger."""
from __future__ import annotations

import importlib
import json
import math
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from rldispatch.metrics import (
    MetricsError, MetricsLogger, StepStats, Timer, _combine_moments, _local_moments, length_stats, masked_stats,
    read_metrics, sample_lengths, to_float_dict,
)

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@settings(max_examples=150, deadline=None)
@given(data=st.lists(st.tuples(finite, st.booleans()), min_size=1, max_size=40))
def test_masked_stats_excludes_padding(data):
    values = [v for v, _ in data]
    pad = [p for _, p in data]
    kept = [v for v, p in data if not p]
    if not kept:
        with pytest.raises(MetricsError, match="every one of the"):
            masked_stats(values, pad, "reward")
        return
    out = masked_stats(values, pad, "reward")
    assert set(out) == {"reward/mean", "reward/std", "reward/min", "reward/max"}
    assert out["reward/mean"] == pytest.approx(float(np.mean(kept)), rel=1e-9, abs=1e-6)
    assert out["reward/std"] == pytest.approx(float(np.std(kept)), rel=1e-6, abs=1e-4)
    assert out["reward/min"] == min(kept) and out["reward/max"] == max(kept)
    # padding values, however extreme, change nothing
    poisoned = [1e30 if p else v for v, p in data]
    assert masked_stats(poisoned, pad, "reward") == out


@settings(max_examples=150, deadline=None)
@given(data=st.lists(st.tuples(finite, st.booleans()), min_size=1, max_size=40),
       cuts=st.lists(st.integers(0, 40), max_size=4))
def test_combined_moments_of_any_split_equal_the_union(data, cuts):
    """Ranks' shares combined by Chan's formula give masked_stats of all the samples, however they are split (empty
    and all-padding shares included). Both sides sum n <= 40 terms of magnitude <= M = max|x| (squares <= M^2) in
    float64, so each differs from the exact value by at most ~n * eps times that: min/max are exact, the mean within
    4 n eps M and the variance within 16 n eps M^2."""
    values = [v for v, _ in data]
    pad = [p for _, p in data]
    bounds = [0, *sorted(min(c, len(data)) for c in cuts), len(data)]
    shares = [_local_moments(values[a:b], pad[a:b], "r") for a, b in zip(bounds, bounds[1:])]
    if all(p for p in pad):
        with pytest.raises(MetricsError, match=f"all {len(shares)} ranks"):
            _combine_moments(shares, "r")
        return
    got, want = _combine_moments(shares, "r"), masked_stats(values, pad, "r")
    n, big = len(data), max(abs(v) for v in values)
    eps = np.finfo(np.float64).eps
    assert got["r/min"] == want["r/min"] and got["r/max"] == want["r/max"]
    assert abs(got["r/mean"] - want["r/mean"]) <= 4 * n * eps * big
    assert abs(got["r/std"] ** 2 - want["r/std"] ** 2) <= 16 * n * eps * big ** 2


def test_step_stats_without_a_process_group_reduce_this_process():
    """Outside torch.distributed a step's metrics are this process's own: the same as masked_stats and plain sums;
    a name recorded twice in one step is an error."""
    s = StepStats()
    s.masked("r", [1.0, 2.0, 9.0], [False, False, True])
    s.masked("e", [4.0, 6.0], keep=("mean",))
    s.sum("n", 3.0)
    s.per_rank("bytes", 7.0)
    assert s.reduce() == {**masked_stats([1.0, 2.0, 9.0], [False, False, True], "r"), "e/mean": 5.0, "n": 3.0,
                          "bytes/rank0": 7.0, "bytes/max": 7.0}
    with pytest.raises(MetricsError, match="n: recorded twice"):
        s.sum("n", 1.0)
    with pytest.raises(MetricsError, match="r: recorded twice"):
        s.masked("r", [1.0])


def test_masked_stats_edges():
    assert masked_stats(torch.tensor([2.0]), None, "x") == {"x/mean": 2.0, "x/std": 0.0, "x/min": 2.0, "x/max": 2.0}
    with pytest.raises(MetricsError, match="x: every one of the 0 samples"):
        masked_stats([], None, "x")
    with pytest.raises(MetricsError, match="1-D"):
        masked_stats(torch.zeros(2, 2), None, "x")
    with pytest.raises(MetricsError, match="one entry per sample"):
        masked_stats([1.0, 2.0], [False], "x")


def test_sample_lengths_and_length_stats():
    mask = torch.nested.nested_tensor([torch.tensor([1, 1, 0]), torch.tensor([0, 1]), torch.tensor([0, 0, 0, 0])],
                                      layout=torch.jagged)
    rl, pl = sample_lengths(mask)
    assert rl.tolist() == [3, 2, 4] and pl.tolist() == [2, 1, 0]
    out = length_stats(rl, pl, torch.tensor([False, False, True]))
    assert out["response_length/mean"] == 2.5 and out["response_length/max"] == 3
    assert out["policy_length/mean"] == 1.5 and out["policy_length/min"] == 1
    with pytest.raises(MetricsError, match="jagged"):
        sample_lengths(torch.ones(2, 3))
    with pytest.raises(MetricsError, match="expected a tensor"):
        sample_lengths([1, 0])


def test_to_float_dict_unwraps_and_rejects():
    out = to_float_dict({"a": torch.tensor(1.5), "b": np.float32(2.0), "c": 3, "d": float("nan"),
                         "e": torch.tensor([4.0])})
    assert out == {"a": 1.5, "b": 2.0, "c": 3.0, "d": None, "e": 4.0}
    assert all(type(v) is float for k, v in out.items() if v is not None)
    with pytest.raises(MetricsError, match="metric 'bad': expected a scalar"):
        to_float_dict({"bad": torch.zeros(3)})
    with pytest.raises(MetricsError, match="metric 's': expected a number, got str"):
        to_float_dict({"s": "1.0"})
    with pytest.raises(MetricsError, match="metric 'flag'"):
        to_float_dict({"flag": True})


def test_timer_accumulates():
    times: dict = {}
    with Timer("gen", times) as t:
        time.sleep(0.01)
    assert t.elapsed >= 0.01 and times["timing_s/gen"] == t.elapsed
    with Timer("gen", times):
        pass
    assert times["timing_s/gen"] >= t.elapsed
    with Timer("solo") as t2:
        pass
    assert t2.elapsed >= 0.0


def test_logger_writes_jsonl(tmp_path):
    with MetricsLogger(tmp_path / "run", enabled_on_this_rank=True) as log:
        rec = log.log(1, {"reward/mean": torch.tensor(0.5), "loss": 1})
        log.log(2, {"reward/mean": 0.75, "kl": float("inf")})
        assert rec == {"step": 1, "reward/mean": 0.5, "loss": 1.0}
        with pytest.raises(MetricsError, match="'step' key"):
            log.log(3, {"step": 3})
        with pytest.raises(MetricsError, match="step must be an integer"):
            log.log(-1, {})
    try:
        importlib.import_module("torch.utils.tensorboard")
        tb = True
    except ImportError:
        tb = False
    assert log.tensorboard_enabled is False  # closed
    assert (tmp_path / "run" / "tb").exists() == tb  # mirrored to TensorBoard exactly when it is importable
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    recs = read_metrics(tmp_path / "run")
    assert recs[1] == {"step": 2, "reward/mean": 0.75, "kl": None}
    with pytest.raises(MetricsError, match="closed"):
        log.log(4, {})
    # appending on resume keeps the earlier steps
    with MetricsLogger(tmp_path / "run") as log2:
        log2.log(3, {"x": 1.0})
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


def test_logger_disabled_rank_writes_nothing(tmp_path):
    log = MetricsLogger(tmp_path / "r1", enabled_on_this_rank=False)
    assert log.log(1, {"a": 1.0}) is None
    log.close()
    assert not (tmp_path / "r1").exists()
    with pytest.raises(MetricsError, match="expected a number"):  # bad values fail on every rank alike
        log.log(1, {"a": "x"})


def test_read_metrics_errors(tmp_path):
    with pytest.raises(MetricsError, match="no metrics file"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"x": 1}\n')
    with pytest.raises(MetricsError, match="'step' key"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    with pytest.raises(MetricsError, match="not a JSON object"):
        read_metrics(tmp_path)


@pytest.mark.dist
def test_distributed_masked_stats_matches_single_process(torchrun):
    out = torchrun("rldispatch_metrics_worker.py", 2)
    assert out.count("OK") == 2, out


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 40), parts=st.integers(1, 4), noise=st.floats(0.0, 2.0))
def test_explained_variance_from_summed_parts_equals_the_reference_formula(seed, n, parts, noise):
    """The reference system's ``1 - var(returns - values) / (var(returns) + 1e-5)`` (torch.var, unbiased) over all
    tokens equals the value from each holder's sums, added up."""
    from rldispatch.metrics import explained_variance

    g = torch.Generator().manual_seed(seed)
    returns = torch.randn(n, generator=g, dtype=torch.float64) + 0.3
    values = returns + noise * torch.randn(n, generator=g, dtype=torch.float64)
    want = 1.0 - torch.var(returns - values) / (torch.var(returns) + 1e-5)
    owner = torch.randint(0, parts, (n,), generator=g)
    sums = [0.0] * 5
    for p in range(parts):
        r, d = returns[owner == p], (returns - values)[owner == p]
        for i, x in enumerate((r.numel(), r.sum(), (r * r).sum(), d.sum(), (d * d).sum())):
            sums[i] += float(x)
    assert explained_variance(*sums) == pytest.approx(float(want), rel=1e-9, abs=1e-9)


def test_explained_variance_edges():
    from rldispatch.metrics import explained_variance

    assert math.isnan(explained_variance(1, 1.0, 1.0, 0.0, 0.0))
    assert explained_variance(4, 0.0, 4.0, 0.0, 4.0) == pytest.approx(1 - 4 / 3 / (4 / 3 + 1e-5))
