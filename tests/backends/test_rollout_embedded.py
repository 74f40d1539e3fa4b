"""The embedded rollout engine: sampling, weight sync, reproducibility and batching of concurrent async requests."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from backends.model.config import ModelConfig
from backends.model.llama import LlamaModel
from protocol.rollout.tokenizer import CharTokenizer
from backends.rollout import EmbeddedEngine, RolloutError, SamplingParams
from rldispatch.rollout import run_to_end

TOK = CharTokenizer()
CFG = ModelConfig()
PROMPTS = [TOK.apply_chat_template([{"role": "user", "content": f"copy: {w}"}]) for w in ("abc", "dcba", "bb")]


def recompute_logprobs(model: LlamaModel, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log p(response token j) from the logits at position prompt_len + j - 1 of one packed forward."""
    seq = prompt + response
    cu = torch.tensor([0, len(seq)], dtype=torch.int32)
    with torch.no_grad():
        logits = model(torch.tensor(seq), torch.arange(len(seq)), cu).float()
    lp = torch.log_softmax(logits / temperature, -1)
    p = len(prompt)
    return lp[p - 1:p - 1 + len(response)].gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_generate_logprobs_match_a_recompute_and_stop_at_eos():
    w = EmbeddedEngine(CFG, TOK, seed=0)
    for temperature in (1.0, 0.7):
        ids, lps = w.generate(PROMPTS[0], {"temperature": temperature, "max_tokens": 12})
        assert 1 <= len(ids) <= 12 and len(lps) == len(ids)
        assert TOK.eos_token_id not in ids[:-1]  # eos, when sampled, is the last token
        want = recompute_logprobs(w.model, PROMPTS[0], ids, temperature)
        assert torch.allclose(torch.tensor(lps), want, atol=1e-5)


def test_eos_ends_generation():
    w = EmbeddedEngine(CFG, TOK, seed=0)
    with torch.no_grad():  # make eos by far the most likely next token
        w.model.lm_head.weight.zero_()
        w.model.lm_head.weight[TOK.eos_token_id] = 1.0
        w.model.norm.weight.fill_(50.0)
    ids, _ = w.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=10))
    assert ids == [TOK.eos_token_id]


def test_reproducible_from_seed_and_rank():
    a = EmbeddedEngine(CFG, TOK, seed=3, rank=0).generate_batch(PROMPTS, {"max_tokens": 8})
    b = EmbeddedEngine(CFG, TOK, seed=3, rank=0).generate_batch(PROMPTS, {"max_tokens": 8})
    c = EmbeddedEngine(CFG, TOK, seed=3, rank=1).generate_batch(PROMPTS, {"max_tokens": 8})
    assert a == b and a != c
    w = EmbeddedEngine(CFG, TOK, seed=3)
    first = w.generate_batch(PROMPTS, {"max_tokens": 8})
    assert w.generate_batch(PROMPTS, {"max_tokens": 8}) != first  # the stream advances
    w.reseed(3, 0)
    assert w.generate_batch(PROMPTS, {"max_tokens": 8}) == first


def test_greedy_ignores_the_seed_and_top_p_tiny_is_greedy():
    g0 = EmbeddedEngine(CFG, TOK, seed=0).generate_batch(PROMPTS, {"temperature": 0.0, "max_tokens": 6})
    g1 = EmbeddedEngine(CFG, TOK, seed=9).generate_batch(PROMPTS, {"temperature": 0.0, "max_tokens": 6})
    tp = EmbeddedEngine(CFG, TOK, seed=5).generate_batch(PROMPTS, {"temperature": 1.0, "top_p": 1e-6,
                                                                   "max_tokens": 6})
    assert [t for t, _ in g0] == [t for t, _ in g1] == [t for t, _ in tp]


