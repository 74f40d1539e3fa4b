"""FSDP engine checks under torchrun (gloo, CPU): each mode prints 'OK <check>' lines that the test asserts."""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys

import torch
import torch.distributed as dist
from tensordict import TensorDict

from backends.base import Share, get_engine_class
from backends.config import EngineConfig, FSDPConfig, OptimConfig, PolicyLossConfig
from backends.model.config import ModelConfig
from backends.model.llama import LlamaModel
from protocol.algos.kl import kl_penalty
from protocol.batch.nested import to_nested

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
SEED = 7


def say(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"OK {msg}", flush=True)


# ---- data -------------------------------------------------------------------------------------------------------
def make_samples(n: int, seed: int, n_pad: int = 0, max_p: int = 6, max_r: int = 9) -> list[dict]:
    """n real samples (varied prompt/response lengths, some observation tokens) then n_pad padding samples."""
    g = torch.Generator().manual_seed(seed)
    ref_model = LlamaModel.from_seed(CFG, SEED)
    out = []
    for i in range(n + n_pad):
        p = int(torch.randint(1, max_p + 1, (1,), generator=g))
        r = int(torch.randint(1, max_r + 1, (1,), generator=g))
        ids = torch.randint(0, CFG.vocab_size, (p + r,), generator=g)
        pad = i >= n
        mask = (torch.rand(r, generator=g) > 0.2).long() * (0 if pad else 1)
        with torch.no_grad():
            lp = seq_logprobs(ref_model, ids, r)
        old = lp + 0.3 * torch.randn(r, generator=g)
        adv = torch.randn(r, generator=g)
        ref = lp + 0.2 * torch.randn(r, generator=g)
        out.append({"input_ids": ids, "response_mask": mask, "old_log_probs": old, "advantages": adv,
                    "ref_log_prob": ref, "is_padding": pad})
    return out


def to_td(samples: list[dict]) -> TensorDict:
    return TensorDict({
        "input_ids": to_nested([s["input_ids"] for s in samples]),
        "response_mask": to_nested([s["response_mask"] for s in samples]),
        "old_log_probs": to_nested([s["old_log_probs"] for s in samples]),
        "advantages": to_nested([s["advantages"] for s in samples]),
        "ref_log_prob": to_nested([s["ref_log_prob"] for s in samples]),
        "is_padding": torch.tensor([s["is_padding"] for s in samples]),
    }, batch_size=[len(samples)])


