"""LoRA actors: config refusals, the adapted layer against peft's, merge algebra, and (torchrun, 2 ranks) the FSDP2
engine's step-0 parity, adapter-only gradients, reference = adapters off, merged rollout weights, resume, export."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from backends.config import EngineConfigError, LoraConfig
from backends.model.config import ModelConfig
from backends.model.llama import LlamaModel
from backends.model.lora import (LORA_TARGETS, LoraLinear, LoraSpec, adapters_disabled, apply_lora, init_adapters,
                                 is_adapter_name, merge_adapters)
from rldispatch.config import ConfigError, load_config

WORKER = Path(__file__).resolve().parent.parent / "dist" / "lora_worker.py"
TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


# ---- config ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, key", [
    ({"rank": -1}, "actor.lora.rank"), ({"alpha": 0.0}, "actor.lora.alpha"), ({"alpha": -2.0}, "actor.lora.alpha"),
    ({"alpha": float("nan")}, "actor.lora.alpha"), ({"dropout": 1.0}, "actor.lora.dropout"),
    ({"dropout": -0.1}, "actor.lora.dropout"),
    ({"target_modules": ["q_proj", "qkv_proj"]}, "actor.lora.target_modules"),
    ({"target_modules": "attn"}, "actor.lora.target_modules"), ({"target_modules": []}, "actor.lora.target_modules"),
    ({"target_modules": ["q_proj", "q_proj"]}, "actor.lora.target_modules"),
])
def test_bad_lora_values_are_refused_naming_the_key(kwargs, key):
    with pytest.raises(EngineConfigError, match=key.replace(".", r"\.")) as err:
        LoraConfig(**{"rank": 4, **kwargs})
    if key.endswith("target_modules") and "twice" not in str(err.value):
        assert all(name in str(err.value) for name in LORA_TARGETS), "the message lists the model's projections"


def test_lora_keys_load_from_overrides_on_either_backend():
    cfg = load_config("configs/grpo_tiny.yaml", ["actor.lora.rank=8", "actor.lora.alpha=16",
                                                  "actor.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.engine_config().lora == LoraConfig(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"])
    assert cfg.engine_config().lora.spec().targets == ("q_proj", "v_proj")
    assert load_config("configs/grpo_tiny.yaml").actor.lora.rank == 0  # off by default
    with pytest.raises(ConfigError, match=r"actor\.lora\.rank"):
        load_config("configs/grpo_tiny.yaml", ["actor.lora.rank=-1"])
    with pytest.raises(ConfigError, match=r"actor\.lora\.target_modules.*gate_proj"):
        load_config("configs/grpo_tiny.yaml", ["actor.lora.rank=4", "actor.lora.target_modules=[mlp]"])
    meg = load_config("configs/grpo_tiny.yaml", ["actor.lora.rank=4", "actor.backend=megatron",
                                                 "actor.megatron.tp=2"])
    assert meg.engine_config().lora.spec().rank == 4 and meg.critic_engine_config().lora.enabled is False


def test_megatron_lora_refuses_sequence_parallel_before_building_anything():
    from backends.config import EngineConfig, MegatronConfig
    from backends.megatron.engine import check_engine_config

    with pytest.raises(ValueError, match=r"actor\.lora\.rank=4 with actor\.megatron\.sequence_parallel=true"):
        check_engine_config(EngineConfig(model=TINY, lora=LoraConfig(rank=4),
                                         megatron=MegatronConfig(tp=2, sequence_parallel=True)))
    check_engine_config(EngineConfig(model=TINY))  # rank 0: accepted


# ---- the layer ---------------------------------------------------------------------------------------------------
def _adapted(targets=LORA_TARGETS, rank=3, alpha=6.0, seed=0) -> LlamaModel:
    model = LlamaModel.from_seed(TINY, 0)
    apply_lora(model, LoraSpec(rank=rank, alpha=alpha, targets=tuple(targets)))
    init_adapters(model, seed)
    return model


def _packed(seed=0, lens=(5, 7)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY.vocab_size, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    return ids, pos, torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


def test_apply_lora_adapts_only_targets_and_freezes_the_base():
    model = _adapted(targets=("q_proj", "down_proj"))
    adapted = {n for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    assert adapted == {f"layers.{i}.{p}" for i in range(2) for p in ("self_attn.q_proj", "mlp.down_proj")}
    grads = {n for n, p in model.named_parameters() if p.requires_grad}
    assert grads == {f"{m}.lora_{ab}" for m in adapted for ab in "AB"}
    base = LlamaModel.from_seed(TINY, 0)
    own = dict(model.named_parameters())
    assert all(torch.equal(own[n], p) for n, p in base.named_parameters()), "base weights and names unchanged"
    a = own["layers.0.self_attn.q_proj.lora_A"].detach()
    assert a.shape == (3, 32) and float(a.abs().max()) <= 1 / 32 ** 0.5 and float(a.std()) > 0
    assert not own["layers.0.self_attn.q_proj.lora_B"].any()
    with pytest.raises(ValueError, match="no projection"):
        apply_lora(LlamaModel(TINY), LoraSpec(rank=2, alpha=1.0, targets=()))


def test_step0_is_the_base_model_and_disabled_adapters_are_bitwise_base():
    base = LlamaModel.from_seed(TINY, 0)
    model = _adapted()
    ids, pos, cu = _packed()
    with torch.no_grad():
        want = base(ids, pos, cu)
        assert torch.equal(model(ids, pos, cu), want)  # B = 0
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.5)
        moved = model(ids, pos, cu)
        with adapters_disabled(model):
            off = model(ids, pos, cu)
        again = model(ids, pos, cu)
    assert torch.equal(off, want) and not torch.equal(moved, want) and torch.equal(again, moved)


def test_lora_linear_equals_peft_lora_layer():
    """peft's own LoRA layer with the same A, B, alpha and rank computes the same outputs."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    lin = nn.Linear(12, 10, bias=True)
    wrapped = nn.Sequential(nn.Linear(12, 10, bias=True))
    wrapped[0].load_state_dict(lin.state_dict())
    pm = peft.get_peft_model(wrapped, peft.LoraConfig(r=4, lora_alpha=12, target_modules=["0"], lora_dropout=0.0))
    layer = pm.base_model.model[0]
    layer.lora_B["default"].weight.data.normal_()
    ours = LoraLinear.adapt(lin, rank=4, alpha=12.0, dropout=0.0)
    ours.lora_A.data.copy_(layer.lora_A["default"].weight.data)
    ours.lora_B.data.copy_(layer.lora_B["default"].weight.data)
    x = torch.randn(6, 12)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), pm(x), rtol=1e-6, atol=1e-6)
        with pm.disable_adapter(), adapters_disabled(nn.Sequential(ours)):
            assert torch.equal(ours(x), pm(x))