def test_load_weights_syncs_the_policy():
    actor = LlamaModel.from_seed(CFG, seed=42)
    w = EmbeddedEngine(CFG, TOK, seed=0)
    assert w.weights_version == 0
    w.load_weights(actor.state_dict())
    assert w.weights_version == 1
    for k, v in actor.state_dict().items():
        assert torch.equal(w.get_weights()[k], v)
    ids, lps = w.generate(PROMPTS[2], {"max_tokens": 6})
    assert torch.allclose(torch.tensor(lps), recompute_logprobs(actor, PROMPTS[2], ids, 1.0), atol=1e-5)
    w.load_weights(actor.state_dict(), version=7)
    assert w.weights_version == 7
    sd = dict(actor.state_dict())
    sd.pop("norm.weight")
    with pytest.raises(RolloutError, match=r"missing \['norm.weight'\]"):
        w.load_weights(sd)
    sd = dict(actor.state_dict(), extra=torch.zeros(1))
    with pytest.raises(RolloutError, match=r"unexpected \['extra'\]"):
        w.load_weights(sd)
    sd = dict(actor.state_dict(), **{"norm.weight": torch.ones(3)})
    with pytest.raises(RolloutError, match=r"norm.weight has shape \(3,\)"):
        w.load_weights(sd)


def test_sampling_params_validation():
    assert SamplingParams.from_any(None) == SamplingParams()
    assert SamplingParams.from_any({"max_new_tokens": 5}).max_tokens == 5
    for bad, msg in (({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                     ({"max_tokens": 2.5}, "max_tokens"), ({"beams": 2}, r"unknown sampling parameter\(s\) \['beams'\]"),
                     ({"max_tokens": 3, "max_new_tokens": 4}, "disagree")):
        with pytest.raises(RolloutError, match=msg):
            SamplingParams.from_any(bad)
    with pytest.raises(RolloutError, match="mapping"):
        SamplingParams.from_any([1])


def test_bad_prompts_and_construction():
    w = EmbeddedEngine(CFG, TOK)
    with pytest.raises(RolloutError, match="prompt_ids is empty"):
        w.generate([])
    with pytest.raises(RolloutError, match=r"prompt token 1 is 500, expected an int in \[0, 128\)"):
        w.generate([1, 500])
    with pytest.raises(RolloutError, match="must be a list of token ids"):
        w.generate("abc")
    small = EmbeddedEngine(ModelConfig(max_position_embeddings=8), TOK)
    with pytest.raises(RolloutError, match="exceeds model.max_position_embeddings 8"):
        small.generate([1, 2, 3], {"max_tokens": 6})
    with pytest.raises(RolloutError, match="model_cfg"):
        EmbeddedEngine({"vocab_size": 128}, TOK)
    with pytest.raises(RolloutError, match=r"128 tokens but the model's embedding has 64 rows \(model.vocab_size\)"):
        EmbeddedEngine(ModelConfig(vocab_size=64), TOK)
    assert w.generate_batch([]) == []


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 12), max_tokens=st.integers(1, 6), seed=st.integers(0, 100))
def test_agenerate_batches_concurrent_requests_like_generate_batch(n, max_tokens, seed):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    params = {"temperature": 1.0, "max_tokens": max_tokens}
    w = EmbeddedEngine(CFG, TOK, seed=seed)

    async def main():
        return await asyncio.gather(*[w.agenerate(p, params) for p in prompts])

    got = asyncio.run(main())
    assert w.batch_sizes == [n]  # one batched generate call for all requests of the tick
    want = EmbeddedEngine(CFG, TOK, seed=seed).generate_batch(prompts, params)
    assert [tuple(map(tuple, r)) for r in got] == [tuple(map(tuple, r)) for r in want]


def test_agenerate_groups_by_sampling_params_and_truncates_budgets():
    w = EmbeddedEngine(CFG, TOK, seed=1, max_batch_size=3)

    async def main():
        hot = [w.agenerate(PROMPTS[0], {"temperature": 1.0, "max_tokens": m}) for m in (2, 5, 7, 7)]
        greedy = [w.agenerate(PROMPTS[1], {"temperature": 0.0, "max_tokens": 4}) for _ in range(2)]
        return await asyncio.gather(*hot, *greedy)

    res = asyncio.run(main())
    assert sorted(w.batch_sizes) == [1, 2, 3]  # 4 hot requests in chunks of 3 + 1, 2 greedy ones
    assert [len(t) <= m for (t, _), m in zip(res, (2, 5, 7, 7, 4, 4))] == [True] * 6
    assert res[4] == res[5]