def fixed_micro(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


def budget_micro(samples: list[dict], budget: int) -> list[list[int]]:
    """Greedy first-fit in order under a token budget (a plan; the dispatch layer owns the real planner)."""
    mbs, cur, tot = [], [], 0
    for i, s in enumerate(samples):
        L = len(s["input_ids"])
        if cur and tot + L > budget:
            mbs.append(cur)
            cur, tot = [], 0
        cur.append(i)
        tot += L
    mbs.append(cur)
    # every DP rank must run the same number of micro-batches: split the largest until the counts agree
    count = torch.tensor([len(mbs)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    while len(mbs) < int(count):
        k = max(range(len(mbs)), key=lambda j: len(mbs[j]))
        mbs[k:k + 1] = [mbs[k][:len(mbs[k]) // 2], mbs[k][len(mbs[k]) // 2:]]
    return mbs


# ---- single-process plain-torch reference -----------------------------------------------------------------------
def seq_logprobs(model, ids: torch.Tensor, r: int, temperature: float = 1.0, entropy: bool = False):
    L = ids.shape[0]
    logits = model(ids, torch.arange(L), torch.tensor([0, L], dtype=torch.int32))
    z = logits[L - r - 1:L - 1].float() / temperature
    logp = z.log_softmax(-1)
    lp = logp.gather(-1, ids[L - r:, None]).squeeze(-1)
    if entropy:
        return lp, -(logp.exp() * logp).sum(-1)
    return lp


def reference_loss(model, samples: list[dict], lc: PolicyLossConfig):
    """The step loss written out: token-mean dual-clip PPO (+ entropy bonus, + KL) over all real tokens."""
    total = sum(int(s["response_mask"].sum()) for s in samples if not s["is_padding"])
    loss = torch.zeros(())
    for s in samples:
        if s["is_padding"]:
            continue
        r = len(s["response_mask"])
        lp, ent = seq_logprobs(model, s["input_ids"], r, entropy=True)
        m = s["response_mask"].float()
        ratio = torch.exp(lp - s["old_log_probs"])
        a = s["advantages"]
        l = torch.maximum(-a * ratio, -a * ratio.clamp(1 - lc.clip_ratio_low, 1 + lc.clip_ratio_high))
        l = torch.where(a < 0, torch.minimum(l, -a * lc.clip_ratio_c), l)
        tok = l - lc.entropy_coeff * ent
        if lc.use_kl_loss:
            tok = tok + lc.kl_loss_coef * kl_penalty(lp, s["ref_log_prob"], lc.kl_loss_type)
        loss = loss + (tok * m).sum() / total
    return loss


def reference_steps(samples_per_step: list[list[dict]], ec: EngineConfig):
    """Plain torch: the same model, loss, clip and optimizer on the whole batch in one process."""
    model = LlamaModel.from_seed(CFG, ec.seed)
    params = list(model.parameters())
    if ec.optim.name == "sgd":
        opt = torch.optim.SGD(params, lr=ec.optim.lr)
    else:
        opt = torch.optim.AdamW(params, lr=ec.optim.lr, betas=ec.optim.betas, eps=ec.optim.eps,
                                weight_decay=ec.optim.weight_decay)
    hist = []
    for samples in samples_per_step:
        opt.zero_grad()
        loss = reference_loss(model, samples, ec.loss)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params, ec.optim.clip_grad))
        opt.step()
        hist.append({"loss": float(loss.detach()), "grad_norm": norm})
    return {n: p.detach().clone() for n, p in model.named_parameters()}, hist


# ---- engine driving ---------------------------------------------------------------------------------------------
def engine_config(optim="sgd", lr=0.1, clip=1.0, sp=1, fsdp_size=-1, budget=None, **loss) -> EngineConfig:
    return EngineConfig(model=CFG, optim=OptimConfig(name=optim, lr=lr, clip_grad=clip),
                        loss=PolicyLossConfig(**loss), fsdp=FSDPConfig(fsdp_size=fsdp_size, ulysses_sp=sp),
                        seed=SEED, max_token_len_per_gpu=budget)


def make_engine(ec: EngineConfig):
    return get_engine_class("fsdp")(ec, None)


def my_share(engine, samples: list[dict], micro="fixed", size=2, budget=None) -> Share:
    """This DP rank's contiguous block of the samples, micro-batched by count or by a token budget."""
    dp, r = engine.dp_size, engine.dp_rank
    k = len(samples) // dp
    mine = samples[r * k:(r + 1) * k]
    mbs = fixed_micro(len(mine), size) if micro == "fixed" else budget_micro(mine, budget)
    return Share(to_td(mine), mbs)


def run_engine(ec, steps: list[list[dict]], **share_kw):
    eng = make_engine(ec)
    hist = [eng.train_batch(my_share(eng, s, **share_kw)) for s in steps]
    return eng, hist


def assert_close_params(got: dict, want: dict, rtol: float, atol: float, what: str) -> float:
    worst = 0.0
    for n, w in want.items():
        d = (got[n] - w).abs().max().item()
        worst = max(worst, d)
        if not torch.allclose(got[n], w, rtol=rtol, atol=atol):
            raise AssertionError(f"{what}: parameter {n} differs by {d:.3e} (rtol={rtol}, atol={atol})")
    return worst


def check_metrics(hist, ref_hist, what, tol=1e-5):
    for h, rh in zip(hist, ref_hist):
        for k in ("loss", "grad_norm"):
            if not math.isclose(h[k], rh[k], rel_tol=tol, abs_tol=tol):
                raise AssertionError(f"{what}: {k} {h[k]!r} != reference {rh[k]!r}")


# ---- modes ------------------------------------------------------------------------------------------------------
def mode_parity() -> None:
    """Tests 1, 2 (2-rank part) and 3: SGD/Adam parity with the reference, equal updates, infer order and shift."""
    world = dist.get_world_size()
    steps = [make_samples(8, 1), make_samples(8, 2)]
    # SGD: parameters after an update differ from the reference only by fp32 reduction order (packed vs
    # one-by-one forward, cross-rank sums) ~1e-7 relative, times lr; 1e-5 relative / 1e-6 absolute covers it.
    ec = engine_config(optim="sgd", lr=0.5, clip=1.0)
    ref_w, ref_hist = reference_steps(steps, ec)
    eng, hist = run_engine(ec, steps)
    check_metrics(hist, ref_hist, "sgd dp=%d" % world)
    d = assert_close_params(eng.get_weights(), ref_w, 1e-5, 1e-6, "sgd")
    say(f"sgd_parity dp={eng.dp_size} max_abs_diff={d:.2e}")
    del eng
    # AdamW: the first step moves every parameter by ~lr*sign(g), so float noise in near-zero gradients can flip
    # a near-zero update; after 2 steps we allow lr * 1e-2 absolute.
    ec = engine_config(optim="adamw", lr=1e-3, clip=1.0)
    ref_w, ref_hist = reference_steps(steps, ec)
    eng, hist = run_engine(ec, steps)
    check_metrics(hist, ref_hist, "adamw")
    d = assert_close_params(eng.get_weights(), ref_w, 1e-4, 1e-5, "adamw")
    say(f"adamw_parity max_abs_diff={d:.2e}")

    # Test 3: infer_batch, permuted micro-batches, temperature, entropy.
    samples = steps[0]
    share = my_share(eng, samples, size=3)
    share = Share(share.data, [[3, 0], [2], [1]])
    ref_model = LlamaModel.from_seed(CFG, SEED)
    ref_model.load_state_dict(eng.get_weights())
    out = eng.infer_batch(share, temperature=0.7, with_entropy=True)
    k = len(samples) // eng.dp_size
    mine = samples[eng.dp_rank * k:(eng.dp_rank + 1) * k]
    assert eng.is_reporting_rank and out is not None
    for i, s in enumerate(mine):
        with torch.no_grad():
            lp, ent = seq_logprobs(ref_model, s["input_ids"], len(s["response_mask"]), 0.7, entropy=True)
        got_lp, got_ent = out["log_probs"][i], out["entropy"][i]
        torch.testing.assert_close(got_lp, lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_ent, ent, rtol=1e-5, atol=1e-5)
    out1 = eng.infer_batch(share)
    assert "entropy" not in out1.keys()
    say("infer_order_shift_temperature")
    del eng

    # Test 2 (2-rank part): the update does not depend on the micro-batch split, token budget or padding samples.
    ec = engine_config(optim="sgd", lr=0.5, clip=1.0)
    ref_w, ref_hist = reference_steps(steps[:1], ec)
    variants = {
        "micro1": dict(micro="fixed", size=1),
        "micro4": dict(micro="fixed", size=4),
        "budget24": dict(micro="budget", budget=24),
    }
    for name, kw in variants.items():
        eng, hist = run_engine(engine_config(optim="sgd", lr=0.5, clip=1.0, budget=kw.get("budget")), steps[:1],
                               **kw)
        check_metrics(hist, ref_hist, name)
        assert_close_params(eng.get_weights(), ref_w, 1e-5, 1e-6, name)
        say(f"equal_update {name} micro_batches={int(hist[0]['micro_batches'])}")
        del eng
    # padding samples: 2 extra per rank, interleaved; response_mask 0, is_padding True
    padded = make_samples(8, 1, n_pad=4)
    real, pads = padded[:8], padded[8:]
    mixed = []
    for r in range(world):
        block = real[r * 8 // world:(r + 1) * 8 // world]
        mine_pads = pads[r * 4 // world:(r + 1) * 4 // world]
        mixed += [block[0]] + mine_pads + block[1:]
    eng, hist = run_engine(ec, [mixed], size=3)
    check_metrics(hist, ref_hist, "padding")
    assert_close_params(eng.get_weights(), ref_w, 1e-5, 1e-6, "padding")
    assert hist[0]["seqs"] == 8, hist[0]
    say("equal_update padding_samples")
    del eng
    # Ulysses SP = world (one replica): same update
    eng, hist = run_engine(engine_config(optim="sgd", lr=0.5, clip=1.0, sp=world), steps[:1], size=3)
    check_metrics(hist, ref_hist, "sp")
    assert_close_params(eng.get_weights(), ref_w, 1e-5, 1e-6, "sp")
    out = eng.infer_batch(my_share(eng, steps[0], size=3), with_entropy=True)
    assert (out is not None) == (dist.get_rank() == 0) and eng.dp_size == 1
    weights = eng.get_weights()  # a collective: every rank calls it
    if out is not None:
        ref_model = LlamaModel.from_seed(CFG, SEED)
        ref_model.load_state_dict(weights)
        for i, s in enumerate(steps[0]):
            with torch.no_grad():
                lp, ent = seq_logprobs(ref_model, s["input_ids"], len(s["response_mask"]), entropy=True)
            torch.testing.assert_close(out["log_probs"][i], lp, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out["entropy"][i], ent, rtol=1e-5, atol=1e-5)
    say(f"equal_update ulysses_sp={world}")
    del eng


def mode_options() -> None:
    """Loss options, LR schedule, non-finite skip, activation checkpointing, weights round trip, bad input."""
    steps = [make_samples(6, 3), make_samples(6, 4)]
    lc = dict(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    ec = engine_config(optim="sgd", lr=0.5, clip=1.0, **lc)
    ref_w, ref_hist = reference_steps(steps, ec)
    eng, hist = run_engine(ec, steps)
    check_metrics(hist, ref_hist, "entropy+kl")
    assert_close_params(eng.get_weights(), ref_w, 1e-5, 1e-6, "entropy+kl")
    assert hist[0]["kl_loss"] > 0 and hist[0]["entropy"] > 0 and 0 <= hist[0]["pg_clipfrac"] <= 1
    say("entropy_and_kl_loss")
    del eng
    # activation checkpointing gives the same update
    ec2 = copy.deepcopy(ec)
    ec2.fsdp.activation_checkpointing = True
    eng, hist = run_engine(ec2, steps)
    assert_close_params(eng.get_weights(), ref_w, 1e-5, 1e-6, "activation checkpointing")
    say("activation_checkpointing")
    # weights round trip
    w = eng.get_weights()
    w2 = {k: v + 1 for k, v in w.items()}
    eng.set_weights(w2)
    assert all(torch.equal(eng.get_weights()[k], w2[k]) for k in w)
    try:
        eng.set_weights({k: v for k, v in w.items() if k != "norm.weight"})
        raise AssertionError("missing weight accepted")
    except KeyError as e:
        assert "norm.weight" in str(e)
    try:
        eng.set_weights({**w, "norm.weight": torch.ones(3)})
        raise AssertionError("wrong shape accepted")
    except ValueError as e:
        assert "norm.weight" in str(e)
    say("weights_round_trip")
    del eng
    # LR schedule: warm-up then cosine, reported per step
    ec3 = engine_config(optim="adamw", lr=1e-2)
    ec3.optim.warmup_steps, ec3.optim.lr_schedule, ec3.optim.total_steps, ec3.optim.min_lr_ratio = 2, "cosine", 4, 0.1
    eng = make_engine(ec3)
    lrs = [eng.train_batch(my_share(eng, steps[i % 2]))["lr"] for i in range(5)]
    # warm-up (s+1)/2 for s < 2; then cosine progress (s-2)/(4-2) from 1 to min_lr_ratio, held after total_steps
    want = [5e-3, 1e-2, 1e-2, 1e-2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))), 1e-3]
    assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(lrs, want)), lrs
    say("lr_schedule")
    del eng
    # non-finite gradient norm: step skipped, parameters kept
    eng = make_engine(engine_config(optim="adamw", lr=1e-2))
    before = eng.get_weights()
    bad = copy.deepcopy(steps[0])
    bad[0]["advantages"][0] = float("nan")
    bad[0]["response_mask"][0] = 1
    m = eng.train_batch(my_share(eng, bad))
    assert m["skipped"] == 1.0 and not math.isfinite(m["grad_norm"]), m
    after = eng.get_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
    m = eng.train_batch(my_share(eng, steps[0]))
    assert m["skipped"] == 0.0 and not torch.equal(before["norm.weight"], eng.get_weights()["norm.weight"])
    say("nonfinite_skip")

    # Test 5: bad input, each a clear error
    good = my_share(eng, steps[0])

    def expect(exc, text, fn):
        try:
            fn()
        except exc as e:
            if text not in str(e):
                raise AssertionError(f"error {e!r} does not mention {text!r}") from e
            return
        raise AssertionError(f"no {exc.__name__} mentioning {text!r}")

    td = good.data.clone()
    del td["advantages"]
    expect(KeyError, "advantages", lambda: eng.train_batch(Share(td, good.micro_batches)))
    td = good.data.clone()
    del td["response_mask"]
    expect(KeyError, "response_mask", lambda: eng.infer_batch(Share(td, good.micro_batches)))
    ec_b = engine_config(budget=12)
    eng_b = make_engine(ec_b)
    big = [s for s in steps[0]]
    expect(ValueError, "max_token_len_per_gpu=12", lambda: eng_b.train_batch(my_share(eng_b, big, size=3)))
    expect(ValueError, "ulysses_sp=3", lambda: make_engine(engine_config(sp=3)))
    bad_len = copy.deepcopy(steps[0])
    bad_len[eng.dp_rank * 3]["old_log_probs"] = torch.zeros(len(bad_len[eng.dp_rank * 3]["response_mask"]) + 1)
    expect(ValueError, "old_log_probs", lambda: eng.train_batch(my_share(eng, bad_len)))
    short = copy.deepcopy(steps[0])
    s = short[eng.dp_rank * 3]
    s["response_mask"] = torch.ones(len(s["input_ids"]), dtype=torch.long)
    s["old_log_probs"] = s["advantages"] = s["ref_log_prob"] = torch.zeros(len(s["input_ids"]))
    expect(ValueError, "prompt_len", lambda: eng.infer_batch(my_share(eng, short)))
    expect(ValueError, "temperature", lambda: eng.infer_batch(good, temperature=0.0))
    expect(ValueError, "fsdp_size=3", lambda: make_engine(engine_config(fsdp_size=3)))
    say("bad_input_errors")


def mode_mesh4() -> None:
    """Test 2 on 4 ranks: full shard (dp 4), HSDP 2x2, Ulysses SP 2 x DP 2, and SP 2 with HSDP."""
    steps = [make_samples(8, 5)]
    ec = engine_config(optim="sgd", lr=0.5)
    ref_w, ref_hist = reference_steps(steps, ec)
    for name, kw in {"dp4": {}, "hsdp2x2": {"fsdp_size": 2}, "sp2xdp2": {"sp": 2},
                     "sp2_hsdp2x2": {"sp": 2, "fsdp_size": 2},
                     "sp4_kv_repeat": {"sp": 4}}.items():  # 2 kv heads over 4 SP ranks: kv heads are repeated
        eng, hist = run_engine(engine_config(optim="sgd", lr=0.5, **kw), steps, size=1)
        check_metrics(hist, ref_hist, name)
        assert_close_params(eng.get_weights(), ref_w, 1e-5, 1e-6, name)
        say(f"equal_update {name} dp={eng.dp_size}")
        del eng


def mode_ckpt_save(path: str) -> None:
    """Test 4 (saving side): 2 uninterrupted steps == 1 step, save, fresh engine load, 1 step (bitwise)."""
    steps = [make_samples(8, 11), make_samples(8, 12)]
    ec = engine_config(optim="adamw", lr=1e-2)
    ec.optim.warmup_steps = 3
    eng = make_engine(ec)
    eng.train_batch(my_share(eng, steps[0]))
    eng.save_checkpoint(path, extra_state={"epoch": 3})
    w1 = eng.get_weights()
    m2 = eng.train_batch(my_share(eng, steps[1]))
    w2 = eng.get_weights()
    del eng
    eng = make_engine(ec)
    extra = eng.load_checkpoint(path)
    assert extra == {"epoch": 3} and eng.global_step == 1
    assert all(torch.equal(eng.get_weights()[k], w1[k]) for k in w1)
    m2b = eng.train_batch(my_share(eng, steps[1]))
    w2b = eng.get_weights()
    assert m2b["loss"] == m2["loss"] and m2b["grad_norm"] == m2["grad_norm"] and m2b["lr"] == m2["lr"], (m2, m2b)
    bad = [k for k in w2 if not torch.equal(w2[k], w2b[k])]
    assert not bad, f"resumed run differs in {bad}"
    if dist.get_rank() == 0:
        torch.save({"w1": w1, "w2": w2, "m2": m2}, os.path.join(path, "expected.pt"))
    say(f"ckpt_resume_bitwise world={dist.get_world_size()}")


def mode_ckpt_load(path: str) -> None:
    """Test 4 (loading side, another world size): weights restore bitwise; the next step matches."""
    exp = torch.load(os.path.join(path, "expected.pt"), weights_only=False)
    steps = [make_samples(8, 11), make_samples(8, 12)]
    ec = engine_config(optim="adamw", lr=1e-2)
    ec.optim.warmup_steps = 3
    eng = make_engine(ec)
    extra = eng.load_checkpoint(path)
    assert extra == {"epoch": 3}
    w = eng.get_weights()
    assert all(torch.equal(w[k], exp["w1"][k]) for k in w), "weights differ after resharded load"
    m2 = eng.train_batch(my_share(eng, steps[1]))
    assert m2["lr"] == exp["m2"]["lr"]
    assert math.isclose(m2["loss"], exp["m2"]["loss"], rel_tol=1e-6), (m2, exp["m2"])
    # a different world size changes only the fp32 reduction order, hence a float tolerance (Adam: ~lr)
    assert_close_params(eng.get_weights(), exp["w2"], 1e-4, 1e-5, "resharded resume")
    say(f"ckpt_reshard_load world={dist.get_world_size()}")


def mode_dp1() -> None:
    """Test 1/2 with a single rank (DP = 1): SGD parity and infer order."""
    steps = [make_samples(8, 1), make_samples(8, 2)]
    ec = engine_config(optim="sgd", lr=0.5, clip=1.0)
    ref_w, ref_hist = reference_steps(steps, ec)
    eng, hist = run_engine(ec, steps, size=3)
    check_metrics(hist, ref_hist, "sgd dp=1")
    d = assert_close_params(eng.get_weights(), ref_w, 1e-5, 1e-6, "sgd dp=1")
    say(f"sgd_parity dp={eng.dp_size} max_abs_diff={d:.2e}")
    from dispatch import Topology

    world = dist.get_world_size()
    topo = Topology.from_config({"backend": "fsdp", "ulysses_sp": 1, "fsdp_size": -1}, world)
    eng = get_engine_class("fsdp")(ec, topo)
    assert eng.dp_size == topo.dp_size and eng.dp_rank == topo.dp_rank(dist.get_rank())
    wrong = Topology.from_config({"backend": "fsdp"}, 2 * world)  # twice the DP size of this world
    try:
        get_engine_class("fsdp")(ec, wrong)
        raise AssertionError("a topology of another layout was accepted")
    except ValueError as e:
        assert "dp_size" in str(e)
    say("topology_agrees")


# ---- critic ------------------------------------------------------------------------------------------------------
def seq_values(model, ids: torch.Tensor, r: int) -> torch.Tensor:
    """A plain ValueModel's values of the last ``r`` tokens: read at the positions that predict them."""
    L = ids.shape[0]
    return model(ids, torch.arange(L), torch.tensor([0, L], dtype=torch.int32))[L - r - 1:L - 1]


def critic_samples(n: int, seed: int, n_pad: int = 0) -> list[dict]:
    """``make_samples`` plus the critic's inputs: old values (the initial critic's, perturbed) and returns."""
    from backends.model.critic import ValueModel

    g = torch.Generator().manual_seed(seed + 100)
    model = ValueModel.from_seed(CFG, SEED)
    out = make_samples(n, seed, n_pad)
    for s in out:
        r = len(s["response_mask"])
        with torch.no_grad():
            s["values"] = seq_values(model, s["input_ids"], r) + 0.3 * torch.randn(r, generator=g)
        s["returns"] = torch.randn(r, generator=g)
    return out


def critic_td(samples: list[dict]) -> TensorDict:
    return TensorDict({
        "input_ids": to_nested([s["input_ids"] for s in samples]),
        "response_mask": to_nested([s["response_mask"] for s in samples]),
        "values": to_nested([s["values"] for s in samples]),
        "returns": to_nested([s["returns"] for s in samples]),
        "is_padding": torch.tensor([s["is_padding"] for s in samples]),
    }, batch_size=[len(samples)])


def critic_reference(steps: list[list[dict]], lr: float, clip: float, cliprange: float):
    """Plain torch: the written-out clipped value loss (token-mean over the step's real tokens), SGD, grad clip."""
    from backends.model.critic import ValueModel

    model = ValueModel.from_seed(CFG, SEED)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr)
    hist = []
    for samples in steps:
        opt.zero_grad()
        total = sum(int(s["response_mask"].sum()) for s in samples if not s["is_padding"])
        loss = torch.zeros(())
        for s in samples:
            if s["is_padding"]:
                continue
            v = seq_values(model, s["input_ids"], len(s["response_mask"]))
            old, ret, m = s["values"], s["returns"], s["response_mask"].float()
            vclip = old + (v - old).clamp(-cliprange, cliprange)
            loss = loss + 0.5 * (torch.maximum((v - ret) ** 2, (vclip - ret) ** 2) * m).sum() / total
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        opt.step()
        hist.append({"vf_loss": float(loss.detach()), "grad_norm": norm})
    return {n: p.detach().clone() for n, p in model.named_parameters()}, hist


def mode_critic() -> None:
    """The FSDP critic: values equal a plain ValueModel's; SGD updates equal the written-out reference for any
    micro-batch split, with padding samples, and with Ulysses SP; padding samples move nothing."""
    from backends.config import ValueLossConfig
    from backends.fsdp.critic import FSDPCriticEngine
    from backends.model.critic import ValueModel

    world = dist.get_world_size()
    lr, clip, cliprange = 0.5, 1.0, 0.2
    steps = [critic_samples(8, 11, n_pad=2), critic_samples(8, 12, n_pad=2)]
    ref_w, ref_hist = critic_reference(steps, lr, clip, cliprange)

    def config(sp=1):
        return EngineConfig(model=CFG, optim=OptimConfig(name="sgd", lr=lr, clip_grad=clip),
                            value_loss=ValueLossConfig(cliprange_value=cliprange),
                            fsdp=FSDPConfig(ulysses_sp=sp), seed=SEED)

    def share(eng, samples, size):
        k = len(samples) // eng.dp_size
        mine = samples[eng.dp_rank * k:(eng.dp_rank + 1) * k]
        return Share(critic_td(mine), fixed_micro(len(mine), size))

    plain = ValueModel.from_seed(CFG, SEED)
    for sp, size in ((1, 2), (1, 5), (world, 3)):
        eng = FSDPCriticEngine(config(sp), None)
        sh = share(eng, steps[0], size)
        out = eng.infer_batch(sh)
        if eng.is_reporting_rank:
            k = len(steps[0]) // eng.dp_size
            for j, s in enumerate(steps[0][eng.dp_rank * k:(eng.dp_rank + 1) * k]):
                want = seq_values(plain, s["input_ids"], len(s["response_mask"])).detach() * s["response_mask"]
                if not torch.allclose(out["values"][j], want, rtol=1e-5, atol=1e-6):
                    raise AssertionError(f"critic values sp={sp}: sample {j} differs by "
                                         f"{(out['values'][j] - want).abs().max():.3e}")
        hist = [eng.train_batch(share(eng, st, size)) for st in steps]
        for h, rh in zip(hist, ref_hist):
            for key in ("vf_loss", "grad_norm"):
                if not math.isclose(h[key], rh[key], rel_tol=1e-5, abs_tol=1e-6):
                    raise AssertionError(f"critic sp={sp} micro={size}: {key} {h[key]!r} != reference {rh[key]!r}")
        d = assert_close_params(eng.get_weights(), ref_w, 1e-5, 1e-6, f"critic sp={sp} micro={size}")
        say(f"critic_parity sp={sp} micro={size} dp={eng.dp_size} max_abs_diff={d:.2e}")
        del eng
    # padding samples move no value loss, even with a full response mask and returns far from their values
    eng = FSDPCriticEngine(config(), None)
    noisy = [dict(s, returns=s["returns"] + 1e3, response_mask=torch.ones_like(s["response_mask"]))
             if s["is_padding"] else s for s in steps[0]]
    eng.train_batch(share(eng, noisy, 2))
    eng.train_batch(share(eng, steps[1], 2))
    assert_close_params(eng.get_weights(), ref_w, 1e-5, 1e-6, "critic padding garbage")
    say("critic_padding_moves_nothing")


MODES = {"parity": mode_parity, "critic": mode_critic, "options": mode_options, "mesh4": mode_mesh4, "dp1": mode_dp1,
         "ckpt_save": mode_ckpt_save, "ckpt_load": mode_ckpt_load}


def run_modes(modes: str, path: str = "") -> None:
    """Run the comma-separated modes in order in this (already initialised) process group."""
    for mode in modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; known: {sorted(MODES)}")
        fn = MODES[mode]
        fn(path) if mode.startswith("ckpt") else fn()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("modes", help="comma-separated: " + ",".join(MODES))
    ap.add_argument("--path", default="")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    run_modes(args.modes, args.path)


if __name__ == "__main__":
    from worker_exit import run_worker

    run_worker(main)
