"""Llama 3 (llama3 / linear rope), Qwen2 (q/k/v bias), Qwen3 (q/k norm, head_dim != hidden/heads), Mistral: exact vs transformers.

Tiny random checkpoints are written by transformers itself (``save_pretrained``) with weights scaled so the logits are
far from uniform (near-uniform logits hide rotary and norm bugs). The project's model must give transformers' own
per-token log-probs (fp32, eager attention) on single and packed rows, on one process and on the Megatron engine
with TP=2 x PP=2; what the model cannot represent is refused by name.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

transformers = pytest.importorskip("transformers")

from backends.megatron.convert import from_megatron_shards, to_megatron_shard  # noqa: E402
from backends.model.config import ModelConfig  # noqa: E402
from backends.model.hf import (  # noqa: E402
    HFCheckpointError, config_from_hf, convert_hf_state_dict, hf_config_dict, load_hf_checkpoint, read_hf_config,
    to_hf_state_dict,
)
from backends.model.llama import LlamaModel, rope_inv_freq  # noqa: E402

V = 96
# fp32: a log-prob is a difference of logits |z| <= ~20 after ~10 float32 reductions (2^-24 relative each)
LOGPROB_TOL = 1e-5
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, initializer_range=0.3)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ARCHS = {  # name -> (config class name, kwargs, ModelConfig fields the checkpoint must map to)
    "llama3": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE),
               dict(model_type="llama", rope_type="llama3", rope_theta=500000.0, rope_factor=8.0,
                    rope_original_max_position_embeddings=64, tie_word_embeddings=False)),
    "llama_linear_tied": ("LlamaConfig", dict(tie_word_embeddings=True,
                                              rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                               "factor": 2.0}),
                          dict(rope_type="linear", rope_factor=2.0, tie_word_embeddings=True)),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                   dict(model_type="qwen2", qkv_bias=True, rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(hidden_size=32, head_dim=16,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
              dict(model_type="qwen3", qk_norm=True, head_dim=16, hidden_size=32, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(sliding_window=None), dict(model_type="mistral", head_dim=16)),
}
SEQS = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)) for n in (23, 7, 15, 1)]


def _pack(seqs):
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return ids, pos, cu


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[t+1] | ids[..t]) for each t of one sequence."""
    return torch.log_softmax(logits[:-1].double(), -1).gather(1, ids[1:, None])[:, 0]


def _build(name: str, path) -> torch.nn.Module:
    cls_name, kwargs, _ = ARCHS[name]
    hf_cfg = getattr(transformers, cls_name)(**{**COMMON, **kwargs})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # norms and biases away from their 1 / 0 init, so every one of them matters
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(str(path))
    return model