@settings(max_examples=20, deadline=None)
@given(rank=st.integers(1, 4), alpha=st.floats(0.25, 64.0), seed=st.integers(0, 2**16))
def test_merged_weight_is_base_plus_scaled_low_rank_product(rank, alpha, seed):
    """merge = W + (alpha/r) B A to fp32 rounding of the float64 formula, a difference of rank <= r, the rest
    untouched."""
    g = torch.Generator().manual_seed(seed)
    w, a, b = torch.randn(9, 7, generator=g), torch.randn(rank, 7, generator=g), torch.randn(9, rank, generator=g)
    other = torch.randn(5, generator=g)
    weights = {"l.q_proj.weight": w, "l.q_proj.lora_A": a, "l.q_proj.lora_B": b, "norm.weight": other}
    merged = merge_adapters(weights, alpha / rank)
    assert set(merged) == {"l.q_proj.weight", "norm.weight"} and merged["norm.weight"] is other
    exact = w.double() + (alpha / rank) * (b.double() @ a.double())
    # fp32: the product's rank-length dot products and the sum each round once (relative eps ~ 6e-8)
    bound = 4 * 2 ** -23 * (w.abs().double() + (alpha / rank) * (b.double().abs() @ a.double().abs()) * (rank + 1))
    assert bool(((merged["l.q_proj.weight"].double() - exact).abs() <= bound).all())
    assert torch.linalg.matrix_rank(exact - w.double()) <= rank


