"""4-rank worker: megatron engine log-prob / update / checkpoint parity with the reference model and the FSDP engine.

Runs, one after another in one launch (parallel state re-created for each): TP2 x DP2, PP2 x DP2, TP2 x PP2,
PP2 x VPP2 x DP2 (log-probs vs the single-process reference and the FSDP engine; the dispatch layer's rank map vs
megatron-core's parallel state), SGD updates for TP2 x PP2 and PP2 x VPP2, AdamW with the distributed optimizer
for TP2 x DP2, and save -> load -> next step for TP2 x PP2. Prints one ``OK <check>`` line per passed check.
"""
from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_common import (  # noqa: E402
    MODEL, LlamaModel, MegatronConfig, OptimConfig, engine_config, gather_outputs, make_samples, positions,
    reference_logprobs, reference_step, share_of, topology,
)

from backends.config import EngineConfig, FSDPConfig, PolicyLossConfig  # noqa: E402
from backends.megatron.batch import ShareError  # noqa: E402
from backends.megatron.engine import MegatronEngine, parallel_coords  # noqa: E402
from protocol.batch.nested import to_nested  # noqa: E402

N = 8
LOGPROB_TOL = 2e-5  # fp32, different summation orders (TP-split matmuls, masked vs varlen attention)
SGD_TOL = 2e-6  # one SGD step: parameter error = lr x gradient float noise
ADAM_TOL = 2e-4  # AdamW eps = 1e-3 keeps |update| <= lr; noise in near-zero grads moves it by << lr = 1e-2


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def check_rank_map(topo) -> None:
    mine = parallel_coords()
    coords: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(coords, mine)
    for rank, got in enumerate(coords):
        want = topo.coords(rank)
        assert got["dp"] == topo.dp_rank(rank) and got["tp"] == want["tp"] and got["pp"] == want["pp"], (rank, got,
                                                                                                          want)
        assert got["dp_size"] == topo.dp_size


def infer_case(par: MegatronConfig, data, ref_lp, ref_ent, fsdp_lp) -> None:
    world = dist.get_world_size()
    topo = topology(par, world)
    eng = MegatronEngine(engine_config(par), topo)
    try:
        check_rank_map(topo)
        pos = positions(topo, N)
        k = 2 if par.vpp > 1 else 3
        out = eng.infer_batch(share_of(data, pos, k), with_entropy=True)
        assert (out is not None) == topo.is_reporting(dist.get_rank()) == eng.is_reporting_rank
        if out is not None:
            for p, lp, ent in zip(pos, out["log_probs"].unbind(), out["entropy"].unbind()):
                assert torch.allclose(lp, ref_lp[p], atol=LOGPROB_TOL, rtol=0), (p, lp, ref_lp[p])
                assert torch.allclose(ent, ref_ent[p], atol=LOGPROB_TOL, rtol=0)
        full = gather_outputs(out, pos, N)
        d = max(float((a - b).abs().max()) for a, b in zip(full, fsdp_lp))
        assert d < LOGPROB_TOL, d
        eng.config.max_token_len_per_gpu = 5  # every sample here is longer: the budget check names it
        try:
            eng.infer_batch(share_of(data, pos, k))
        except ShareError as exc:
            assert "max_token_len_per_gpu = 5" in str(exc), exc
        else:
            raise AssertionError("a micro-batch over max_token_len_per_gpu was accepted")
        eng.config.max_token_len_per_gpu = None
        if par.vpp > 1:  # the interleaved schedule needs a micro-batch count that is a multiple of pp
            try:
                eng.infer_batch(share_of(data, pos, 3))
            except ShareError as exc:
                assert "multiple of megatron.pp" in str(exc), exc
            else:
                raise AssertionError("3 micro-batches with pp=2, vpp=2 were accepted")
        hot = eng.infer_batch(share_of(data, pos, k), temperature=0.7)
        if hot is not None:
            ref_hot, _ = reference_logprobs(LlamaModel.from_seed(MODEL, 3), data, temperature=0.7, with_entropy=False)
            for p, lp in zip(pos, hot["log_probs"].unbind()):
                assert torch.allclose(lp, ref_hot[p], atol=LOGPROB_TOL, rtol=0)
        log(f"OK infer tp={par.tp} pp={par.pp} vpp={par.vpp} dp={topo.dp_size} max|megatron-fsdp|={d:.2e}")
    finally:
        eng.close()


