"""The decoder: parameter layout, exact packed attention, formula checks, deterministic init and sampling."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from protocol.algos.logprob import entropy_from_logits, response_logit_positions, token_logprobs_and_entropy
from backends.model.attention import check_cu_seqlens, packed_attention
from backends.model.config import ModelConfig
from backends.model.generate import generate, sample_next
from backends.model.llama import LlamaModel, RMSNorm, apply_rotary, init_weights, rope_inv_freq, rotary_cos_sin

CFG = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)


def _pack(seqs):
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return ids, pos, cu


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_names_follow_hf_llama_layout(tied):
    cfg = ModelConfig(num_layers=2, tie_word_embeddings=tied)
    names = [n for n, _ in LlamaModel(cfg).named_parameters()]
    expected = ["embed_tokens.weight"]
    for i in range(2):
        expected += [f"layers.{i}.input_layernorm.weight"]
        expected += [f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"]
        expected += [f"layers.{i}.post_attention_layernorm.weight"]
        expected += [f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    expected += ["norm.weight"] + ([] if tied else ["lm_head.weight"])
    assert names == expected
    sd = LlamaModel(cfg).state_dict()
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size)


def test_init_is_deterministic_and_norms_are_one():
    a, b, c = LlamaModel.from_seed(CFG, 3), LlamaModel.from_seed(CFG, 3), LlamaModel.from_seed(CFG, 4)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if "norm" in n:
            assert torch.all(pa == 1)
        else:
            assert not torch.equal(pa, pc), n
            assert abs(pa.std().item() - CFG.init_std) < 0.5 * CFG.init_std
    m = LlamaModel(CFG)
    init_weights(m, 3)
    assert all(torch.equal(x, y) for x, y in zip(m.parameters(), a.parameters()))


@settings(max_examples=15, deadline=None)
@given(lens=st.lists(st.integers(1, 9), min_size=1, max_size=4), seed=st.integers(0, 1000),
       tied=st.booleans())
def test_packed_forward_equals_each_sequence_alone(lens, seed, tied):
    cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, tie_word_embeddings=tied)
    model = LlamaModel.from_seed(cfg, seed)
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    ids, pos, cu = _pack(seqs)
    with torch.no_grad():
        packed = model(ids, pos, cu)
        alone = torch.cat([model(*_pack([s])) for s in seqs])
    assert packed.shape == (sum(lens), cfg.vocab_size)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def _reference_forward(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    """One sequence through the architecture written out from the formulas (explicit mask, explicit GQA map)."""
    cfg = model.cfg
    T, d, h, hkv = ids.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    sd = model.state_dict()

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    inv = [cfg.rope_theta ** (-2 * i / d) for i in range(d // 2)]
    ang = torch.tensor([[p * f for f in inv] for p in range(T)], dtype=torch.float64)

    def rope(x):  # x [T, H, d]; pairs (i, i + d/2) rotate by angle p * inv[i]
        x1, x2 = x[..., : d // 2].double(), x[..., d // 2:].double()
        c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).float()

    x = sd["embed_tokens.weight"][ids]
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a = rms(x, sd[p + "input_layernorm.weight"])
        q = rope((a @ sd[p + "self_attn.q_proj.weight"].T).view(T, h, d))
        k = rope((a @ sd[p + "self_attn.k_proj.weight"].T).view(T, hkv, d))
        v = (a @ sd[p + "self_attn.v_proj.weight"].T).view(T, hkv, d)
        heads = []
        for hh in range(h):
            j = hh // (h // hkv)  # kv head j serves q heads [j*g, (j+1)*g)
            att = (q[:, hh] @ k[:, j].T) / math.sqrt(d) + mask
            heads.append(att.softmax(-1) @ v[:, j])
        x = x + torch.cat(heads, -1) @ sd[p + "self_attn.o_proj.weight"].T
        m = rms(x, sd[p + "post_attention_layernorm.weight"])
        gate = m @ sd[p + "mlp.gate_proj.weight"].T
        up = m @ sd[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    x = rms(x, sd["norm.weight"])
    w = sd["embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    return x @ w.T


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_forward_matches_formula_reference(kv):
    cfg = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=40, num_layers=2, num_heads=4,
                      num_kv_heads=kv, rope_theta=500.0)
    model = LlamaModel.from_seed(cfg, 11)
    with torch.no_grad():  # larger weights so every component matters
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            else:
                p.mul_(10)
    ids = torch.randint(0, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(*_pack([ids.tolist()]))
    torch.testing.assert_close(out, _reference_forward(model, ids), rtol=2e-4, atol=2e-4)


def test_rmsnorm_and_rotary_formulas():
    n = RMSNorm(6, 1e-6)
    with torch.no_grad():
        n.weight.copy_(torch.arange(1.0, 7.0))
    x = torch.randn(3, 6)
    torch.testing.assert_close(n(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * n.weight)
    pos = torch.tensor([0, 1, 5])
    cfg = ModelConfig(hidden_size=8, num_heads=2, num_kv_heads=2, rope_theta=100.0)
    cos, sin = rotary_cos_sin(pos, rope_inv_freq(cfg), torch.float32)
    x = torch.randn(3, 2, 4)
    out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(out[0], x[0])  # position 0 is the identity
    a = 5 * 100.0 ** (-2 / 4)  # second frequency at position 5 rotates the pair (1, 3)
    torch.testing.assert_close(out[2, :, 1], x[2, :, 1] * math.cos(a) - x[2, :, 3] * math.sin(a))
    torch.testing.assert_close(out[2, :, 3], x[2, :, 3] * math.cos(a) + x[2, :, 1] * math.sin(a))
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


def test_packed_attention_empty_segments_and_bad_offsets():
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    cu = torch.tensor([0, 2, 2, 5])
    out = packed_attention(q, k, v, cu)
    ref = torch.cat([packed_attention(q[:2], k[:2], v[:2], torch.tensor([0, 2])),
                     packed_attention(q[2:], k[2:], v[2:], torch.tensor([0, 3]))])
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out[0], v[0].repeat_interleave(2, 0))  # first token attends only to itself
    with pytest.raises(ValueError, match="cu_seqlens"):
        check_cu_seqlens(torch.tensor([0, 3, 2, 5]), 5)
    with pytest.raises(ValueError, match="packed length 5"):
        check_cu_seqlens(torch.tensor([0, 4]), 5)
    with pytest.raises(ValueError, match="multiple"):
        packed_attention(torch.randn(5, 3, 8), k, v, cu)
    model = LlamaModel(CFG)
    with pytest.raises(ValueError, match="1-D"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), torch.tensor([0, 3]))


def test_activation_checkpointing_gives_same_gradients():
    model = LlamaModel.from_seed(CFG, 0)
    ids, pos, cu = _pack([[1, 2, 3, 4], [5, 6, 7]])
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.activation_checkpointing = ckpt
        model(ids, pos, cu).logsumexp(-1).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@settings(max_examples=20, deadline=None)
@given(spec=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 5)), min_size=1, max_size=4),
       temp=st.floats(0.3, 2.0))
def test_token_logprobs_use_shifted_logits(spec, temp):
    """Response token j of a sample with prompt_len P is scored by the logits at P + j - 1."""
    V = 7
    seqs, rls = [], []
    for p, r in spec:
        seqs.append(list(range(p + r)))
        rls.append(r)
    ids, _, cu = _pack([[t % V for t in s] for s in seqs])
    logits = torch.randn(ids.shape[0], V, generator=torch.Generator().manual_seed(len(spec)))
    lp, ent = token_logprobs_and_entropy(logits, ids, cu, rls, temperature=temp, with_entropy=True)
    exp_lp, exp_ent = [], []
    for i, (p, r) in enumerate(spec):
        s = int(cu[i])
        for j in range(r):
            row = torch.log_softmax(logits[s + p + j - 1] / temp, -1)
            exp_lp.append(row[ids[s + p + j]])
            exp_ent.append(-(row.exp() * row).sum())
    assert lp.shape == ent.shape == (sum(rls),)
    if exp_lp:
        torch.testing.assert_close(lp, torch.stack(exp_lp))
        torch.testing.assert_close(ent, torch.stack(exp_ent), rtol=1e-5, atol=1e-5)
    assert token_logprobs_and_entropy(logits, ids, cu, rls)[1] is None


def test_token_logprobs_errors():
    ids, _, cu = _pack([[1, 2, 3]])
    with pytest.raises(ValueError, match="prompt_len >= 1"):
        response_logit_positions(cu, [3])
    with pytest.raises(ValueError, match="2 entries"):
        response_logit_positions(cu, [1, 1])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(torch.randn(3, 5), ids, cu, [1], temperature=0)
    with pytest.raises(ValueError, match="logits"):
        token_logprobs_and_entropy(torch.randn(3), ids, cu, [1])
    z = torch.randn(4, 9)
    torch.testing.assert_close(entropy_from_logits(z), torch.distributions.Categorical(logits=z).entropy())


def test_generate_reproducible_eos_and_logprobs_match_recompute():
    model = LlamaModel.from_seed(CFG, 1)
    prompts = [[1, 2, 3], [4], [5, 6]]
    out1, lp1 = generate(model, prompts, 6, temperature=0.7, seed=5)
    out2, lp2 = generate(model, prompts, 6, temperature=0.7, seed=5)
    assert out1 == out2 and lp1 == lp2
    assert all(len(o) == 6 for o in out1) and all(len(o) == len(l) for o, l in zip(out1, lp1))
    ids, pos, cu = _pack([p + o for p, o in zip(prompts, out1)])
    with torch.no_grad():
        ref, _ = token_logprobs_and_entropy(model(ids, pos, cu), ids, cu, [6] * 3, temperature=0.7)
    torch.testing.assert_close(torch.tensor([x for l in lp1 for x in l]), ref, rtol=1e-5, atol=1e-5)
    eos = out1[0][1]
    out3, lp3 = generate(model, prompts, 6, temperature=0.7, seed=5, eos_token_id=eos)
    assert out3[0] == out1[0][:2]  # stops right after the first EOS, keeping it
    for o in out3:
        assert eos not in o[:-1] and (o[-1] == eos or len(o) == 6)
    greedy, _ = generate(model, [[1, 2, 3]], 3, temperature=0.0)
    with torch.no_grad():
        first = model(*_pack([[1, 2, 3]]))[-1].argmax().item()
    assert greedy[0][0] == first
    for bad, match in (({"max_new_tokens": -1}, "max_new_tokens"), ({"top_p": 0.0}, "top_p"),
                       ({"temperature": -1.0}, "temperature")):
        kw = {"max_new_tokens": 2, **bad}
        with pytest.raises(ValueError, match=match):
            generate(model, prompts, **kw)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1], []], 2)


@pytest.mark.parametrize("tied,arch", [(False, {}), (True, {}), (True, dict(model_type="qwen2", qkv_bias=True)),
                                       (False, dict(model_type="qwen3", qk_norm=True, head_dim=12, rope_type="llama3",
                                                    rope_factor=4.0, rope_original_max_position_embeddings=16))])
def test_kv_cached_decode_matches_full_recompute(tied, arch):
    cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, tie_word_embeddings=tied, **arch)
    model = LlamaModel.from_seed(cfg, 2)
    with torch.no_grad():  # biases and norms away from their 0 / 1 init so the cached path must apply them
        for n, p in model.named_parameters():
            if n.endswith(".bias") or "_norm." in n:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.3)
    prompts = [[1, 2, 3, 4, 5], [6], [7, 8]]
    greedy_c, lp_c = generate(model, prompts, 7, temperature=0.0)
    greedy_n, lp_n = generate(model, prompts, 7, temperature=0.0, use_cache=False)
    assert greedy_c == greedy_n
    torch.testing.assert_close(torch.tensor(lp_c), torch.tensor(lp_n), rtol=1e-5, atol=1e-5)
    out, lp = generate(model, prompts, 9, temperature=1.3, top_p=0.9, seed=3)
    ids, pos, cu = _pack([p + o for p, o in zip(prompts, out)])
    with torch.no_grad():
        ref, _ = token_logprobs_and_entropy(model(ids, pos, cu), ids, cu, [len(o) for o in out], temperature=1.3)
    torch.testing.assert_close(torch.tensor([x for l in lp for x in l]), ref, rtol=1e-5, atol=1e-5)


def test_sample_next_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]])).repeat(400, 1)
    tok, lp = sample_next(logits, 1.0, 0.8, torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {0, 1}
    torch.testing.assert_close(lp, torch.log(torch.tensor([0.6, 0.3]))[tok])


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sample_next_draws_each_token_with_its_probability(top_p):
    """Token frequencies over many rows match softmax(logits / T) (renormalised over the nucleus): each count lies
    within 5 binomial standard deviations of n * p; a token of probability 0 is never drawn."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    n, temperature = 20000, 0.5
    logits = (torch.log(p) * temperature).repeat(n, 1)  # softmax(logits / T) = p
    tok, _ = sample_next(logits, temperature, top_p, torch.Generator().manual_seed(1))
    want = p if top_p == 1.0 else torch.tensor([0.5, 0.25, 0.15, 0.0, 0.0]) / 0.9
    counts = torch.bincount(tok, minlength=5).double()
    sd = (n * want * (1 - want)).sqrt()
    assert counts[want == 0].sum() == 0
    assert ((counts - n * want).abs() <= 5 * sd + 1e-9).all(), (counts, n * want)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_sample_next_refuses_non_finite_logits(bad):
    """A row without a distribution (nan or inf logits) is an error naming it, never a silently drawn token."""
    logits = torch.zeros(3, 5)
    logits[1, 2] = bad
    for top_p in (1.0, 0.8):
        with pytest.raises(RuntimeError, match=r"rows \[1\] are nan, inf or all zero"):
            sample_next(logits, 1.0, top_p, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sample_next_draws_alike_when_the_logits_differ_slightly(top_p):
    """Two backends' logits differ by float rounding (TP=2 against one rank): with the same generator state they
    must draw the same tokens but for near-ties. A race whose noise belongs to each vocabulary entry changes a draw
    only where two perturbed scores tie within the difference. Measured on these rows: an inverted CDF moves 16 of
    4000 draws, and noise indexed by rank among the sorted probabilities (the earlier top-p path, which drew with
    ``torch.multinomial`` over the sorted nucleus) 119 with top-p 0.9; this sampler moves none."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 2000, generator=g)
    shifted = logits + torch.randn(logits.shape, generator=g) * 1e-4
    a, _ = sample_next(logits, 0.7, top_p, torch.Generator().manual_seed(5))
    b, _ = sample_next(shifted, 0.7, top_p, torch.Generator().manual_seed(5))
    assert (a != b).sum() <= 4
