"""rollout.engine=vllm: one vLLM server (the engine environment of `make setup-vllm`) shared by this module's tests,
checked against the embedded engine and a float64 recompute of the project's model. Without that environment the
tests skip, except where RLDISPATCH_REQUIRE_VLLM=1 (CI) makes its absence a failure."""
from __future__ import annotations

import asyncio
import os

import pytest
import torch

from backends.model.config import ModelConfig
from backends.model.llama import LlamaModel
from backends.rollout import EmbeddedEngine, RolloutError, VersionedGenerate, VllmConfig, VllmEngine
from backends.rollout.vllm import engine_python
from protocol.rollout.tokenizer import CharTokenizer
from rldispatch.config import load_config
from protocol.config import ConfigError

TOK = CharTokenizer()
CFG = ModelConfig(num_heads=2, num_kv_heads=1)  # head size 32: vLLM's CPU attention has no 16
PROMPTS = [TOK.apply_chat_template([{"role": "user", "content": f"copy: {w}"}]) for w in ("abc", "dcba", "bb", "x")]
EPS32 = torch.finfo(torch.float32).eps

have_engine = os.path.isfile(engine_python(VllmConfig()))
needs_engine = pytest.mark.skipif(not have_engine and os.environ.get("RLDISPATCH_REQUIRE_VLLM") != "1",
                                  reason="no vLLM engine environment (make setup-vllm)")


@pytest.fixture(scope="module")
def engine():
    eng = VllmEngine(CFG, TOK, VllmConfig(), seed=0)  # eager on the CPU by default
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return LlamaModel.from_seed(CFG, seed=seed).state_dict()


def _generate(loop, eng, prompts, temperature, max_tokens=16):
    async def go():
        return await asyncio.gather(*[eng.agenerate(p, {"temperature": temperature, "max_tokens": max_tokens})
                                      for p in prompts])
    return loop.run_until_complete(go())


