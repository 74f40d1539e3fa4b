"""4-rank worker: LoRA on the megatron engine against LoRA on the FSDP engine (same seed, data and adapters).

For TP2 x DP2, PP2 x DP2, TP2 x PP2 and PP2 x VPP2 x DP2 (one after another, parallel state re-created): step 0 is
the plain megatron engine bit for bit; three optimizer steps give FSDP's loss and grad norm, FSDP's adapters and
merged weights; only adapters are trainable, in the grad buffers and moved; the base stays bit-identical; the
actor with adapters off is the plain engine; a decoder loaded with the merged weights gives the actor's log-probs.
With adapter dropout, the replicated adapters stay equal over TP. Then TP2 x PP2 with AdamW and the distributed optimizer saves a checkpoint (with a run config, as the trainer does)
and resumes it bit for bit. Prints one ``OK <check>`` line per passed check.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_common import (  # noqa: E402
    MODEL, LlamaModel, MegatronConfig, OptimConfig, engine_config, gather_outputs, make_samples, positions,
    reference_logprobs, share_of, topology,
)

from backends.config import EngineConfig, FSDPConfig, LoraConfig  # noqa: E402
from backends.megatron.engine import MegatronEngine  # noqa: E402
from backends.model.lora import is_adapter_name  # noqa: E402

N = 8
STEPS = 3
LORA = LoraConfig(rank=4, alpha=8.0, target_modules="all-linear")
#: k and gate without adapters: the fused linears fill their rows of the update with zeros
PARTIAL = LoraConfig(rank=2, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj", "o_proj"])
SGD = OptimConfig(name="sgd", lr=0.5, clip_grad=1e6)
LOGPROB_TOL = 2e-5  # fp32, different summation orders (TP-split matmuls, masked vs varlen attention)
PARAM_TOL = 1e-5  # three SGD steps of the adapters: lr x gradient float noise, compounded


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def fsdp_run(lora: LoraConfig, optim: OptimConfig, batches) -> dict:
    """The FSDP engine's LoRA run (DP over all 4 ranks): per-step metrics, adapters and merged weights."""
    from backends.fsdp.engine import FSDPEngine
    from dispatch.topology import Topology

    topo = Topology.from_config({"backend": "fsdp", "ulysses_sp": 1, "fsdp_size": -1}, dist.get_world_size())
    eng = FSDPEngine(EngineConfig(model=MODEL, fsdp=FSDPConfig(), optim=optim, seed=3, lora=lora), topo)
    pos = positions(topo, N)
    step0 = gather_outputs(eng.infer_batch(share_of(batches[0], pos, 1)), pos, N)
    metrics = [eng.train_batch(share_of(b, pos, 1)) for b in batches]
    return {"step0": step0, "metrics": metrics, "adapters": eng.adapter_weights(), "merged": eng.get_weights()}