def fsdp_train(optim: OptimConfig, data, steps: int = 2, loss: PolicyLossConfig | None = None
               ) -> tuple[list[float], dict]:
    """Losses and final weights of ``steps`` FSDP-engine updates on ``data`` (DP over all 4 ranks)."""
    from backends.fsdp.engine import FSDPEngine
    from dispatch.topology import Topology

    topo = Topology.from_config({"backend": "fsdp", "ulysses_sp": 1, "fsdp_size": -1}, dist.get_world_size())
    eng = FSDPEngine(EngineConfig(model=MODEL, fsdp=FSDPConfig(), optim=optim, seed=3,
                                  loss=loss or PolicyLossConfig()), topo)
    pos = positions(topo, N)
    losses = [eng.train_batch(share_of(data, pos, 1))["loss"] for _ in range(steps)]
    return losses, eng.get_weights()


def train_case(par: MegatronConfig, optim: OptimConfig, data, tol: float, fsdp: tuple | None = None,
               steps: int = 2, loss: PolicyLossConfig | None = None) -> None:
    world = dist.get_world_size()
    topo = topology(par, world)
    eng = MegatronEngine(engine_config(par, optim=optim, loss=loss or PolicyLossConfig()), topo)
    try:
        pos = positions(topo, N)
        k = 2
        metrics = [eng.train_batch(share_of(data, pos, k)) for _ in range(steps)]
        weights = eng.get_weights()
        d = float("nan")
        if loss is None:  # the plain-torch reference implements the default policy loss only
            ref = LlamaModel.from_seed(MODEL, 3)
            losses, norms = reference_step(ref, data, optim, steps=steps)
            for m, ref_loss, norm in zip(metrics, losses, norms):
                assert abs(m["loss"] - ref_loss) < 1e-5, (m["loss"], ref_loss)
                assert abs(m["grad_norm"] - norm) < 1e-4 * max(1.0, norm), (m["grad_norm"], norm)
            d = max_diff(weights, ref.state_dict())
            assert d < tol, d
        for m in metrics:
            assert m["skipped"] == 0.0 and m["tokens"] > 0
        msg = ""
        if fsdp is not None:
            f_losses, f_weights = fsdp
            assert all(abs(m["loss"] - fl) < 1e-5 for m, fl in zip(metrics, f_losses)), (metrics, f_losses)
            df = max_diff(weights, f_weights)
            assert df < tol, df
            msg = f" max|param-fsdp|={df:.2e}"
        log(f"OK train tp={par.tp} pp={par.pp} vpp={par.vpp} dp={topo.dp_size} "
            f"dist_opt={par.use_distributed_optimizer} {optim.name} max|param-ref|={d:.2e}{msg}"
            + (f" loss={loss.loss_agg_mode}+entropy+kl" if loss is not None else ""))
    finally:
        eng.close()


def tied_case(data) -> None:
    """Tied embeddings split over pipeline stages: the last stage's output copy stays equal to the embedding."""
    import dataclasses

    model = dataclasses.replace(MODEL, tie_word_embeddings=True)
    par = MegatronConfig(tp=2, pp=2, use_distributed_optimizer=False)
    sgd = OptimConfig(name="sgd", lr=0.5, clip_grad=1e6)
    topo = topology(par, dist.get_world_size())
    eng = MegatronEngine(engine_config(par, model=model, optim=sgd), topo)
    try:
        ref = LlamaModel.from_seed(model, 3)
        ref_lp, _ = reference_logprobs(ref, data, with_entropy=False)
        pos = positions(topo, N)
        out = eng.infer_batch(share_of(data, pos, 2))
        if out is not None:
            for p, lp in zip(pos, out["log_probs"].unbind()):
                assert torch.allclose(lp, ref_lp[p], atol=LOGPROB_TOL, rtol=0)
        m = eng.train_batch(share_of(data, pos, 2))
        losses, _ = reference_step(ref, data, sgd, steps=1)
        assert abs(m["loss"] - losses[0]) < 1e-5, (m["loss"], losses)
        w = eng.get_weights()
        assert "lm_head.weight" not in w
        d = max_diff(w, ref.state_dict())
        assert d < SGD_TOL, d
        # a non-finite gradient norm skips the step and keeps the parameters
        bad = data.clone()
        adv = [a.clone() for a in bad["advantages"].unbind()]
        adv[0][0] = float("nan")
        bad["advantages"] = to_nested(adv)
        m = eng.train_batch(share_of(bad, pos, 2))
        assert m["skipped"] == 1.0 and not math.isfinite(m["grad_norm"]), m
        assert max_diff(eng.get_weights(), w) == 0.0
        log(f"OK tied tp=2 pp=2 max|param-ref|={d:.2e}; non-finite grad norm skipped")
    finally:
        eng.close()


