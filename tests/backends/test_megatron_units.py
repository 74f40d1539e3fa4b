"""Megatron backend pieces that need no process group: CPU shim, weight converter, vocab-parallel log-probs,
micro-batch layout, config checks."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("megatron.core")

from backends.config import EngineConfig, MegatronConfig, OptimConfig  # noqa: E402
from protocol.algos.logprob import token_logprobs_and_entropy  # noqa: E402
from backends.megatron import cpu_shim  # noqa: E402
from backends.megatron.batch import ShareError, make_micro_batch, share_lengths  # noqa: E402
from backends.megatron.convert import (  # noqa: E402
    ConversionError, expected_project_names, from_megatron_shards, qkv_from_megatron, qkv_to_megatron,
    to_megatron_shard,
)
from backends.megatron.engine import check_engine_config  # noqa: E402
from backends.megatron.logprob import vocab_parallel_logprobs_entropy  # noqa: E402
from backends.megatron.model import MegatronModelError, check_model_fits, transformer_config  # noqa: E402
from backends.model.config import ModelConfig  # noqa: E402
from backends.model.llama import LlamaModel  # noqa: E402
from protocol.batch.nested import to_nested  # noqa: E402
from tensordict import TensorDict  # noqa: E402

SMALL = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=4, num_heads=4, num_kv_heads=2)


# ---------------------------------------------------------------------------------------------------- CPU shim
def test_cpu_shim_redirects_megatron_only():
    before_type, before_cuda = torch.Tensor.type, torch.Tensor.cuda
    assert cpu_shim.apply_cpu_shim(force=True)
    assert cpu_shim.shim_applied()
    from megatron.core import parallel_state
    from megatron.core.optimizer import clip_grads
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import random as tp_random

    for mod in (schedules, p2p_communication, clip_grads, parallel_state):
        assert mod.torch is not torch and mod.torch.__name__ == "torch", mod.__name__
        assert mod.__name__ in cpu_shim.patched_modules()
    proxy = schedules.torch
    # device redirection inside megatron-core
    assert proxy.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert proxy.cuda.current_device() == torch.device("cpu")
    proxy.cuda.synchronize()
    assert isinstance(proxy.tensor([1.0]), torch.Tensor) and proxy.Tensor is torch.Tensor
    state = tp_random._get_cuda_rng_state()
    assert torch.equal(state, torch.get_rng_state())
    # nothing else changes: torch itself, its CUDA namespace and Tensor methods are the originals
    import torch.nn.functional as F

    assert F.torch is torch if hasattr(F, "torch") else True
    assert torch.Tensor.type is before_type and torch.Tensor.cuda is before_cuda
    assert torch.zeros(1).type() == "torch.FloatTensor"
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            torch.zeros(1, device="cuda")
    # idempotent
    assert cpu_shim.apply_cpu_shim(force=True)


def test_cpu_shim_is_skipped_when_cuda_is_present(monkeypatch):
    from megatron.core.pipeline_parallel import schedules

    before = schedules.torch
    monkeypatch.setattr(cpu_shim, "_STATE", {"applied": False, "modules": set()})
    monkeypatch.setattr(cpu_shim, "needs_cpu_shim", lambda: False)
    assert cpu_shim.apply_cpu_shim() is False
    assert not cpu_shim.shim_applied() and schedules.torch is before


def test_cpu_shim_type_names_scoped_to_wrapped_calls():
    cpu_shim.apply_cpu_shim(force=True)
    seen = {}

    def probe(t):
        seen["type"] = t.type()
        seen["cuda"] = t.cuda() is t

    wrapped = cpu_shim._with_cuda_type_names(probe)
    wrapped(torch.zeros(2))
    assert seen == {"type": "torch.cuda.FloatTensor", "cuda": True}
    assert torch.zeros(2).type() == "torch.FloatTensor"
    assert torch.zeros(2, dtype=torch.bfloat16).type() == "torch.BFloat16Tensor"
    assert cpu_shim.needs_cpu_shim() == (not torch.cuda.is_available())


# ---------------------------------------------------------------------------------------------------- converter
def test_qkv_grouping_layout():
    cfg = SMALL  # 4 heads, 2 kv heads -> 2 q heads per group, head_dim 4
    hd = cfg.head_dim
    q = torch.arange(cfg.num_heads * hd, dtype=torch.float32)[:, None].expand(-1, cfg.hidden_size)
    k = 100 + torch.arange(cfg.num_kv_heads * hd, dtype=torch.float32)[:, None].expand(-1, cfg.hidden_size)
    v = 200 + torch.arange(cfg.num_kv_heads * hd, dtype=torch.float32)[:, None].expand(-1, cfg.hidden_size)
    qkv = qkv_to_megatron(q, k, v, cfg)
    rows = qkv[:, 0].tolist()
    # group 0: q heads 0,1 then k head 0 then v head 0; group 1: q heads 2,3, k head 1, v head 1
    want = list(range(0, 8)) + list(range(100, 104)) + list(range(200, 204)) + \
        list(range(8, 16)) + list(range(104, 108)) + list(range(204, 208))
    assert rows == want
    q2, k2, v2 = qkv_from_megatron(qkv, cfg)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


@settings(max_examples=15, deadline=None)
@given(tp=st.sampled_from([1, 2]), stages=st.sampled_from([1, 2, 4]), tie=st.booleans(), seed=st.integers(0, 99))
def test_converter_round_trip(tp, stages, tie, seed):
    """Splitting into TP shards and pipeline chunks, then merging, returns the original weights exactly."""
    cfg = dataclasses.replace(SMALL, tie_word_embeddings=tie)
    sd = LlamaModel.from_seed(cfg, seed).state_dict()
    per = cfg.num_layers // stages
    merged = {}
    for stage in range(stages):
        layers = list(range(stage * per, (stage + 1) * per))
        shards = [to_megatron_shard(sd, cfg, tp_rank=r, tp_size=tp, layers=layers, pre_process=stage == 0,
                                    post_process=stage == stages - 1) for r in range(tp)]
        if tie and stages > 1 and stage == stages - 1:
            assert "output_layer.weight" in shards[0]  # the last stage keeps its own copy of the embedding
        if tie and stages == 1:
            assert "output_layer.weight" not in shards[0]
        for s in shards:
            assert s["decoder.layers.0.mlp.linear_fc1.weight"].shape[0] == 2 * cfg.intermediate_size // tp
        part = from_megatron_shards(shards, cfg, layers=layers)
        assert not set(part) & set(merged)
        merged.update(part)
    assert sorted(merged) == sorted(expected_project_names(cfg))
    for k, v in sd.items():
        assert torch.equal(merged[k], v), k


def test_converter_fc1_is_gate_then_up_per_shard():
    sd = LlamaModel.from_seed(SMALL, 0).state_dict()
    shard = to_megatron_shard(sd, SMALL, tp_rank=1, tp_size=2, layers=[2], pre_process=False, post_process=False)
    fc1 = shard["decoder.layers.0.mlp.linear_fc1.weight"]
    half = SMALL.intermediate_size // 2
    assert torch.equal(fc1[:half], sd["layers.2.mlp.gate_proj.weight"][half:])
    assert torch.equal(fc1[half:], sd["layers.2.mlp.up_proj.weight"][half:])
    assert torch.equal(shard["decoder.layers.0.mlp.linear_fc2.weight"], sd["layers.2.mlp.down_proj.weight"][:, half:])
    assert "embedding.word_embeddings.weight" not in shard and "decoder.final_layernorm.weight" not in shard


def test_converter_errors_name_the_weight():
    sd = LlamaModel.from_seed(SMALL, 0).state_dict()
    bad = dict(sd)
    del bad["layers.1.mlp.up_proj.weight"]
    with pytest.raises(ConversionError, match="layers.1.mlp.up_proj.weight"):
        to_megatron_shard(bad, SMALL, tp_rank=0, tp_size=1, layers=[0], pre_process=True, post_process=True)
    bad = dict(sd)
    bad["embed_tokens.weight"] = torch.zeros(3, 3)
    with pytest.raises(ConversionError, match="embed_tokens.weight"):
        to_megatron_shard(bad, SMALL, tp_rank=0, tp_size=1, layers=[0], pre_process=True, post_process=True)
    with pytest.raises(ConversionError, match="layer index 9"):
        to_megatron_shard(sd, SMALL, tp_rank=0, tp_size=1, layers=[9], pre_process=True, post_process=True)
    with pytest.raises(ConversionError, match="at least one TP shard"):
        from_megatron_shards([], SMALL, layers=[0])


# ---------------------------------------------------------------------------------------------------- log-probs
@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 6), v=st.sampled_from([5, 16]), temp=st.sampled_from([1.0, 0.6]), seed=st.integers(0, 99))
def test_vocab_parallel_logprobs_match_full_softmax(n, v, temp, seed):
    """Unsharded path: log p = log_softmax(z/T)[t], H = -sum p log p, and gradients equal autograd's."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, v, generator=g) * 3).requires_grad_(True)
    t = torch.randint(0, v, (n,), generator=g)
    lp, ent = vocab_parallel_logprobs_entropy(z, t, temperature=temp, with_entropy=True)
    z2 = z.detach().clone().requires_grad_(True)
    ls = torch.log_softmax(z2 / temp, -1)
    lp2 = ls.gather(-1, t[:, None]).squeeze(-1)
    ent2 = -(ls.exp() * ls).sum(-1)
    assert torch.allclose(lp, lp2, atol=1e-6) and torch.allclose(ent, ent2, atol=1e-5)
    w1, w2 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    (lp * w1 + ent * w2).sum().backward()
    (lp2 * w1 + ent2 * w2).sum().backward()
    assert torch.allclose(z.grad, z2.grad, atol=1e-5)