# ---- FSDP2 engine and export (torchrun) --------------------------------------------------------------------------
def _numerical_rank(delta: torch.Tensor) -> int:
    s = torch.linalg.svdvals(delta.double())
    # an fp32 matrix stored after a fp32 merge: singular values below its rounding level are noise
    return int((s > s.max() * 1e-5).sum()) if float(s.max()) > 0 else 0


def _check_export(ckpt, tmp_path, cfg, base, saved, *, rank, scale, targets) -> None:
    """``rldispatch export`` of a LoRA checkpoint: the merged folder (target matrices = base + scale B A, of
    numerical rank <= r against the base; every other tensor the base's bit for bit) loads in transformers with the
    project's logits, and peft loads the adapter folder onto the base with the same logits."""
    from safetensors.torch import load_file

    from backends.model.hf import convert_hf_state_dict, load_hf_checkpoint
    from backends.model.hf_export import save_hf_checkpoint
    from rldispatch.commands.export import main as export_main

    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    assert export_main(["--checkpoint", str(ckpt), "--out", str(merged_dir), "--adapter-out", str(adapter_dir),
                        "--verify"]) == 0
    exported = convert_hf_state_dict(load_file(merged_dir / "model.safetensors"), cfg)
    for name, w in base.items():
        if any(f".{t}." in name for t in targets):
            delta = exported[name].double() - w.detach().double()
            assert 0 < _numerical_rank(delta) <= rank, name
            stem = name[: -len(".weight")]
            want = w.detach().double() + scale * saved[f"{stem}.lora_B"].double() @ saved[f"{stem}.lora_A"].double()
            torch.testing.assert_close(exported[name].double(), want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(exported[name], w.detach()), f"{name} is not bit-identical to the base"

    # transformers loads the merged folder; its logits equal the merged project model's
    from transformers import AutoModelForCausalLM

    hf_merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    ours = load_hf_checkpoint(str(merged_dir)).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want_logits = ours(ids[0], torch.arange(9), torch.tensor([0, 9], dtype=torch.int32))
        torch.testing.assert_close(hf_merged(input_ids=ids).logits[0], want_logits, rtol=1e-5, atol=1e-5)

    # peft's own loader puts the adapter folder onto the base model; same logits as the merged folder
    peft = pytest.importorskip("peft")
    adapter_cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == rank and adapter_cfg["lora_alpha"] == scale * rank
    assert sorted(adapter_cfg["target_modules"]) == sorted(targets)
    base_dir = tmp_path / "base"
    save_hf_checkpoint(str(base_dir), {n: p.detach() for n, p in base.items()}, cfg)
    hf_base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(hf_base, str(adapter_dir)).eval()
    n_lora = sum(1 for n, _ in with_adapter.named_parameters() if "lora_" in n)
    assert n_lora == 2 * len(targets) * cfg.num_layers
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(input_ids=ids).logits[0], want_logits, rtol=1e-5, atol=1e-5)
    assert os.listdir(adapter_dir) and sorted(os.listdir(adapter_dir)) == ["adapter_config.json",
                                                                           "adapter_model.safetensors"]


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp_lora_engine_reference_rollout_resume_and_export(torchrun, tmp_path):
    import sys

    sys.path.insert(0, str(WORKER.parent))
    import hf_tiny

    ckpt = tmp_path / "ckpt"
    hf = hf_tiny.make_checkpoint(tmp_path / "qwen2", "qwen2", max_shard_size="40KB", tokenizer=False)
    out = torchrun(WORKER, 2, "--path", str(ckpt), "--hf", str(hf), timeout=400)
    for check in ("step0_equals_base", "grads_only_on_adapters", "reference_is_actor_without_adapters",
                  "merged_weights_logprobs", "resume_bitwise", "hf_start_equals_checkpoint"):
        assert f"OK {check}" in out, f"{check} did not report OK:\n{out[-3000:]}"

    # the checkpoint holds the frozen base and the adapters (and AdamW state for the adapters only)
    from backends.fsdp.checkpoint import read_model_weights

    saved = read_model_weights(str(ckpt))
    base = dict(LlamaModel.from_seed(TINY, 7).named_parameters())  # the worker's seed
    assert {n for n in saved if not is_adapter_name(n)} == set(base)
    assert all(torch.equal(saved[n], base[n]) for n in base), "the checkpoint's base is the frozen start"
    lora_b = [n for n in saved if n.endswith("lora_B")]
    assert len(lora_b) == 3 * TINY.num_layers and all(saved[n].any() for n in lora_b)

    _check_export(ckpt, tmp_path, TINY, base, saved, rank=2, scale=4.0, targets=("q_proj", "v_proj", "down_proj"))


