"""Generation stops at every stop id: the tokenizer's EOS and the checkpoint's generation_config.json EOS ids."""
from __future__ import annotations

import json

import pytest
import torch

from backends.model.config import ModelConfig
from backends.model.generate import generate
from backends.model.llama import LlamaModel
from protocol.rollout.tokenizer import CharTokenizer
from backends.rollout import EmbeddedEngine, RolloutError

CFG = ModelConfig()
PROMPT = [1, 5, 20, 21, 22, 2, 6]
GREEDY = {"temperature": 0.0, "max_tokens": 6}


def _free_run(model: LlamaModel, stops=None, use_cache: bool = True) -> list[int]:
    toks, _ = generate(model, [PROMPT], max_new_tokens=6, temperature=0.0, eos_token_id=stops, use_cache=use_cache)
    return toks[0]


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_stops_at_any_of_several_ids(use_cache):
    model = LlamaModel.from_seed(CFG, seed=1)
    free = _free_run(model, None, use_cache)
    assert len(free) == 6
    k = next(i for i, t in enumerate(free) if t not in free[:i])  # first occurrence of some token
    stop = free[k]
    assert _free_run(model, {stop}, use_cache) == free[:k + 1]  # the stop token is kept as the last token
    assert _free_run(model, [127, stop], use_cache) == free[:k + 1]  # any id of the collection stops
    assert _free_run(model, stop, use_cache) == free[:k + 1]  # a single int still works
    with pytest.raises(ValueError, match="eos_token_id"):
        _free_run(model, ["x"], use_cache)


def test_rollout_worker_stops_at_generation_config_eos(tmp_path):
    tok = CharTokenizer()
    worker = EmbeddedEngine(CFG, tok, init_seed=1)
    free, _ = worker.generate(PROMPT, GREEDY)
    free = [t for t in free]
    assert tok.eos_token_id not in free[:-1]
    k = next(i for i, t in enumerate(free) if t not in free[:i] and t != tok.eos_token_id)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[k], tok.eos_token_id]}))
    cfg = ModelConfig(hf_path=str(tmp_path))
    stopping = EmbeddedEngine(cfg, tok, init_seed=1)
    with pytest.raises(RolloutError, match="no weights yet"):  # hf_path: uninitialised until the engine's weights
        stopping.generate(PROMPT, GREEDY)
    stopping.load_weights(worker.get_weights())
    assert stopping.stop_token_ids == {free[k], tok.eos_token_id}
    got, _ = stopping.generate(PROMPT, GREEDY)
    assert got == free[:k + 1]


def test_rollout_worker_refuses_stop_ids_outside_the_model(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [500]}))
    with pytest.raises(RolloutError, match=r"stop token ids \[500\].*128 embedding rows"):
        EmbeddedEngine(ModelConfig(hf_path=str(tmp_path)), CharTokenizer())