def _logprobs64(weights, prompt, response, temperature) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 log-probs of ``response`` after ``prompt`` at ``temperature`` (greedy: 1), and the float64 margin
    between the best and second-best logit at each response position."""
    model = LlamaModel(CFG).double()
    model.load_state_dict({k: v.double() for k, v in weights.items()})
    seq = prompt + response
    with torch.no_grad():
        logits = model(torch.tensor(seq), torch.arange(len(seq)), torch.tensor([0, len(seq)], dtype=torch.int32))
    at = logits[len(prompt) - 1:len(seq) - 1]
    lp = torch.log_softmax(at / (temperature or 1.0), -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
    top2 = at.topk(2, -1).values
    return lp, top2[:, 0] - top2[:, 1]


def _bound(embedded_err: float, lp64: torch.Tensor) -> float:
    """What a float32 forward may miss a log-prob by: four times the embedded engine's own float32 error on the same
    tokens (another float32 kernel sums in another order), and never below 16 float32 ulps of the value."""
    return max(4 * embedded_err, 16 * EPS32 * float(lp64.abs().max() + 1))


@needs_engine
@pytest.mark.slow
def test_greedy_generation_equals_the_embedded_engine_and_float64(engine, loop):
    weights = _weights(3)
    engine.load_weights(weights, version=1)
    ref = EmbeddedEngine(CFG, TOK, seed=0)
    ref.load_weights(weights, version=1)
    got, want = _generate(loop, engine, PROMPTS, 0.0), _generate(loop, ref, PROMPTS, 0.0)
    for prompt, g, w in zip(PROMPTS, got, want):
        assert g.versions == (1,)
        lp64, margin = _logprobs64(weights, prompt, list(g[0]), 0.0)
        if list(g[0]) != list(w[0]):  # float32 kernels may part only where two logits tie to float32 noise
            j = next(i for i, (a, b) in enumerate(zip(g[0], w[0])) if a != b)
            assert float(margin[j]) < 64 * EPS32 * float(lp64.abs().max() + 1), (prompt, j)
            continue
        err_e = float((torch.tensor(w[1], dtype=torch.float64) - lp64).abs().max())
        err_v = float((torch.tensor(g[1], dtype=torch.float64) - lp64).abs().max())
        assert err_v <= _bound(err_e, lp64), (err_v, err_e)


@needs_engine
@pytest.mark.slow
def test_sampled_log_probs_are_the_trainers_recompute_at_the_temperature(engine, loop):
    weights = _weights(4)
    engine.load_weights(weights, version=2)
    engine.reseed(11)
    for out, prompt in zip(_generate(loop, engine, PROMPTS, 0.7), PROMPTS):
        assert 1 <= len(out[0]) <= 16 and out.versions == (2,)
        lp64, _ = _logprobs64(weights, prompt, list(out[0]), 0.7)
        assert float((torch.tensor(out[1], dtype=torch.float64) - lp64).abs().max()) <= _bound(1e-6, lp64)


@needs_engine
@pytest.mark.slow
def test_reseed_restarts_the_sampling_stream(engine, loop):
    engine.load_weights(_weights(5), version=3)
    engine.reseed(7, rank=1)
    first = [list(o[0]) for o in _generate(loop, engine, PROMPTS, 1.0)]
    engine.reseed(7, rank=1)
    assert [list(o[0]) for o in _generate(loop, engine, PROMPTS, 1.0)] == first
    engine.reseed(7, rank=2)
    assert [list(o[0]) for o in _generate(loop, engine, PROMPTS, 1.0)] != first


@needs_engine
@pytest.mark.slow
def test_a_stop_token_ends_the_response_and_is_kept(engine, loop):
    """Swap the output rows of the EOS token and of the third greedy token: greedy decoding now emits EOS there."""
    weights = _weights(3)
    ref = EmbeddedEngine(CFG, TOK, seed=0)
    ref.load_weights(weights)
    t = ref.generate(PROMPTS[0], {"temperature": 0.0, "max_tokens": 16})[0][2]
    eos = TOK.eos_token_id
    head = weights["lm_head.weight"].clone()
    head[[t, eos]] = head[[eos, t]]
    swapped = {**weights, "lm_head.weight": head}
    ref.load_weights(swapped)
    engine.load_weights(swapped, version=4)
    want = ref.generate(PROMPTS[0], {"temperature": 0.0, "max_tokens": 16})[0]
    got = _generate(loop, engine, PROMPTS[:1], 0.0)[0]
    assert list(got[0]) == want and want[-1] == eos and len(want) <= 3


@needs_engine
@pytest.mark.slow
def test_new_weights_wait_for_a_pause_and_tag_the_responses(engine, loop):
    """A request made while the engine is paused waits; it runs with the weights loaded meanwhile and says so."""
    old, new = _weights(6), _weights(7)
    engine.load_weights(old, version=10)
    engine.pause()
    task = loop.create_task(engine.agenerate(PROMPTS[1], {"temperature": 0.0, "max_tokens": 8}))
    loop.run_until_complete(asyncio.sleep(0.3))
    assert not task.done()
    engine.load_weights(new, version=11)
    engine.resume()
    out = loop.run_until_complete(task)
    ref = EmbeddedEngine(CFG, TOK, seed=0)
    ref.load_weights(new)
    assert out.versions == (11,) and list(out[0]) == ref.generate(PROMPTS[1], {"temperature": 0.0,
                                                                             "max_tokens": 8})[0]


@needs_engine
@pytest.mark.slow
def test_partial_rollout_across_two_weight_syncs_keeps_tokens_logprobs_and_tags_versions(engine, loop):
    """Two sessions generated in 2-token chunks; weights[c] are loaded as the first session starts its chunk c
    (the other session's chunk may still be running: it finishes with the weights it started with). Every session
    keeps its tokens, each chunk's log-probs are its own weights', and the tags span 0..2."""
    from protocol.rollout.agent_loop import SingleTurnAgentLoop, run_group
    from protocol.store import LocalStore
    from protocol.store.keys import new_uid

    weights = [_weights(s) for s in (20, 21, 22)]
    engine.load_weights(weights[0], version=0)
    stops, engine.stop_token_ids = engine.stop_token_ids, frozenset()  # every session runs its whole budget

    class SyncAtChunks:
        """The engine, loading weights[c] when the first request for chunk c (prompt + 2c tokens) starts."""
        loaded = 0

        def __getattr__(self, name):
            return getattr(engine, name)

        async def agenerate(self, prompt_ids, sampling_params=None):
            c = (len(prompt_ids) - len(PROMPTS[0])) // 2
            if c > SyncAtChunks.loaded:
                engine.load_weights(weights[c], version=c)
                SyncAtChunks.loaded = c
            return await engine.agenerate(prompt_ids, sampling_params)

    agent = SingleTurnAgentLoop(VersionedGenerate(SyncAtChunks(), chunk=2), TOK, max_response_length=6)
    store, uid = LocalStore(), new_uid()
    try:
        loop.run_until_complete(run_group(store, uid, PROMPTS[0], 2, agent, global_steps=0, partition_id="train",
                                          sampling_params={"temperature": 1.0, "max_tokens": 6}))
    finally:
        engine.stop_token_ids = stops
    keys = [f"{uid}_0_0", f"{uid}_1_0"]
    tags = store.kv_batch_get_tags(keys, "train")
    assert [(t["min_global_steps"], t["max_global_steps"]) for t in tags] == [(0, 2), (0, 2)]
    got = store.kv_batch_get(keys, "train", ["responses", "rollout_log_probs"])
    versions = []
    for response, lps in zip(got["responses"].unbind(), got["rollout_log_probs"].unbind()):
        response = response.tolist()
        assert len(response) == 6
        chunk_versions = []
        for c in range(3):  # which weights made chunk c: the one whose float64 recompute it matches
            lp = lps[2 * c:2 * c + 2].double()
            errs = [float((_logprobs64(w, PROMPTS[0], response, 1.0)[0][2 * c:2 * c + 2] - lp).abs().max())
                    for w in weights]
            v = min(range(3), key=errs.__getitem__)
            assert errs[v] <= _bound(1e-6, lp), (c, errs)
            chunk_versions.append(v)
        versions.append(chunk_versions)
    # both sessions sent chunk 0 before any answer came back; chunk 1 ran with version 1, or with 2 in a session
    # the other one had overtaken
    assert all(v[0] == 0 and v[1] in (1, 2) and v[2] == 2 for v in versions), versions
    assert any(v[1] == 1 for v in versions), versions


def test_a_head_size_the_cpu_kernels_lack_is_refused_before_any_process_starts():
    with pytest.raises(RolloutError, match=r"head sizes .* the model's is 16"):
        VllmEngine(ModelConfig(), TOK, VllmConfig())


def test_a_missing_engine_environment_is_refused():
    with pytest.raises(RolloutError, match=r"rollout.vllm.python='/nonexistent/python'.*make setup-vllm"):
        VllmEngine(CFG, TOK, VllmConfig(python="/nonexistent/python"))
    with pytest.raises(ConfigError, match=r"rollout.vllm.python='/nonexistent/python'.*make setup-vllm"):
        load_config("grpo_tiny", ["rollout.engine=vllm", "rollout.vllm.python=/nonexistent/python"])


@pytest.mark.parametrize("override, message", [
    ("rollout.top_p=0.9", r"rollout.top_p=0.9 with rollout.engine=vllm"),
    ("debug.weight_checksums=true", r"debug.weight_checksums=true with rollout.engine=vllm"),
    ("rollout.vllm.kv_cache_gb=0", r"rollout.vllm.kv_cache_gb must be a whole number of GiB >= 1"),
    ("rollout.vllm.dtype=float64", r"rollout.vllm.dtype"),
])
def test_what_the_vllm_engine_cannot_honour_is_a_config_error(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("grpo_tiny", ["rollout.engine=vllm", "rollout.vllm.python=/bin/sh", override])


@needs_engine
@pytest.mark.dist
@pytest.mark.slow
def test_grpo_tiny_trains_with_vllm_in_colocate_async_on_two_ranks(torchrun, tmp_path):
    """Two Megatron ranks at TP=2 (one DP replica: one vLLM server, fed the weights gathered from both tensor-parallel
    halves; FSDP at DP=2, a server per rank, is the learning study's layout); colocate_async with partial rollout in
    2-token chunks: the run ends and every step reports the sync time and the gap between the engine's and the
    trainer's log-probs (whether a response spans a sync here depends on timing: the partial rollout test above
    makes it happen).
    Step 1 trains the warm-up batch, generated with the weights the trainer then holds: there the gap is float32
    noise (a weight or version mix-up would show as a gap of the size of an update). The output head is tied to the
    embedding: the CPU engine's packed copy of a tied head must follow every weight load (it once kept the start-up
    weights, and SmolLM2 sampled noise)."""
    import json
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "run"
    torchrun(str(repo / "scripts" / "train.py"), 2, "--config", str(repo / "configs" / "grpo_tiny.yaml"),
             "trainer.progress_bar=false", "trainer.tensorboard=false", "data.val_batch_size=4",
             "data.train_size=64", "data.val_size=8", f"data.train_files=[{tmp_path}/data/train.parquet]",
             f"data.val_files=[{tmp_path}/data/val.parquet]", "trainer.total_steps=2", "trainer.val_freq=2",
             "trainer.save_freq=0", f"trainer.run_dir={run_dir}", "model.num_heads=2", "model.num_kv_heads=2",
             "model.tie_word_embeddings=true", "actor.backend=megatron", "actor.megatron.tp=2", "rollout.engine=vllm",
             "trainer.mode=colocate_async",
             "trainer.colocate_async.num_warmup_batches=1", "rollout.partial_rollout_chunk=2", timeout=500)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["timing_s/weight_sync"] > 0 and r["training/rollout_probs_diff_max"] >= 0
    assert records[0]["training/rollout_probs_diff_max"] < 1e-6 and abs(records[0]["rollout_corr/kl"]) < 1e-6
    assert "val/score/mean" in records[-1] and "partial/partial_ratio" in records[-1]


_STAND_IN = '''"""A stand-in for vLLM's API server: binds --port and answers /v1/models with --served-model-name."""
import argparse, http.server, json
ap = argparse.ArgumentParser()
ap.add_argument("--host"); ap.add_argument("--port", type=int); ap.add_argument("--served-model-name")
args, _ = ap.parse_known_args()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": args.served_model_name}]}).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer((args.host, args.port), H).serve_forever()
'''


def test_a_server_whose_port_was_taken_restarts_on_another(tmp_path, monkeypatch):
    """The port is chosen before the server binds it; if another process took it meanwhile the server exits with
    "Address already in use" and starts again on a fresh port, and readiness is the answer naming its own model."""
    import socket
    import sys

    import backends.rollout.vllm_server as vs

    pkg = tmp_path / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(_STAND_IN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = vs.free_port
    monkeypatch.setattr(vs, "free_port", lambda: next(ports, None) or real())
    server = vs.VllmServer(sys.executable, [], {}, tmp_path / "server.log")
    try:
        assert server.port == taken.getsockname()[1]
        server.wait_ready(60)
        assert server.port != taken.getsockname()[1] and server._retries == vs.VllmServer.PORT_RETRIES - 1
        assert b"Address already in use" in (tmp_path / "server.log").read_bytes()
    finally:
        server.close()
        taken.close()


def test_a_server_that_exits_while_starting_is_an_error_quoting_its_log(tmp_path):
    import sys

    from backends.rollout.vllm_server import VllmServer

    server = VllmServer(sys.executable, [], {"PYTHONPATH": str(tmp_path)}, tmp_path / "server.log")
    with pytest.raises(RolloutError, match=r"exited with code 1 while starting(.|\n)*No module named"):
        server.wait_ready(60)
    server.close()