def test_resume_refuses_a_changed_adapter_layout_and_reads_old_checkpoints_as_lora_off():
    from rldispatch.run_dir import check_resume_config

    saved = {"model": {"hidden_size": 32}, "actor": {"backend": "fsdp", "lora": {"rank": 4, "alpha": 8.0,
                                                                                   "dropout": 0.0}}}
    for key, value in [("rank", 8), ("alpha", 16.0), ("target_modules", ["q_proj"])]:
        now = json.loads(json.dumps(saved))
        now["actor"]["lora"][key] = value
        with pytest.raises(ConfigError, match=rf"actor\.lora\.{key} was"):
            check_resume_config({"config": saved}, now, "ckpt")
    now = json.loads(json.dumps(saved))
    now["actor"]["lora"]["dropout"] = 0.1
    assert check_resume_config({"config": saved}, now, "ckpt") == [("actor.lora.dropout", 0.0, 0.1)]
    before_lora = {"model": {"hidden_size": 32}, "actor": {"backend": "fsdp"}}
    now = {"model": {"hidden_size": 32}, "actor": {"backend": "fsdp", "lora": {"rank": 0}}}
    assert check_resume_config({"config": before_lora}, now, "ckpt") == []
    with pytest.raises(ConfigError, match=r"actor\.lora\.rank was 0, now 2"):
        check_resume_config({"config": before_lora}, {**now, "actor": {"backend": "fsdp", "lora": {"rank": 2}}}, "c")


@pytest.mark.dist
@pytest.mark.slow
def test_grpo_run_with_lora_uses_the_adapter_free_reference(torchrun, tmp_path):
    """The trainer end to end with adapters: step 1's policy is the base, so its KL to the reference is exactly 0;
    at step 2 the adapters have moved and the reference (adapters off) has not."""
    repo = Path(__file__).resolve().parents[2]
    run = tmp_path / "run"
    torchrun(repo / "scripts" / "train.py", 2, "--config", str(repo / "configs" / "grpo_tiny.yaml"),
             "trainer.progress_bar=false", "trainer.tensorboard=false", "data.val_batch_size=4",
             "data.train_size=32", "data.val_size=4", f"data.train_files=[{tmp_path}/data/train.parquet]",
             f"data.val_files=[{tmp_path}/data/val.parquet]", f"trainer.run_dir={run}", "trainer.total_steps=2",
             "trainer.val_freq=0", "actor.ppo_mini_batch_size=16", "actor.optim.lr=0.05", "actor.lora.rank=4",
             "actor.lora.alpha=8", "actor.loss.use_kl_loss=true", timeout=400)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["actor/kl_loss"] == 0.0, records[0]["actor/kl_loss"]
    assert records[1]["actor/kl_loss"] > 0.0, records[1]["actor/kl_loss"]
    from backends.fsdp.checkpoint import read_model_weights

    saved = read_model_weights(str(run / "checkpoints" / "step_2"))
    assert sum(1 for n in saved if is_adapter_name(n)) == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)