def _hf_logprobs(model, seqs) -> list[torch.Tensor]:
    with torch.no_grad():
        return [_token_logprobs(model(s[None]).logits[0], s) for s in seqs]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint folder, transformers model)."""
    root = tmp_path_factory.mktemp("hf")
    return {name: (str(root / name), _build(name, root / name)) for name in ARCHS}


@pytest.mark.parametrize("name", list(ARCHS))
def test_logprobs_match_transformers_single_and_packed(checkpoints, name):
    path, hf = checkpoints[name]
    cfg = read_hf_config(path)
    for key, want in ARCHS[name][2].items():
        assert getattr(cfg, key) == want, (key, getattr(cfg, key), want)
    ours = load_hf_checkpoint(path)
    ref = _hf_logprobs(hf, SEQS)
    with torch.no_grad():
        single = _token_logprobs(ours(*_pack(SEQS[:1])), SEQS[0])
        logits = ours(*_pack(SEQS))
        hf_logits = hf(SEQS[0][None]).logits[0]
    assert float((single - ref[0]).abs().max()) <= LOGPROB_TOL
    cu = _pack(SEQS)[2].tolist()
    packed = [_token_logprobs(logits[a:b], s) for a, b, s in zip(cu[:-1], cu[1:], SEQS)]
    worst = max(float((p - r).abs().max()) if r.numel() else 0.0 for p, r in zip(packed, ref))
    assert worst <= LOGPROB_TOL, worst
    lp = torch.log_softmax(hf_logits.double(), -1)  # far from uniform: entropy well below log V
    assert float(-(lp.exp() * lp).sum(-1).mean()) < 0.75 * math.log(V)


def test_rope_fields_are_not_dropped(checkpoints):
    """The transformers-5 case: rope_theta lives only in ``rope_parameters``; reading it as 10000 or dropping the
    llama3 scaling moves log-probs by far more than the tolerance."""
    path, hf = checkpoints["llama3"]
    raw = json.load(open(f"{path}/config.json"))
    assert "rope_theta" not in raw and raw["rope_parameters"]["rope_theta"] == 500000.0
    cfg = read_hf_config(path)
    assert (cfg.rope_theta, cfg.rope_type, cfg.rope_factor) == (500000.0, "llama3", 8.0)
    assert dataclasses.replace(config_from_hf(raw), hf_path=path) == cfg  # the hand reader agrees
    ref = torch.cat(_hf_logprobs(hf, SEQS[:1]))
    sd = load_hf_checkpoint(path).state_dict()
    for wrong in (dict(rope_theta=10000.0), dict(rope_type="default", rope_factor=1.0,
                                                  rope_original_max_position_embeddings=8192)):
        model = LlamaModel(dataclasses.replace(cfg, **wrong))
        model.load_state_dict(sd)
        with torch.no_grad():
            got = _token_logprobs(model(*_pack(SEQS[:1])), SEQS[0])
        assert float((got - ref).abs().max()) > 1e-2, wrong


def test_hand_reader_equals_autoconfig_in_both_spellings(checkpoints, tmp_path, monkeypatch):
    """Without transformers, config.json is read by hand: the transformers-5 spelling and the transformers-4 one
    (``rope_theta`` + ``rope_scaling`` with ``type`` or ``rope_type``) give the same ModelConfig as AutoConfig."""
    auto = {name: read_hf_config(path) for name, (path, _) in checkpoints.items()}
    v4_dirs = {}
    for name, (path, _) in checkpoints.items():
        raw = json.load(open(f"{path}/config.json"))
        rope = raw.pop("rope_parameters")
        raw["rope_theta"] = rope.pop("rope_theta")
        if rope["rope_type"] != "default":
            raw["rope_scaling"] = {("type" if name == "llama_linear_tied" else "rope_type"): rope.pop("rope_type"),
                                   **rope}
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
        v4_dirs[name] = str(tmp_path / name)
    for name, d in v4_dirs.items():
        assert dataclasses.replace(read_hf_config(d), hf_path="") == dataclasses.replace(auto[name], hf_path="")
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    for name, (path, _) in checkpoints.items():
        assert read_hf_config(path) == auto[name], name
        assert dataclasses.replace(read_hf_config(v4_dirs[name]), hf_path="") == \
            dataclasses.replace(auto[name], hf_path="")


def test_export_mapping_round_trips(checkpoints, tmp_path):
    """hf_config_dict / to_hf_state_dict invert the readers; transformers reads the written config.json."""
    for name, (path, hf) in checkpoints.items():
        cfg = read_hf_config(path)
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
        assert read_hf_config(str(out)) == dataclasses.replace(cfg, hf_path=str(out))
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(sys.modules, "transformers", None)
            assert read_hf_config(str(out)) == dataclasses.replace(cfg, hf_path=str(out))
        sd = load_hf_checkpoint(path).state_dict()
        back = to_hf_state_dict(sd, cfg)
        hf_sd = {k: v for k, v in hf.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        assert sorted(back) == sorted(hf_sd), name
        assert all(torch.equal(back[k], hf_sd[k]) for k in back)
        assert convert_hf_state_dict(back, cfg).keys() == sd.keys()


def _write(tmp_path, cfg: dict) -> str:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("cfg,match", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 4096},
     r"model_type='mistral'.*sliding_window=4096"),
    ({"model_type": "mistral"}, r"sliding_window=4096"),  # transformers' default window is in use
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
     r"model_type='qwen2'.*layer_types=\['full_attention', 'sliding_attention'\]|max_window_layers=1"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type='yarn'"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "weird", "rope_theta": 1e4}}, r"rope_type='weird'"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     r"rope_type='dynamic'"),
    ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]},
     r"model_type='gemma2' is not supported.*\['llama', 'mistral', 'qwen2', 'qwen3'\]"),
    ({"model_type": "qwen2_moe", "num_experts": 4}, r"model_type='qwen2_moe' is not supported"),
    ({"model_type": "llama", "attention_bias": True}, r"model_type='llama'.*attention_bias=true"),
    ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
    ({"model_type": "qwen3", "hidden_act": "gelu"}, r"model_type='qwen3'.*hidden_act='gelu'"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, r"model_type='llama'.*(without \['factor'\]|required keys.*'factor')"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                 "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
    ({"model_type": "llama", "num_local_experts": 8}, "mixture of experts"),
])
@pytest.mark.parametrize("reader", ["transformers", "hand"])
def test_unrepresentable_checkpoints_are_refused(tmp_path, monkeypatch, cfg, match, reader):
    if reader == "hand":
        monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(HFCheckpointError, match=match):
        read_hf_config(_write(tmp_path / "c", {**BASE, **cfg}))


def test_full_attention_sliding_settings_are_accepted(tmp_path):
    """Qwen2 keeps a ``sliding_window`` value with ``use_sliding_window: false``; Mistral with ``null`` is full."""
    cfg = read_hf_config(_write(tmp_path / "q", {**BASE, "model_type": "qwen2", "sliding_window": 4096,
                                                 "use_sliding_window": False, "rope_theta": 1e6}))
    assert cfg.qkv_bias and cfg.rope_theta == 1e6
    assert read_hf_config(_write(tmp_path / "m", {**BASE, "model_type": "mistral", "sliding_window": None}))


@settings(max_examples=20, deadline=None)
@given(theta=st.sampled_from([1e4, 5e5, 1e6]), factor=st.floats(1.5, 32), low=st.floats(0.5, 2.0),
       span=st.floats(0.5, 6.0), orig=st.sampled_from([16, 64, 8192]), d=st.sampled_from([8, 16, 64, 128]))
def test_llama3_frequencies_equal_transformers(theta, factor, low, span, orig, d):
    """rope_inv_freq is transformers' llama3 formula; each frequency lies between f / factor and f."""
    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": low + span, "original_max_position_embeddings": orig}
    hf_cfg = transformers.LlamaConfig(hidden_size=d * 2, num_attention_heads=2, rope_parameters=rope)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    want, scale = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    cfg = config_from_hf(hf_cfg.to_dict())
    got = rope_inv_freq(cfg)
    assert scale == 1.0
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    plain = rope_inv_freq(dataclasses.replace(cfg, rope_type="default", rope_factor=1.0, rope_low_freq_factor=1.0,
                                              rope_high_freq_factor=4.0, rope_original_max_position_embeddings=8192))
    assert torch.all(got <= plain * (1 + 1e-6)) and torch.all(got >= plain / factor * (1 - 1e-6))