def test_vocab_parallel_logprobs_errors_and_no_entropy():
    z = torch.randn(3, 4)
    lp, ent = vocab_parallel_logprobs_entropy(z, torch.tensor([0, 1, 3]))
    assert ent is None and lp.shape == (3,)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs_entropy(z, torch.tensor([0, 1, 3]), temperature=0.0)
    with pytest.raises(ValueError, match="logits must be"):
        vocab_parallel_logprobs_entropy(z, torch.tensor([0, 1]))


# ---------------------------------------------------------------------------------------------------- batches
def _share_data(prompt_lens, resp_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 32, (p + r,), generator=g) for p, r in zip(prompt_lens, resp_lens)]
    masks = [torch.ones(r, dtype=torch.long) for r in resp_lens]
    old = [torch.randn(r, generator=g) for r in resp_lens]
    return TensorDict({"input_ids": to_nested(ids), "response_mask": to_nested(masks),
                       "old_log_probs": to_nested(old)}, batch_size=[len(ids)])


@settings(max_examples=15, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 5)), min_size=1, max_size=5))
def test_micro_batch_padded_and_packed_pick_the_same_logits(lens):
    """Both layouts index, for every response token, the logits of the position before it (prompt_len + j - 1)."""
    data = _share_data([p for p, _ in lens], [r for _, r in lens])
    model = LlamaModel.from_seed(SMALL, 1)
    pos = list(range(len(lens)))
    padded = make_micro_batch(data, pos, response_fields=("old_log_probs",))
    packed_mb = make_micro_batch(data, pos, packed=True)
    # reference: packed forward of the project model
    ids = data["input_ids"]
    cu = ids.offsets().to(torch.int32)
    rl = torch.tensor([r for _, r in lens])
    with torch.no_grad():
        logits = model(ids.values(), packed_mb.position_ids[0], cu)
        want, _ = token_logprobs_and_entropy(logits, ids.values(), cu, rl)
        got_packed = torch.log_softmax(logits, -1).reshape(-1, SMALL.vocab_size)[packed_mb.logit_index]
        got_packed = got_packed.gather(-1, packed_mb.target_ids[:, None]).squeeze(-1)
    assert torch.allclose(got_packed, want, atol=1e-6)
    # padded layout: per row forward of each sample alone
    b, s = padded.input_ids.shape
    with torch.no_grad():
        rows = []
        for i, (p, r) in enumerate(lens):
            n = p + r
            row_logits = model(padded.input_ids[i, :n], torch.arange(n), torch.tensor([0, n], dtype=torch.int32))
            rows.append(torch.nn.functional.pad(row_logits, (0, 0, 0, s - n)))
        flat = torch.log_softmax(torch.stack(rows), -1).reshape(b * s, -1)[padded.logit_index]
        got = flat.gather(-1, padded.target_ids[:, None]).squeeze(-1)
    assert torch.allclose(got, want, atol=1e-5)
    assert padded.attention_mask.shape == (b, 1, s, s) and padded.attention_mask.dtype == torch.bool
    assert padded.fields["old_log_probs"].shape == (b, max(r for _, r in lens))
    assert padded.response_lens == [r for _, r in lens]


