"""LoRA on the FSDP2 engine under torchrun (gloo, CPU): prints 'OK <check>' lines that tests/backends/test_lora.py
asserts. Also saves a LoRA checkpoint (with a run config, as the trainer does) for the export checks."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_engine_worker import (CFG, SEED, assert_close_params, check_metrics, fixed_micro, make_samples,  # noqa: E402
                                my_share, reference_loss, say, seq_logprobs, to_td)

from backends.base import Share, get_engine_class  # noqa: E402
from backends.config import EngineConfig, LoraConfig, OptimConfig, PolicyLossConfig  # noqa: E402
from backends.model.llama import LlamaModel  # noqa: E402
from backends.model.lora import apply_lora, init_adapters, is_adapter_name  # noqa: E402
from protocol.store.batching import jagged_rows  # noqa: E402
from rldispatch.ref import AdapterFreeReference, build_reference  # noqa: E402

LORA = LoraConfig(rank=4, alpha=8.0, target_modules="all-linear")


def engine(lora: LoraConfig, optim: str = "sgd", lr: float = 0.5, **loss):
    ec = EngineConfig(model=CFG, optim=OptimConfig(name=optim, lr=lr, clip_grad=1.0), loss=PolicyLossConfig(**loss),
                      seed=SEED, lora=lora)
    return get_engine_class("fsdp")(ec, None)


def log_probs(eng, share: Share) -> list[torch.Tensor] | None:
    out = eng.infer_batch(share)
    return None if out is None else jagged_rows(out["log_probs"])


def plain_lora_model(lora: LoraConfig) -> LlamaModel:
    """The single-process reference: the seeded decoder with the same adapters, unsharded."""
    model = LlamaModel.from_seed(CFG, SEED)
    apply_lora(model, lora.spec())
    init_adapters(model, SEED)
    return model


def mode_lora() -> None:
    samples = [make_samples(8, 1), make_samples(8, 2)]
    base = engine(LoraConfig())
    eng = engine(LORA, use_kl_loss=True)
    share = my_share(eng, samples[0])
    # 1. step 0: B = 0, so the adapted model is the base model exactly
    got, want = log_probs(eng, share), log_probs(base, share)
    if got is not None:
        assert all(torch.equal(a, b) for a, b in zip(got, want)), "step-0 log-probs differ from the base model"
    say("step0_equals_base")

    # 2. one SGD step against the plain-torch model with the same adapters and loss; only adapters move
    before = eng.adapter_weights()
    ref = plain_lora_model(LORA)
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    hist = []
    for s in samples:
        opt.zero_grad()
        loss = reference_loss(ref, s, eng.config.loss)
        loss.backward()
        hist.append({"loss": float(loss.detach()),
                     "grad_norm": float(torch.nn.utils.clip_grad_norm_(params, 1.0))})
        opt.step()
    got_hist = [eng.train_batch(my_share(eng, s)) for s in samples]
    check_metrics(got_hist, hist, "lora sgd")
    after = eng.adapter_weights()
    ref_w = {n: p.detach() for n, p in ref.named_parameters()}
    assert set(after) == set(ref_w), sorted(set(after) ^ set(ref_w))
    d = assert_close_params(after, ref_w, 1e-5, 1e-6, "lora sgd")
    frozen = [n for n in after if not is_adapter_name(n)]
    assert all(torch.equal(after[n], before[n]) for n in frozen), "a base weight moved"
    moved = [n for n in after if n.endswith("lora_B") and not torch.equal(after[n], before[n])]
    assert len(moved) == 7 * CFG.num_layers, f"only {len(moved)} adapters moved"
    no_grad = [n for n, p in eng.model.named_parameters() if not is_adapter_name(n) and
               (p.requires_grad or p.grad is not None)]
    assert not no_grad, f"base parameters with gradients: {no_grad[:4]}"
    opt_params = sum(len(g["params"]) for g in eng.optimizer.param_groups)
    assert opt_params == 2 * 7 * CFG.num_layers, opt_params
    say(f"grads_only_on_adapters sgd_parity max_abs_diff={d:.2e}")

    # 3. the reference is the actor with adapters off: no second engine, log-probs of the frozen base model
    refp = build_reference("fsdp", type(eng), eng.config, None, eng)
    assert isinstance(refp, AdapterFreeReference)
    share = my_share(eng, make_samples(8, 3))
    got, want, actor = log_probs(refp, share), log_probs(base, share), log_probs(eng, share)
    if got is not None:
        worst = max(float((a - b).abs().max()) for a, b in zip(got, want))
        assert worst <= 1e-6, f"reference log-probs differ from a frozen base model by {worst}"
        assert any(not torch.equal(a, b) for a, b in zip(actor, want)), "the adapters changed nothing"
    say("reference_is_actor_without_adapters")

    # 4. the rollout's merged weights give the actor's log-probs (fp32: merged vs factored products)
    merged = eng.get_weights()
    assert set(merged) == set(dict(base.model.named_parameters())), "merged weights are not in the base layout"
    sampler = LlamaModel(CFG)
    sampler.load_state_dict(merged)
    if actor is not None:
        mine = share.data
        worst = 0.0
        for i, (row, rmask) in enumerate(zip(jagged_rows(mine["input_ids"]), jagged_rows(mine["response_mask"]))):
            r = int(rmask.numel())
            with torch.no_grad():
                lp = seq_logprobs(sampler, row, r)
            worst = max(worst, float((lp - actor[i]).abs().max()))
        assert worst <= 1e-5, f"merged-weight log-probs differ from the actor's by {worst}"
        say(f"merged_weights_logprobs max_abs_diff={worst:.2e}")


def mode_resume(path: str) -> None:
    """AdamW LoRA run: a checkpoint after step 1 resumes step 2 bit for bit; the checkpoint keeps the config."""
    samples = [make_samples(8, 11), make_samples(8, 12)]
    lora = dataclasses.replace(LORA, rank=2, target_modules=["q_proj", "v_proj", "down_proj"])
    eng = engine(lora, optim="adamw", lr=1e-2)
    eng.train_batch(my_share(eng, samples[0]))
    run_cfg = {"model": dataclasses.asdict(CFG), "actor": {"backend": "fsdp", "lora": dataclasses.asdict(lora)},
               "data": {"tokenizer": "char"}}
    eng.save_checkpoint(path, extra_state={"step": 1, "config": run_cfg})
    eng.train_batch(my_share(eng, samples[1]))
    want = eng.adapter_weights()
    state = [(n, s) for n, s in eng.optimizer.state_dict()["state"].items()]
    del eng
    eng = engine(lora, optim="adamw", lr=1e-2)
    assert eng.load_checkpoint(path)["step"] == 1
    eng.train_batch(my_share(eng, samples[1]))
    got = eng.adapter_weights()
    bad = [n for n in want if not torch.equal(want[n], got[n])]
    assert not bad, f"resumed LoRA run differs in {bad[:4]}"
    assert len(state) == 2 * 3 * CFG.num_layers, "optimizer state beyond the adapters"
    if dist.get_rank() == 0:
        torch.save(got, os.path.join(path, "expected_step2.pt"))
    say("resume_bitwise")


def mode_hf(hf_path: str) -> None:
    """From a sharded Hugging Face folder (meta init, per-rank rows): the adapted model starts as the checkpoint's,
    and the adapters are the same as for a seeded start (they never come from the checkpoint)."""
    from backends.model.hf import read_hf_config

    cfg = read_hf_config(hf_path)
    ec = lambda lora: EngineConfig(model=cfg, optim=OptimConfig(name="sgd"), seed=SEED, lora=lora)  # noqa: E731
    base = get_engine_class("fsdp")(ec(LoraConfig()), None)
    eng = get_engine_class("fsdp")(ec(LORA), None)
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (7, 5, 9, 4)]
    td = to_td([{"input_ids": r, "response_mask": torch.ones(3, dtype=torch.long), "old_log_probs": torch.zeros(3),
                 "advantages": torch.zeros(3), "ref_log_prob": torch.zeros(3), "is_padding": False} for r in rows])
    share = Share(td, fixed_micro(4, 2))
    got, want = log_probs(eng, share), log_probs(base, share)
    if got is not None:
        assert all(torch.equal(a, b) for a, b in zip(got, want)), "an adapted checkpoint start is not the checkpoint"
    plain = LlamaModel(cfg)
    apply_lora(plain, LORA.spec())
    init_adapters(plain, SEED)
    mine = eng.adapter_weights()
    for n, p in plain.named_parameters():
        if is_adapter_name(n):
            assert torch.equal(mine[n], p.detach()), f"{n} differs from the seeded adapters"
    base_w = base.get_weights()
    assert all(torch.equal(mine[n], base_w[n]) for n in base_w), "the frozen base is not the checkpoint's"
    say("hf_start_equals_checkpoint")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", required=True)
    ap.add_argument("--hf", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    try:
        mode_lora()
        mode_resume(args.path)
        mode_hf(args.hf)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
