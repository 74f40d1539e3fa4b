"""The step's non-model stages touch jagged tensors per field, never per sample (no timing: operations are counted).

``nt[i]`` or ``nt.select(0, i)`` on a jagged nested tensor unbinds the whole tensor, so a loop over the samples
doing either is quadratic in the batch; so is ``nt.unbind()`` inside a per-sample loop. The counter below sees every
such call the step's code makes on a nested tensor (a torch function mode sees the outermost call only, not the
calls the nested tensor makes internally), and each stage's count must not grow with the batch.
"""
from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from protocol.batch.nested import to_nested

REPO = Path(__file__).resolve().parents[2]

#: torch functions that take one sample (or all of them) out of a nested tensor
PER_SAMPLE_OPS = {torch.Tensor.unbind: "unbind", torch.unbind: "unbind", torch.Tensor.__getitem__: "getitem",
                  torch.Tensor.select: "select", torch.select: "select", torch.Tensor.narrow: "narrow"}


class NestedSampleOps(TorchFunctionMode):
    """Counts the calls of :data:`PER_SAMPLE_OPS` whose tensor argument is nested, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = PER_SAMPLE_OPS.get(func)
        if name is not None and args and isinstance(args[0], torch.Tensor) and args[0].is_nested:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_step_overhead", REPO / "scripts" / "bench_step_overhead.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A gloo process group of one rank (the stages reduce their metrics across ranks)."""
    if dist.is_initialized():
        yield
        return
    path = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_counter_sees_a_per_sample_loop():
    """A loop that indexes a jagged tensor per sample counts once per sample, so the test below can fail."""
    nt = to_nested([torch.arange(i + 1) for i in range(7)])
    with NestedSampleOps() as ops:
        rows = [nt[i] for i in range(7)]
        nt.unbind()
    assert [r.numel() for r in rows] == list(range(1, 8))
    assert ops.counts == {"getitem": 7, "unbind": 1}


def _stage_counts(bench, size: int, work: Path) -> dict[str, Counter]:
    """Per stage of the second step (the first warms up): per-sample ops on nested tensors."""
    t = bench.build_trainer(size, 0, 1, work)
    bench.one_step(t, 0)
    counts: dict[str, Counter] = {}
    with NestedSampleOps() as ops:
        def on_stage(name: str) -> None:
            ops.counts = counts.setdefault(name, Counter())
        bench.one_step(t, 1, on_stage=on_stage)
    t.metrics.close()
    return counts


def test_nested_sample_ops_per_stage_do_not_grow_with_the_batch(one_rank, tmp_path):
    bench = _bench()
    small = _stage_counts(bench, 64, tmp_path / "small")
    large = _stage_counts(bench, 256, tmp_path / "large")
    assert set(small) >= set(bench.STAGES) - {"rollout_put"}, small
    for name in bench.STAGES:
        if name == "rollout_put":
            continue  # one put per prompt group: O(groups) by design, checked below
        assert large[name] == small[name], (
            f"stage {name!r}: per-sample ops on nested tensors grew from {dict(small[name])} at 64 trajectories to "
            f"{dict(large[name])} at 256; index or unbind a jagged field once per field, not once per sample")
    # the rollout writes each group with one put: per group, a constant number of such ops (none per sample)
    groups_small, groups_large = 64 // bench.ROLLOUT_N, 256 // bench.ROLLOUT_N
    per_group_small = {k: v / groups_small for k, v in small["rollout_put"].items()}
    per_group_large = {k: v / groups_large for k, v in large["rollout_put"].items()}
    assert per_group_small == per_group_large, (small["rollout_put"], large["rollout_put"])


def test_overhead_fraction_counts_the_non_model_stages_only():
    """(sample + plan + reward + advantage + clear) / step; model stages and the step total are left out."""
    from rldispatch.metrics import MODEL_STAGES, overhead_fraction

    times = {f"timing_s/{s}": 1.0 for s in MODEL_STAGES}
    times.update({"timing_s/sample": 0.5, "timing_s/plan": 0.25, "timing_s/reward": 0.125,
                  "timing_s/advantage": 0.0625, "timing_s/clear": 0.0625, "timing_s/step": 6.0})
    assert overhead_fraction(times, 6.0) == pytest.approx(1.0 / 6.0)
    assert overhead_fraction({"timing_s/update": 2.0}, 2.0) == 0.0
    assert overhead_fraction(times, 0.0) == 0.0


def test_the_collectives_of_each_stage_do_not_grow_with_the_batch(torchrun, tmp_path):
    """2 gloo ranks, a real step at 64 and 256 trajectories: each stage starts the same collectives at both sizes,
    and the planned fetches and the reward add none of their own (no request goes out: every rank knows every rank's
    share from the replicated plan; the scores' locations travel with the next stage's sync, the advantage's need
    none). Counts, not times."""
    import json

    torchrun("rldispatch_step_rounds_worker.py", 2, str(tmp_path))
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"rounds{rank}.json").read_text())
        small, large = counts["64"], counts["256"]
        assert small == large, (rank, small, large)
        assert "reward" not in small, small  # scoring and its metrics are local; its sync rides on the next one
        # the infer inputs' fetch: values only (one batch of point-to-point messages), no request gather
        assert small["dispatch"] == {"batch_isend_irecv": 1}, small
        # the KL reads old log-probs the scoring rank holds here (the bench writes them there, as a recompute
        # would): a planned fetch of held values communicates not at all
        assert "kl" not in small, small
        # the advantage: the log-probs for the KL penalty come in one exchange; where it wrote, every rank knows
        # (each rank's own groups), so no sync follows
        assert small["advantage"] == {"batch_isend_irecv": 1}, small
