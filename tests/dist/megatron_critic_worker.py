"""2-rank worker: the megatron critic against the FSDP critic and a single-process ValueModel, in one launch.

The same 8 samples (one a padding sample with a full response mask and returns 1000 away) go to the FSDP critic
(DP 2) and to megatron critics with TP 2 and PP 2 (DP 1, other micro-batch splits): values equal the reference's,
two SGD steps of the clipped value loss give the same metrics and weights as the FSDP critic's. Then a critic joins
an actor's parallel state (the run's layout) and one of other degrees is refused; a checkpoint taken after two AdamW
steps (distributed optimizer, DP 2) resumes exactly. Prints ``OK <check>`` lines.
"""
from __future__ import annotations

import math
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_common import (  # noqa: E402
    MODEL, MegatronConfig, OptimConfig, gather_outputs, make_samples, share_of, topology,
)

from backends.config import EngineConfig, FSDPConfig, ValueLossConfig  # noqa: E402
from backends.megatron.critic import MegatronCriticEngine  # noqa: E402
from backends.megatron.engine import MegatronEngine, TopologyMismatch  # noqa: E402
from backends.model.critic import ValueModel  # noqa: E402
from protocol.batch.nested import to_nested  # noqa: E402

N, SEED, PAD = 8, 3, 5
# fp32 values through two decoder layers in other summation orders (TP-split matmuls, padded vs packed attention):
# each dot product of n <= 64 terms is exact to n * 2^-24 of its absolute sum, a few 1e-6 on values of order 1
VALUE_TOL = 2e-5
SGD_TOL = 2e-6  # parameters after SGD: lr (0.5) x the gradients' float noise (~1e-6 relative on norms ~1)
METRIC_RTOL = 1e-5


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def critic_data():
    """``make_samples`` with the critic's fields: old values near the initial critic's, random returns; sample
    ``PAD`` is a padding sample whose mask is full and whose returns are 1000 away, which must move nothing."""
    data = make_samples(N, 0, with_train=False)
    g = torch.Generator().manual_seed(11)
    plain = ValueModel.from_seed(MODEL, SEED)
    ids, masks = list(data["input_ids"].unbind()), list(data["response_mask"].unbind())
    values, returns, ref = [], [], []
    for i, (x, m) in enumerate(zip(ids, masks)):
        r, L = m.numel(), x.numel()
        with torch.no_grad():
            v = plain(x, torch.arange(L), torch.tensor([0, L], dtype=torch.int32))[L - r - 1:L - 1]
        ref.append(v)
        values.append(v + 0.3 * torch.randn(r, generator=g))
        returns.append(torch.randn(r, generator=g) + (1000.0 if i == PAD else 0.0))
        if i == PAD:
            masks[i] = torch.ones_like(m)
    data["response_mask"] = to_nested(masks)
    data["values"] = to_nested(values)
    data["returns"] = to_nested(returns)
    data["is_padding"] = torch.tensor([i == PAD for i in range(N)])
    return data, [v * m for v, m in zip(ref, masks)]


def gather_values(out, pos: list[int]) -> list[torch.Tensor]:
    return gather_outputs(out, pos, N, key="values")


def max_diff(a: list | dict, b: list | dict) -> float:
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
        a, b = [a[k] for k in sorted(a)], [b[k] for k in sorted(a)]
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def config(optim: OptimConfig, par: MegatronConfig | None = None) -> EngineConfig:
    return EngineConfig(model=MODEL, optim=optim, megatron=par or MegatronConfig(), fsdp=FSDPConfig(),
                        value_loss=ValueLossConfig(cliprange_value=0.2), seed=SEED)


def run(eng, topo, data, k: int, steps: int = 2):
    """Values, then ``steps`` updates on this replica's samples (``k`` micro-batches); metrics and weights."""
    dp, size = topo.dp_rank(dist.get_rank()), topo.dp_size
    pos = list(range(dp, N, size))
    values = gather_values(eng.infer_batch(share_of(data, pos, k)), pos)
    metrics = [eng.train_batch(share_of(data, pos, k)) for _ in range(steps)]
    return values, metrics, eng.get_weights()