def test_agenerate_serves_requests_arriving_while_a_batch_runs():
    w = EmbeddedEngine(CFG, TOK, seed=0)

    async def session(delay_ticks: int):
        for _ in range(delay_ticks):
            await asyncio.sleep(0)
        first, _ = await w.agenerate(PROMPTS[0], {"max_tokens": 3})
        second, _ = await w.agenerate(PROMPTS[0] + first, {"max_tokens": 3})  # a second turn
        return first, second

    async def main():
        return await asyncio.gather(*[session(0) for _ in range(4)])

    out = asyncio.run(main())
    assert len(out) == 4 and w.batch_sizes == [4, 4]


def test_agenerate_error_reaches_every_waiter_and_worker_recovers():
    w = EmbeddedEngine(CFG, TOK, seed=0)
    good = {k: v.clone() for k, v in w.model.state_dict().items()}
    w.load_weights({k: torch.full_like(v, math.nan) for k, v in good.items()})

    async def main():
        return await asyncio.gather(*[w.agenerate(PROMPTS[0], {"max_tokens": 3}) for _ in range(3)],
                                    return_exceptions=True)

    res = asyncio.run(main())
    assert len(res) == 3 and all(isinstance(r, RuntimeError) for r in res)
    w.load_weights(good)
    ok = asyncio.run(main())
    assert all(isinstance(r, tuple) for r in ok)


def test_agenerate_rejects_bad_input_before_queueing():
    w = EmbeddedEngine(CFG, TOK)

    async def main():
        await w.agenerate([], {"max_tokens": 3})

    with pytest.raises(RolloutError, match="agenerate: prompt_ids is empty"):
        asyncio.run(main())
    assert w.batch_sizes == []


def test_single_turn_agent_loop_drives_the_worker():
    from protocol.rollout.agent_loop import run_groups, build_agent_loop
    from protocol.store.keys import new_uid
    from protocol.store import LocalStore

    w = EmbeddedEngine(CFG, TOK, seed=0)
    loop = build_agent_loop("single_turn", w.agenerate, TOK, max_response_length=6)
    store = LocalStore()
    uids = [new_uid() for _ in range(3)]
    prompts = [[{"role": "user", "content": f"copy: {s}"}] for s in ("ab", "cd", "abc")]
    metas = asyncio.run(run_groups(store, uids, prompts, 4, loop, global_steps=1,
                                   sampling_params={"temperature": 1.0, "max_tokens": 6}))
    assert w.batch_sizes == [12]  # 3 groups x 4 sessions in one batch
    assert sum(len(m.keys) for m in metas) == 12
    td = store.kv_batch_get(metas[0].keys, "train", ["responses", "rollout_log_probs"])
    assert td["responses"].size(0) == 4


def test_run_to_end_reuses_its_loop_and_cancels_what_a_run_leaves_behind():
    """The trainer's loop serves every step: each run returns its result or raises, and a task it started and
    left running is cancelled (awaited) before the call returns, as asyncio.run would."""
    loop = asyncio.new_event_loop()
    left = []

    async def step(value):
        left.append(asyncio.get_running_loop().create_task(asyncio.sleep(3600)))
        return value

    async def fails():
        raise RuntimeError("a session failed")

    try:
        assert run_to_end(loop, step(1)) == 1
        assert left[0].cancelled() and not asyncio.all_tasks(loop)
        with pytest.raises(RuntimeError, match="a session failed"):
            run_to_end(loop, fails())
        assert run_to_end(loop, step(2)) == 2 and left[1].cancelled()
    finally:
        loop.close()
