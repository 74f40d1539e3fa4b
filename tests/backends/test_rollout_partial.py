"""Partial rollout: a session paused between chunks resumes with newer weights, keeping its tokens and log-probs;
its trajectory's tags record the versions of its first and last chunk."""
from __future__ import annotations

import asyncio

import pytest
import torch

from backends.model.config import ModelConfig
from backends.model.llama import LlamaModel
from protocol.rollout.agent_loop import SingleTurnAgentLoop, run_group
from protocol.rollout.tokenizer import CharTokenizer
from protocol.store import LocalStore
from protocol.store.keys import new_uid
from backends.rollout import EmbeddedEngine, RolloutError, VersionedGenerate

TOK = CharTokenizer()
CFG = ModelConfig()
PROMPT = TOK.apply_chat_template([{"role": "user", "content": "copy: abc"}])


def recompute(model: LlamaModel, prompt: list[int], response: list[int]) -> torch.Tensor:
    seq = prompt + response
    with torch.no_grad():
        logits = model(torch.tensor(seq), torch.arange(len(seq)), torch.tensor([0, len(seq)], dtype=torch.int32))
    lp = torch.log_softmax(logits.float(), -1)
    p = len(prompt)
    return lp[p - 1:p - 1 + len(response)].gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def run_one_batch(loop: asyncio.AbstractEventLoop, worker: EmbeddedEngine) -> None:
    """Drive the loop until the worker has run one more batched generation (one chunk of every live session)."""
    n = len(worker.batch_sizes)
    while len(worker.batch_sizes) == n:
        loop.run_until_complete(asyncio.sleep(0))


def test_resumed_across_two_weight_syncs_keeps_tokens_logprobs_and_tags_versions():
    models = [LlamaModel.from_seed(CFG, seed=s).eval() for s in (0, 1, 2)]
    worker = EmbeddedEngine(CFG, TOK, seed=3)
    worker.load_weights(models[0].state_dict(), version=0)
    # stop tokens are not generated here, so every session runs its whole budget: 3 chunks of 2 tokens
    worker.stop_token_ids = set()
    agent = SingleTurnAgentLoop(VersionedGenerate(worker, chunk=2), TOK, max_response_length=6)
    store, uid = LocalStore(), new_uid()
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(run_group(store, uid, PROMPT, 2, agent, global_steps=0, partition_id="train",
                                          sampling_params={"temperature": 1.0, "max_tokens": 6}))
        run_one_batch(loop, worker)                          # chunk 0 of both sessions, version 0
        worker.load_weights(models[1].state_dict(), version=1)  # a weight sync while the sessions are paused
        run_one_batch(loop, worker)                          # chunk 1, version 1
        worker.load_weights(models[2].state_dict(), version=2)
        loop.run_until_complete(task)                        # chunk 2, version 2
    finally:
        loop.close()
    assert worker.batch_sizes == [2, 2, 2]
    keys = [f"{uid}_0_0", f"{uid}_1_0"]
    tags = store.kv_batch_get_tags(keys, "train")
    assert all(t["global_steps"] == 0 and t["min_global_steps"] == 0 and t["max_global_steps"] == 2 for t in tags)
    got = store.kv_batch_get(keys, "train", ["responses", "rollout_log_probs"])
    for response, lps in zip(got["responses"].unbind(), got["rollout_log_probs"].unbind()):
        response = response.tolist()
        assert len(response) == 6
        for version, model in enumerate(models):  # each chunk's log-probs are its own weights' (kept, not redone)
            want = recompute(model, PROMPT, response)[2 * version:2 * version + 2]
            assert torch.allclose(lps[2 * version:2 * version + 2], want, atol=1e-5), version


def test_without_chunks_a_response_is_one_version_and_the_same_sample():
    """No partial rollout: one request per response, tagged with the version that generated it, and the very
    tokens the plain generate call gives (the sync schedule's samples do not change)."""
    a, b = EmbeddedEngine(CFG, TOK, seed=5), EmbeddedEngine(CFG, TOK, seed=5)
    b.load_weights(a.model.state_dict(), version=7)
    params = {"temperature": 1.0, "max_tokens": 8}
    plain = asyncio.run(a.agenerate(PROMPT, params))
    tagged = asyncio.run(VersionedGenerate(b)(PROMPT, params))
    assert tuple(tagged) == plain and tagged.versions == (7,)
    with pytest.raises(RolloutError, match="chunk"):
        VersionedGenerate(a, chunk=0)