def main() -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    assert dist.get_world_size() == 2
    from backends.fsdp.critic import FSDPCriticEngine
    from dispatch.topology import Topology

    data, ref_values = critic_data()
    sgd = OptimConfig(name="sgd", lr=0.5, clip_grad=0.5)
    fsdp_topo = Topology.from_config({"backend": "fsdp", "ulysses_sp": 1, "fsdp_size": -1}, 2)
    fsdp = FSDPCriticEngine(config(sgd), fsdp_topo)
    f_values, f_metrics, f_weights = run(fsdp, fsdp_topo, data, 1)
    del fsdp
    d = max_diff(f_values, ref_values)
    assert d < VALUE_TOL, d
    assert f_metrics[0]["seqs"] == N - 1 and f_metrics[0]["grad_norm"] > sgd.clip_grad, f_metrics[0]
    assert f_metrics[1]["vf_clipfrac"] > 0, f_metrics[1]  # the second step's predictions moved past the clip
    log(f"OK fsdp critic values == ValueModel max|diff|={d:.2e}")

    for tp, pp, k in ((2, 1, 2), (1, 2, 3)):
        par = MegatronConfig(tp=tp, pp=pp, use_distributed_optimizer=False)
        topo = topology(par, 2)
        eng = MegatronCriticEngine(config(sgd, par), topo)
        try:
            start = eng.get_weights()
            assert max_diff(start, dict(ValueModel.from_seed(MODEL, SEED).state_dict())) == 0.0
            values, metrics, weights = run(eng, topo, data, k)
        finally:
            eng.close()
        dv = max_diff(values, f_values)
        assert dv < VALUE_TOL, dv
        for got, want in zip(metrics, f_metrics):
            for key in ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm", "lr", "tokens", "seqs"):
                assert math.isclose(got[key], want[key], rel_tol=METRIC_RTOL, abs_tol=1e-7), (key, got, want)
        dw = max_diff(weights, f_weights)
        assert dw < SGD_TOL, dw
        log(f"OK megatron critic tp={tp} pp={pp} == fsdp critic: values max|diff|={dv:.2e}, two SGD steps "
            f"weights max|diff|={dw:.2e}, vf_loss {metrics[0]['vf_loss']:.6f} -> {metrics[1]['vf_loss']:.6f}")

    # beside an actor: the critic joins its parallel state; other degrees are refused; the actor is undisturbed
    par = MegatronConfig(tp=2, use_distributed_optimizer=False)
    topo = topology(par, 2)
    actor = MegatronEngine(config(sgd, par), topo)
    try:
        before = actor.get_weights()
        critic = MegatronCriticEngine(config(sgd, par), topo)
        values, _, _ = run(critic, topo, data, 2, steps=1)
        assert max_diff(values, f_values) < VALUE_TOL
        assert max_diff(actor.get_weights(), before) == 0.0
        critic.close()
        other = MegatronConfig(pp=2, use_distributed_optimizer=False)
        try:
            MegatronCriticEngine(config(sgd, other), topology(other, 2))
            raise AssertionError("a critic of other parallel degrees joined the actor's parallel state")
        except TopologyMismatch as exc:
            assert "joins this process's megatron-core parallel state" in str(exc), exc
    finally:
        actor.close()
    log("OK critic joins the actor's parallel state; other degrees refused")
    checkpoint_case(data)


def checkpoint_case(data) -> None:
    """AdamW with the distributed optimizer over DP 2: two steps, save, a third step; a fresh critic that loads the
    checkpoint takes the same third step exactly (Adam's moments and step counts restored)."""
    import shutil
    import tempfile

    par = MegatronConfig(tp=1, use_distributed_optimizer=True)
    topo = topology(par, 2)
    adam = OptimConfig(name="adamw", lr=1e-2, eps=1e-3, clip_grad=1e6, warmup_steps=3)
    pos = list(range(topo.dp_rank(dist.get_rank()), N, topo.dp_size))
    holder = [tempfile.mkdtemp(prefix="megatron_critic_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder)
    try:
        eng = MegatronCriticEngine(config(adam, par), topo)
        try:
            for _ in range(2):
                eng.train_batch(share_of(data, pos, 2))
            eng.save_checkpoint(holder[0], {"step": 2})
            cont = eng.train_batch(share_of(data, pos, 2))
            w_cont = eng.get_weights()
        finally:
            eng.close()
        eng = MegatronCriticEngine(config(adam, par), topo)
        try:
            assert eng.load_checkpoint(holder[0]) == {"step": 2}
            res = eng.train_batch(share_of(data, pos, 2))
            w_res = eng.get_weights()
        finally:
            eng.close()
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(holder[0], ignore_errors=True)
    for key in ("vf_loss", "grad_norm", "lr", "global_step"):
        assert res[key] == cont[key], (key, res, cont)
    d = max_diff(w_res, w_cont)
    assert d == 0.0, d
    log("OK critic checkpoint dp=2 dist_opt adamw: resume after 2 steps == uninterrupted")


if __name__ == "__main__":
    from worker_exit import run_worker

    run_worker(main)
