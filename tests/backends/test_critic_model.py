"""The critic's value model: the decoder with a scalar head, exact against transformers' token-classification model
(one label), seeded like the policy, and started by the FSDP critic from a Hugging Face checkpoint."""
from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from backends.model.config import ModelConfig
from backends.model.critic import VALUE_HEAD, ValueModel, value_head_weights
from backends.model.hf import load_hf_checkpoint, read_hf_config
from backends.model.llama import LlamaModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
import hf_tiny  # noqa: E402

transformers = pytest.importorskip("transformers")
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
# fp32: a value is a dot product of a hidden state after ~10 float32 reductions (2^-24 relative each)
VALUE_TOL = 1e-5


def _critic_from_hf(path: Path, seed: int = 0) -> ValueModel:
    """A single-process critic: the checkpoint's decoder (the project's loader) and the seeded value head."""
    policy = load_hf_checkpoint(str(path))
    critic = ValueModel(policy.cfg)
    state = {k: v for k, v in policy.state_dict().items() if not k.startswith("lm_head")}
    state.update(value_head_weights(policy.cfg, seed))
    critic.load_state_dict(state)
    return critic


def test_values_equal_transformers_token_classification(tmp_path):
    """transformers' ``Qwen2ForTokenClassification`` (num_labels=1) on the same decoder and head is the reference:
    its per-position score equals the critic's value, on single and packed rows."""
    path = hf_tiny.make_checkpoint(tmp_path / "q", "qwen2", tokenizer=False)
    critic = _critic_from_hf(path, seed=3).eval()
    ref = transformers.Qwen2ForTokenClassification.from_pretrained(str(path), num_labels=1,
                                                                   attn_implementation="eager").eval()
    with torch.no_grad():
        ref.score.weight.copy_(critic.value_head.weight)
        ref.score.bias.copy_(critic.value_head.bias)
    rows = [torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 12)]
    with torch.no_grad():
        want = [ref(input_ids=r[None]).logits[0, :, 0] for r in rows]
        lens = [len(r) for r in rows]
        packed = critic(torch.cat(rows), torch.cat([torch.arange(n) for n in lens]),
                        torch.tensor([0, *lens]).cumsum(0).to(torch.int32))
    torch.testing.assert_close(packed, torch.cat(want), rtol=VALUE_TOL, atol=VALUE_TOL)
    assert want[0].abs().max() > 0.1, "values near zero would hide a wrong head"


def test_seeded_critic_starts_from_the_policy_decoder():
    critic, policy = ValueModel.from_seed(CFG, 5), LlamaModel.from_seed(CFG, 5)
    own = dict(critic.named_parameters())
    assert "lm_head.weight" not in own and set(VALUE_HEAD) <= set(own)
    for name, p in policy.named_parameters():
        if name != "lm_head.weight":
            assert torch.equal(own[name], p), name
    for name, t in value_head_weights(CFG, 5).items():
        assert torch.equal(own[name], t)
    assert not torch.equal(value_head_weights(CFG, 5)["value_head.weight"],
                           value_head_weights(CFG, 6)["value_head.weight"])
    # positions select the values at the response's predicting positions
    ids, pos = torch.tensor([1, 2, 3, 4]), torch.arange(4)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    full = critic(ids, pos, cu)
    torch.testing.assert_close(critic(ids, pos, cu, logits_positions=torch.tensor([1, 2])), full[1:3])
    with pytest.raises(AttributeError, match="value_head"):
        critic.output_weight()


def test_fsdp_critic_starts_from_a_hf_checkpoint(tmp_path):
    """critic.hf_path: the FSDP critic reads the decoder's rows from the checkpoint and draws the seeded head."""
    from backends.base import Share
    from backends.config import EngineConfig
    from backends.fsdp.critic import FSDPCriticEngine
    from protocol.batch.nested import to_nested
    from tensordict import TensorDict

    path = hf_tiny.make_checkpoint(tmp_path / "q", "qwen2", max_shard_size="40KB", tokenizer=False)
    cfg = read_hf_config(str(path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        engine = FSDPCriticEngine(EngineConfig(model=cfg, seed=4), None)
        ids = [torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 6)]
        masks = [torch.tensor([1, 0, 1, 1]), torch.ones(2, dtype=torch.long)]  # an observation token: value 0
        data = TensorDict({"input_ids": to_nested(ids), "response_mask": to_nested(masks)}, batch_size=[2])
        got = engine.infer_batch(Share(data, [[0, 1]]))["values"]
        weights = engine.get_weights()
        del engine
    finally:
        dist.destroy_process_group()
    critic = _critic_from_hf(path, seed=4).eval()
    for name, t in critic.state_dict().items():
        torch.testing.assert_close(weights[name], t, rtol=0, atol=0)
    with torch.no_grad():
        for row, m, v in zip(ids, masks, got.unbind()):
            L, r = len(row), len(m)
            want = critic(row, torch.arange(L), torch.tensor([0, L], dtype=torch.int32))[L - r - 1:L - 1] * m
            torch.testing.assert_close(v, want, rtol=VALUE_TOL, atol=VALUE_TOL)