def checkpoint_case(par: MegatronConfig, optim: OptimConfig, data, path: str) -> None:
    world = dist.get_world_size()
    topo = topology(par, world)
    pos = positions(topo, N)
    eng = MegatronEngine(engine_config(par, optim=optim), topo)
    try:
        for _ in range(2):  # after two steps: Adam's step counts must come back as 2, not as the first step's 1
            eng.train_batch(share_of(data, pos, 2))
        eng.save_checkpoint(path, {"global_steps": 1})
        m_cont = eng.train_batch(share_of(data, pos, 2))
        w_cont = eng.get_weights()
    finally:
        eng.close()
    eng = MegatronEngine(engine_config(par, optim=optim), topo)
    try:
        extra = eng.load_checkpoint(path)
        assert extra == {"global_steps": 1}, extra
        m_res = eng.train_batch(share_of(data, pos, 2))
        w_res = eng.get_weights()
    finally:
        eng.close()
    assert m_res["loss"] == m_cont["loss"] and m_res["lr"] == m_cont["lr"], (m_res, m_cont)
    d = max_diff(w_res, w_cont)
    assert d == 0.0, d
    log(f"OK checkpoint tp={par.tp} pp={par.pp} dist_opt={par.use_distributed_optimizer} resume == uninterrupted")


def fsdp_reference(data) -> list:
    """The FSDP engine's log-probs for all samples (DP over all 4 ranks), gathered on every rank."""
    from backends.fsdp.engine import FSDPEngine
    from dispatch.topology import Topology

    world = dist.get_world_size()
    topo = Topology.from_config({"backend": "fsdp", "ulysses_sp": 1, "fsdp_size": -1}, world)
    cfg = EngineConfig(model=MODEL, fsdp=FSDPConfig(), optim=OptimConfig(name="sgd", lr=0.1), seed=3)
    eng = FSDPEngine(cfg, topo)
    pos = positions(topo, N)
    out = eng.infer_batch(share_of(data, pos, 1))
    return gather_outputs(out, pos, N)


def main() -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    assert dist.get_world_size() == 4
    data = make_samples(N, 0, padding=(5,))
    ref_lp, ref_ent = reference_logprobs(LlamaModel.from_seed(MODEL, 3), data)
    fsdp_lp = fsdp_reference(data)
    d = max(float((a - b).abs().max()) for a, b in zip(fsdp_lp, ref_lp))
    assert d < LOGPROB_TOL, d
    log(f"OK fsdp reference max|fsdp-ref|={d:.2e}")

    for tp, pp, vpp in ((2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2)):
        infer_case(MegatronConfig(tp=tp, pp=pp, vpp=vpp, use_distributed_optimizer=False), data, ref_lp, ref_ent,
                   fsdp_lp)

    sgd = OptimConfig(name="sgd", lr=0.5, clip_grad=1e6)
    train_case(MegatronConfig(tp=2, pp=2, use_distributed_optimizer=False), sgd, data, SGD_TOL,
               fsdp=fsdp_train(sgd, data))
    train_case(MegatronConfig(pp=2, vpp=2, use_distributed_optimizer=False), sgd, data, SGD_TOL)
    clipped = OptimConfig(name="sgd", lr=0.5, clip_grad=0.05, warmup_steps=2)
    train_case(MegatronConfig(tp=2, pp=2, use_distributed_optimizer=False), clipped, data, SGD_TOL)
    rich = PolicyLossConfig(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01, use_kl_loss=True,
                            kl_loss_coef=0.1)
    train_case(MegatronConfig(tp=2, pp=2, use_distributed_optimizer=False), sgd, data, SGD_TOL,
               fsdp=fsdp_train(sgd, data, loss=rich), loss=rich)
    adam = OptimConfig(name="adamw", lr=1e-2, eps=1e-3, clip_grad=1e6, weight_decay=0.1)
    train_case(MegatronConfig(tp=2, use_distributed_optimizer=True), adam, data, ADAM_TOL,
               fsdp=fsdp_train(adam, data))

    tied_case(data)
    holder = [tempfile.mkdtemp(prefix="megatron_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder)
    warm = OptimConfig(name="adamw", lr=1e-2, eps=1e-3, clip_grad=1e6, warmup_steps=3)
    try:
        checkpoint_case(MegatronConfig(tp=2, pp=2, use_distributed_optimizer=True), warm, data, holder[0])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(holder[0], ignore_errors=True)


if __name__ == "__main__":
    from worker_exit import run_worker

    run_worker(main)
