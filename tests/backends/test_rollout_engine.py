"""The rollout-engine interface: the embedded sampler implements every verb, the registry builds engines by
``rollout.engine`` name, and pause / resume, adapters and sleep / wake do what the interface says."""
from __future__ import annotations

import asyncio

import pytest
import torch

from backends.model.config import ModelConfig
from backends.model.llama import LlamaModel
from backends.rollout import (EmbeddedEngine, RolloutEngine, RolloutError, build_rollout_engine,
                              register_rollout_engine, rollout_engines)
from backends.rollout.engine import ENGINES
from protocol.rollout.tokenizer import CharTokenizer

TOK = CharTokenizer()
CFG = ModelConfig()
PROMPTS = [TOK.apply_chat_template([{"role": "user", "content": f"copy: {w}"}]) for w in ("abc", "dcba", "bb")]
Q = "layers.0.self_attn.q_proj"


def _engine(seed: int = 0) -> EmbeddedEngine:
    return EmbeddedEngine(CFG, TOK, seed=seed)


def test_the_embedded_engine_is_a_registered_rollout_engine():
    assert "embedded" in rollout_engines()
    engine = build_rollout_engine("embedded", CFG, TOK, seed=0)
    assert isinstance(engine, EmbeddedEngine) and isinstance(engine, RolloutEngine)
    with pytest.raises(RolloutError, match=r"rollout.engine='sglang' is not a registered rollout engine; known: "):
        build_rollout_engine("sglang", CFG, TOK)


def test_a_builder_whose_engine_lacks_verbs_is_refused():
    class Partial:  # generates, but cannot take weights, pause or sleep
        stop_token_ids = frozenset()
        weights_version = 0

        async def agenerate(self, prompt_ids, sampling_params=None):
            return [], []

    register_rollout_engine("partial_for_test")(lambda *a, **k: Partial())
    try:
        with pytest.raises(TypeError, match="lacks verbs of backends.rollout.RolloutEngine"):
            build_rollout_engine("partial_for_test", CFG, TOK)
        with pytest.raises(ValueError, match="registered twice"):
            register_rollout_engine("partial_for_test")(lambda *a, **k: Partial())
    finally:
        ENGINES.pop("partial_for_test")


def test_paused_requests_wait_and_run_with_the_weights_loaded_meanwhile():
    """Requests made while the engine is paused start no batch; after new weights and resume they run with those
    weights (version and tokens), exactly as a fresh engine holding them samples the same batch."""
    new = LlamaModel.from_seed(CFG, seed=7).state_dict()
    engine = _engine()
    engine.pause()
    loop = asyncio.new_event_loop()
    try:
        tasks = [loop.create_task(engine.agenerate(p, {"max_tokens": 6})) for p in PROMPTS]
        loop.run_until_complete(asyncio.sleep(0.01))  # many loop turns: nothing may run
        assert not any(t.done() for t in tasks) and engine.batch_sizes == []
        engine.load_weights(new, version=5)
        engine.resume()
        out = loop.run_until_complete(asyncio.gather(*tasks))
    finally:
        loop.close()
    assert [o.versions for o in out] == [(5,)] * len(PROMPTS) and engine.batch_sizes == [len(PROMPTS)]
    twin = _engine()
    twin.load_weights(new, version=5)
    assert [tuple(o) for o in out] == [tuple(r) for r in twin.generate_batch(PROMPTS, {"max_tokens": 6})]


def test_synchronous_generation_is_refused_while_paused_or_asleep():
    engine = _engine()
    engine.pause()
    with pytest.raises(RolloutError, match="paused; resume"):
        engine.generate(PROMPTS[0], {"max_tokens": 2})
    engine.resume()
    engine.sleep()
    with pytest.raises(RolloutError, match="asleep"):
        engine.generate(PROMPTS[0], {"max_tokens": 2})
    engine.wake()
    engine.reseed(0)
    awake = engine.generate(PROMPTS[0], {"max_tokens": 4})
    assert awake == _engine().generate(PROMPTS[0], {"max_tokens": 4})  # the weights survived the sleep


def _adapters(seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{Q}.lora_A": torch.randn(rank, CFG.hidden_size, generator=g),
            f"{Q}.lora_B": torch.randn(CFG.hidden_size, rank, generator=g)}


def _merged(base: torch.Tensor, adapters: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """W + scale * B @ A in float64."""
    return base.double() + scale * (adapters[f"{Q}.lora_B"].double() @ adapters[f"{Q}.lora_A"].double())


def test_adapters_apply_on_the_last_full_weights_and_replace_each_other():
    engine = _engine()
    base = engine.get_weights()
    scale = 0.5
    first, second = _adapters(1), _adapters(2)
    for adapters, version in ((first, 1), (second, 2)):  # the second replaces the first: W + s B2 A2, not both
        engine.load_adapters(adapters, scale, version=version)
        got = engine.get_weights()
        want = _merged(base[f"{Q}.weight"], adapters, scale)
        # one float32 rounding of each product term (rank 4) and of the sum: a few ulps of the largest magnitude
        tol = 8 * torch.finfo(torch.float32).eps * float(want.abs().max())
        assert (got[f"{Q}.weight"].double() - want).abs().max() <= tol
        assert engine.weights_version == version
        assert all(torch.equal(got[k], base[k]) for k in base if k != f"{Q}.weight")
    new = LlamaModel.from_seed(CFG, seed=3).state_dict()
    engine.load_weights(new, version=3)  # new full weights: adapters now apply on them
    engine.load_adapters(first, scale, version=4)
    want = _merged(new[f"{Q}.weight"], first, scale)
    tol = 8 * torch.finfo(torch.float32).eps * float(want.abs().max())
    assert (engine.get_weights()[f"{Q}.weight"].double() - want).abs().max() <= tol


def test_bad_adapters_are_refused_naming_them():
    engine = _engine()
    with pytest.raises(RolloutError, match=r"\['layers.0.self_attn.q_proj.weight'\] are not adapter names"):
        engine.load_adapters({f"{Q}.weight": torch.zeros(1)}, 1.0)
    with pytest.raises(RolloutError, match="has no base weight"):
        engine.load_adapters({"layers.0.self_attn.x_proj.lora_A": torch.zeros(4, 64),
                              "layers.0.self_attn.x_proj.lora_B": torch.zeros(64, 4)}, 1.0)