def megatron_case(par: MegatronConfig, lora: LoraConfig, batches, fsdp: dict) -> None:
    topo = topology(par, dist.get_world_size())
    pos = positions(topo, N)
    k = 2
    plain = MegatronEngine(engine_config(par, optim=SGD), topo)
    try:
        base_lp = gather_outputs(plain.infer_batch(share_of(batches[0], pos, k)), pos, N)
    finally:
        plain.close()
    eng = MegatronEngine(engine_config(par, optim=SGD, lora=lora), topo)
    try:
        where = f"tp={par.tp} pp={par.pp} vpp={par.vpp} dp={topo.dp_size} targets={lora.spec().targets}"
        # step 0: B = 0 adds exact zeros, so the adapted model is the plain one bit for bit (and FSDP's to fp32)
        step0 = gather_outputs(eng.infer_batch(share_of(batches[0], pos, k)), pos, N)
        assert all(torch.equal(a, b) for a, b in zip(step0, base_lp)), f"{where}: step 0 is not the base model"
        d0 = max(float((a - b).abs().max()) for a, b in zip(step0, fsdp["step0"]))
        assert d0 < LOGPROB_TOL, (where, d0)
        # only the adapters train: requires_grad, DDP's grad buffers, the optimizer
        names = {id(p): n for c in eng.chunks for n, p in c.named_parameters()}
        trainable = [n for c in eng.chunks for n, p in c.named_parameters() if p.requires_grad]
        assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
        buffered = [names[id(p)] for c in eng.chunks for buf in c.buffers for p in buf.params]
        assert sorted(buffered) == sorted(trainable), (where, sorted(set(buffered) ^ set(trainable)))
        in_optim = [p for o in eng._sub_optimizers for g in o.param_groups for p in g["params"]]
        assert len(in_optim) == len(trainable), (where, len(in_optim), len(trainable))
        before = eng.adapter_weights()
        metrics = [eng.train_batch(share_of(b, pos, k)) for b in batches]
        for step, (m, f) in enumerate(zip(metrics, fsdp["metrics"]), start=1):
            assert abs(m["loss"] - f["loss"]) < 1e-5, (where, step, m["loss"], f["loss"])
            assert abs(m["pg_loss"] - f["pg_loss"]) < 1e-5, (where, step, m["pg_loss"], f["pg_loss"])
            assert abs(m["grad_norm"] - f["grad_norm"]) < 1e-4 * max(1.0, f["grad_norm"]), (where, step, m, f)
            assert m["skipped"] == 0.0
        after = eng.adapter_weights()
        assert set(after) == set(fsdp["adapters"]), sorted(set(after) ^ set(fsdp["adapters"]))
        frozen = [n for n in after if not is_adapter_name(n)]
        assert all(torch.equal(after[n], before[n]) for n in frozen), f"{where}: a base weight moved"
        moved = [n for n in after if n.endswith("lora_B") and not torch.equal(after[n], before[n])]
        assert len(moved) == len(lora.spec().targets) * MODEL.num_layers, (where, len(moved))
        da = max_diff(after, fsdp["adapters"])
        assert da < PARAM_TOL, (where, da)
        merged = eng.get_weights()
        assert set(merged) == set(fsdp["merged"]) and not any(is_adapter_name(n) for n in merged)
        dm = max_diff(merged, fsdp["merged"])
        assert dm < PARAM_TOL, (where, dm)
        # the reference: the actor with adapters off is the plain (base) engine
        with eng.adapters_disabled():
            ref = gather_outputs(eng.infer_batch(share_of(batches[0], pos, k)), pos, N)
        dr = max(float((a - b).abs().max()) for a, b in zip(ref, base_lp))
        assert dr <= 1e-6, (where, dr)
        # the rollout's model, loaded with the merged weights, scores as the actor does
        actor = gather_outputs(eng.infer_batch(share_of(batches[0], pos, k)), pos, N)
        assert any(not torch.equal(a, b) for a, b in zip(actor, base_lp)), f"{where}: the adapters changed nothing"
        sampler = LlamaModel(MODEL)
        sampler.load_state_dict(merged)
        rollout, _ = reference_logprobs(sampler, batches[0], with_entropy=False)
        dl = max(float((a - b).abs().max()) for a, b in zip(rollout, actor))
        assert dl < LOGPROB_TOL, (where, dl)
        log(f"OK lora {where} step0==base; 3 steps == fsdp (max|adapters-fsdp|={da:.2e}, "
            f"max|merged-fsdp|={dm:.2e}); adapters off == base ({dr:.1e}); rollout logprobs ({dl:.1e})")
    finally:
        eng.close()