def test_micro_batch_mask_is_causal_and_hides_padding():
    data = _share_data([2, 1], [1, 1])
    mb = make_micro_batch(data, [0, 1])
    m = mb.attention_mask[:, 0]
    assert torch.equal(~m[0], torch.ones(3, 3, dtype=torch.bool).tril())
    assert (~m[1])[:, 2].sum() == 0 and (~m[1])[1, :2].all()  # row 1 has seq_len 2: key 2 is padding
    packed = make_micro_batch(data, [0, 1], packed=True, pad_to=(1, 9))
    assert packed.input_ids.shape == (1, 9)
    assert packed.packed_seq_params.cu_seqlens_q.tolist() == [0, 3, 5, 9]  # filler is its own sequence
    padded = make_micro_batch(data, [1], pad_to=(3, 4))
    assert padded.input_ids.shape == (3, 4) and padded.num_samples == 1
    assert padded.attention_mask[1:].all()  # extra rows attend to nothing
    with pytest.raises(ShareError, match="pad_to"):
        make_micro_batch(data, [0, 1], pad_to=(1, 4))


def test_micro_batch_errors_name_field_and_sample():
    data = _share_data([1, 2], [2, 1])
    with pytest.raises(ShareError, match="advantages"):
        make_micro_batch(data, [0, 1], response_fields=("advantages",))
    with pytest.raises(ShareError, match="at least one sample"):
        make_micro_batch(data, [])
    bad = TensorDict({"input_ids": to_nested([torch.tensor([1, 2])]),
                      "response_mask": to_nested([torch.tensor([1, 1])])}, batch_size=[1])
    with pytest.raises(ShareError, match="prompt_len"):
        share_lengths(bad)
    with pytest.raises(ShareError, match="response_mask"):
        share_lengths(TensorDict({"input_ids": to_nested([torch.tensor([1, 2])])}, batch_size=[1]))
    wrong = _share_data([1, 2], [2, 1])
    wrong["old_log_probs"] = to_nested([torch.zeros(3), torch.zeros(1)])
    with pytest.raises(ShareError, match="sample 0"):
        make_micro_batch(wrong, [0, 1], response_fields=("old_log_probs",))