def test_one_rank_engine_merges_without_touching_its_parameters_and_the_rollout_samples_with_them():
    """On a one-rank mesh FSDP2's gather hands back the parameter's own storage: the weight sync's in-place merge
    must work on a copy (get_weights twice gives the same merged weights; the base stays the base). The rollout
    worker loaded with them samples tokens whose log-probs are the actor's."""
    import dataclasses
    import socket

    import torch.distributed as dist
    from tensordict import TensorDict

    from backends.base import Share, get_engine_class
    from backends.config import EngineConfig
    from protocol.batch.nested import to_nested
    from protocol.rollout.tokenizer import load_tokenizer
    from backends.rollout import EmbeddedEngine

    cfg = dataclasses.replace(TINY, vocab_size=128)  # the char tokenizer's 128 ids

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        eng = get_engine_class("fsdp")(EngineConfig(model=cfg, lora=LoraConfig(rank=2, alpha=4.0), seed=1))
        own = eng.adapter_weights()
        eng.set_weights({n: (torch.randn_like(t) if n.endswith("lora_B") else t) for n, t in own.items()})
        own = eng.adapter_weights()
        first, second = eng.get_weights(), eng.get_weights()
        assert all(torch.equal(first[n], second[n]) for n in first)
        after = eng.adapter_weights()
        assert all(torch.equal(after[n], own[n]) for n in own), "get_weights changed the parameters"
        w = "layers.0.self_attn.q_proj.weight"
        want = own[w] + 2.0 * own["layers.0.self_attn.q_proj.lora_B"] @ own["layers.0.self_attn.q_proj.lora_A"]
        torch.testing.assert_close(first[w], want, rtol=1e-6, atol=1e-6)

        rollout = EmbeddedEngine(cfg, load_tokenizer("char"), seed=3)
        rollout.load_weights(first)
        prompts = [[5, 17, 40, 9], [70, 3, 12]]
        samples = rollout.generate_batch(prompts, {"temperature": 1.0, "max_tokens": 6})
        assert sum(len(ids) for ids, _ in samples) > len(samples), samples  # tokens past the first to compare
        base_w = {n: t for n, t in own.items() if not is_adapter_name(n)}
        assert any(not torch.equal(first[n], base_w[n]) for n in base_w), "the merge changed nothing"
        rows = [torch.tensor(p + ids) for p, (ids, _) in zip(prompts, samples)]
        td = TensorDict({"input_ids": to_nested(rows),
                         "response_mask": to_nested([torch.ones(len(ids), dtype=torch.long) for ids, _ in samples])},
                        batch_size=[2])
        actor = eng.infer_batch(Share(td, [[0, 1]]))["log_probs"]
        for (ids, lps), got in zip(samples, actor.unbind()):
            # merged (W + s B A) vs factored (x W + s (x A) B) products: fp32 rounding of logits ~1e-6
            torch.testing.assert_close(torch.tensor(lps, dtype=torch.float32), got, rtol=0, atol=2e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.slow
def test_megatron_lora_equals_fsdp_lora_resumes_and_exports(torchrun, tmp_path):
    """megatron LoRA (TP2, PP2, PP2 x VPP2, TP2 x PP2; all-linear and a partial target list) against FSDP LoRA on
    the same seed and data; dropout keeps replicated adapters equal over TP; resume with the distributed optimizer;
    export merged + PEFT from its checkpoint."""
    import sys

    sys.path.insert(0, str(WORKER.parent))
    from megatron_common import MODEL

    from backends.megatron.checkpoint import read_model_weights

    ckpt = tmp_path / "ckpt"
    out = torchrun(WORKER.parent / "megatron_lora_worker.py", 4, "--path", str(ckpt), timeout=400)
    for case in ("tp=2 pp=1 vpp=1 dp=2", "tp=1 pp=2 vpp=1 dp=2", "tp=1 pp=2 vpp=2 dp=2", "tp=2 pp=2 vpp=1 dp=1",
                 "dropout tp=2", "checkpoint tp=2 pp=2 dist_opt=True resume == uninterrupted"):
        assert f"OK lora {case}" in out, f"{case} did not report OK:\n{out[-3000:]}"
    # the checkpoint (TP- and PP-sharded) reads back, in one process, as the engine's weights at the save
    saved = read_model_weights(str(ckpt), MODEL)
    expected = torch.load(ckpt / "expected_weights.pt")
    assert set(saved) == set(expected) and all(torch.equal(saved[n], expected[n]) for n in expected)
    base = dict(LlamaModel.from_seed(MODEL, 3).named_parameters())  # the worker's seed
    assert all(torch.equal(saved[n], base[n]) for n in base), "the checkpoint's base is the frozen start"
    targets = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
    _check_export(ckpt, tmp_path, MODEL, base, saved, rank=2, scale=4.0, targets=targets)