def test_linear_rope_divides_every_frequency():
    base = ModelConfig(hidden_size=64, num_heads=4, rope_theta=5e5)
    lin = dataclasses.replace(base, rope_type="linear", rope_factor=4.0)
    torch.testing.assert_close(rope_inv_freq(lin), rope_inv_freq(base) / 4.0, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_megatron_converter_round_trips_bias_and_qk_norm(kind):
    """TP=2 shards of every PP=2 stage convert back to the same weights, q/k/v biases and q/k norms included."""
    extra = dict(qkv_bias=True) if kind == "qwen2" else dict(qk_norm=True, head_dim=12)
    cfg = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2,
                      model_type=kind, tie_word_embeddings=kind == "qwen2", **extra)
    model = LlamaModel.from_seed(cfg, 0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    sd = model.state_dict()
    back: dict = {}
    for stage, layers in enumerate(([0, 1], [2, 3])):
        shards = [to_megatron_shard(sd, cfg, tp_rank=r, tp_size=2, layers=layers, pre_process=stage == 0,
                                    post_process=stage == 1) for r in range(2)]
        names = set(shards[0])
        assert ("decoder.layers.0.self_attention.linear_qkv.bias" in names) == cfg.qkv_bias
        assert ("decoder.layers.1.self_attention.q_layernorm.weight" in names) == cfg.qk_norm
        back.update(from_megatron_shards(shards, cfg, layers=layers))
    assert sorted(back) == sorted(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_model_config_refuses_inconsistent_fields():
    for kw, match in ((dict(qk_norm=True), r"qk_norm=True does not match model.model_type='llama'.*\['qwen3'\]"),
                      (dict(model_type="qwen2"), r"qkv_bias=False does not match model.model_type='qwen2'"),
                      (dict(model_type="gpt2"), "model.model_type='gpt2'"),
                      (dict(rope_factor=2.0), "rope_factor=2.0 has no effect"),
                      (dict(rope_type="linear", rope_low_freq_factor=2.0), "only apply to model.rope_type='llama3'"),
                      (dict(rope_type="llama3", rope_low_freq_factor=4.0), "rope_low_freq_factor < model.rope_high"),
                      (dict(rope_type="ntk"), "model.rope_type='ntk'"),
                      (dict(hidden_size=30, num_heads=4), "set model.head_dim"),
                      (dict(head_dim=7), "even")):
        with pytest.raises(ValueError, match=match):
            ModelConfig(**kw)
    assert ModelConfig(hidden_size=30, num_heads=4, head_dim=8).head_dim == 8
    assert ModelConfig(hidden_size=64, num_heads=4).head_dim == 16


@pytest.mark.dist
@pytest.mark.slow
def test_megatron_tp2_pp2_matches_transformers(checkpoints, torchrun):
    """One 4-rank launch: Megatron TP=2 x PP=2 log-probs == transformers per architecture; weights round-trip."""
    pytest.importorskip("megatron.core")
    names = ["llama3", "llama_linear_tied", "qwen2_tied", "qwen3"]
    for name in names:
        path, hf = checkpoints[name]
        seqs = SEQS[:3]
        resp = [len(s) // 2 for s in seqs]
        ref = [lp[len(s) - r - 1:] for lp, s, r in zip(_hf_logprobs(hf, seqs), seqs, resp)]
        torch.save({"sequences": [s.tolist() for s in seqs], "response_lens": resp,
                    "log_probs": [r.float() for r in ref]}, f"{path}/reference.pt")
    out = torchrun("megatron_hf_worker.py", 4, *[checkpoints[n][0] for n in names], timeout=300)
    for name in names:
        assert f"OK {name} tp=2 pp=2" in out, out
    print("\n".join(line for line in out.splitlines() if line.startswith("OK")))  # the measured differences (-s)