# ---------------------------------------------------------------------------------------------------- config
def test_model_fit_checks_name_the_keys():
    with pytest.raises(MegatronModelError, match="num_kv_heads"):
        check_model_fits(SMALL, MegatronConfig(tp=4))
    with pytest.raises(MegatronModelError, match="num_layers"):
        check_model_fits(SMALL, MegatronConfig(pp=3))
    with pytest.raises(MegatronModelError, match="vpp"):
        check_model_fits(SMALL, MegatronConfig(vpp=2))
    with pytest.raises(MegatronModelError, match="vocab_size"):
        check_model_fits(dataclasses.replace(SMALL, vocab_size=33), MegatronConfig(tp=2))
    if not torch.cuda.is_available():
        with pytest.raises(MegatronModelError, match="cp"):
            check_model_fits(SMALL, MegatronConfig(cp=2))
    check_model_fits(SMALL, MegatronConfig(tp=2, pp=2))


def test_transformer_config_matches_project_architecture():
    cfg = transformer_config(SMALL, MegatronConfig(pp=2, vpp=2))
    assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and not cfg.add_bias_linear
    assert cfg.num_query_groups == SMALL.num_kv_heads and cfg.kv_channels == SMALL.head_dim
    assert cfg.ffn_hidden_size == SMALL.intermediate_size and cfg.layernorm_epsilon == SMALL.rms_norm_eps
    assert cfg.calculate_per_token_loss and cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0
    if not torch.cuda.is_available():
        assert cfg.batch_p2p_comm is False  # VPP over gloo
        assert cfg.variable_seq_lengths is False


def test_engine_config_checks():
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        check_engine_config(EngineConfig(model=SMALL, optim=OptimConfig(name="sgd")))
    with pytest.raises(ValueError, match="dynamic_cp"):
        check_engine_config(EngineConfig(model=SMALL, megatron=MegatronConfig(dynamic_cp=True)))
    with pytest.raises(ValueError, match="megatron.cp"):
        check_engine_config(EngineConfig(model=SMALL, megatron=MegatronConfig(cp=2)))
    with pytest.raises(ValueError, match="ep"):
        check_engine_config(EngineConfig(model=SMALL, megatron=MegatronConfig(ep=2)))
    check_engine_config(EngineConfig(model=SMALL, megatron=MegatronConfig(use_distributed_optimizer=False),
                                     optim=OptimConfig(name="sgd")))


def test_topology_must_match_the_megatron_section():
    from backends.megatron.engine import MegatronEngine, TopologyMismatch
    from dispatch.topology import Topology

    topo = Topology.from_config({"backend": "megatron", "tp": 2, "pp": 1}, 4)
    with pytest.raises(TopologyMismatch, match="topology.tp = 2 but megatron.tp = 1"):
        MegatronEngine._check_topology_config(topo, MegatronConfig(tp=1))
    fsdp = Topology.from_config({"backend": "fsdp", "ulysses_sp": 1, "fsdp_size": -1}, 4)
    with pytest.raises(TopologyMismatch, match="backend"):
        MegatronEngine._check_topology_config(fsdp, MegatronConfig())


def test_megatron_engine_is_registered():
    from backends.base import get_engine_class, known_engines

    assert "megatron" in known_engines()
    assert get_engine_class("megatron").__name__ == "MegatronEngine"


def test_a_checkpoint_without_adam_step_counts_is_refused_with_what_to_do():
    """A checkpoint from before the step counts were saved cannot resume the optimizer exactly: named, with the way
    out (export its weights, start from them)."""
    from backends.megatron.checkpoint import CheckpointError, _restore_adam_steps

    with pytest.raises(CheckpointError, match=r"'ckpt/step_3' holds no Adam step counts.*model\.hf_path"):
        _restore_adam_steps(None, None, "ckpt/step_3")