def dropout_case(par: MegatronConfig, batches) -> None:
    """With adapter dropout the replicated adapter matrices (column linears' A, row linears' B) stay identical on
    the TP ranks: a column linear's input is replicated, so every TP rank must draw the same mask (else A's
    gradient, and A, would differ between them)."""
    from megatron.core import parallel_state as ps

    topo = topology(par, dist.get_world_size())
    pos = positions(topo, N)
    lora = dataclasses.replace(LORA, dropout=0.5)
    eng = MegatronEngine(engine_config(par, optim=SGD, lora=lora), topo)
    try:
        for b in batches:
            eng.train_batch(share_of(b, pos, 2))
        mine = {n: p.detach().clone() for c in eng.chunks for n, p in c.named_parameters() if p.requires_grad}
        peers: list[dict] = [None] * ps.get_tensor_model_parallel_world_size()  # type: ignore[list-item]
        dist.all_gather_object(peers, mine, group=ps.get_tensor_model_parallel_group())
        replicated = [n for c in eng.chunks for n, p in c.named_parameters()
                      if p.requires_grad and not getattr(p, "tensor_model_parallel", False)]
        assert replicated and all(torch.equal(peers[0][n], peer[n]) for peer in peers for n in replicated), \
            "replicated adapters differ between TP ranks"
    finally:
        eng.close()
    log(f"OK lora dropout tp={par.tp}: {len(replicated)} replicated adapters equal on every TP rank")


def checkpoint_case(par: MegatronConfig, lora: LoraConfig, batches, path: str) -> None:
    """AdamW + distributed optimizer: save after two steps, resume the third bit for bit; the checkpoint carries
    the run config the export reads, and the merged weights at the save for the test to compare."""
    adam = OptimConfig(name="adamw", lr=1e-2, eps=1e-3, clip_grad=1e6, warmup_steps=2)
    topo = topology(par, dist.get_world_size())
    pos = positions(topo, N)
    run_cfg = {"model": dataclasses.asdict(MODEL), "data": {"tokenizer": "char"},
               "actor": {"backend": "megatron", "lora": dataclasses.asdict(lora),
                         "megatron": dataclasses.asdict(par)}}
    eng = MegatronEngine(engine_config(par, optim=adam, lora=lora), topo)
    try:
        for b in batches[:2]:
            eng.train_batch(share_of(b, pos, 2))
        eng.save_checkpoint(path, {"step": 2, "config": run_cfg})
        saved = eng.adapter_weights()
        m_cont = eng.train_batch(share_of(batches[2], pos, 2))
        w_cont = eng.adapter_weights()
        n_state = sum(len(getattr(o, "optimizer", o).state) for o in eng._sub_optimizers)
    finally:
        eng.close()
    eng = MegatronEngine(engine_config(par, optim=adam, lora=lora), topo)
    try:
        assert eng.load_checkpoint(path)["step"] == 2
        m_res = eng.train_batch(share_of(batches[2], pos, 2))
        w_res = eng.adapter_weights()
    finally:
        eng.close()
    assert m_res["loss"] == m_cont["loss"] and m_res["grad_norm"] == m_cont["grad_norm"], (m_res, m_cont)
    bad = [n for n in w_cont if not torch.equal(w_cont[n], w_res[n])]
    assert not bad, f"resumed megatron LoRA run differs in {bad[:4]}"
    if dist.get_rank() == 0:
        torch.save(saved, os.path.join(path, "expected_weights.pt"))
    log(f"OK lora checkpoint tp={par.tp} pp={par.pp} dist_opt={par.use_distributed_optimizer} resume == "
        f"uninterrupted (adam state on {n_state} params of rank 0)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", required=True)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    assert dist.get_world_size() == 4
    batches = [make_samples(N, s, padding=(5,)) for s in range(STEPS)]
    for lora, cases in ((LORA, ((2, 1, 1), (1, 2, 1), (1, 2, 2))), (PARTIAL, ((2, 2, 1),))):
        fsdp = fsdp_run(lora, SGD, batches)
        for tp, pp, vpp in cases:
            megatron_case(MegatronConfig(tp=tp, pp=pp, vpp=vpp, use_distributed_optimizer=False), lora, batches,
                          fsdp)
    dropout_case(MegatronConfig(tp=2, use_distributed_optimizer=False), batches)
    checkpoint_case(MegatronConfig(tp=2, pp=2, use_distributed_optimizer=True), PARTIAL, batches, args.path)


if __name__ == "__main__":
    from worker_exit import run_worker

    run_worker(main)
