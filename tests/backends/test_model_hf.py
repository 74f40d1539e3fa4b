"""The Hugging Face checkpoint loader: config mapping, renaming, refusals (no download; torch .bin weights)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from backends.model.config import ModelConfig
from backends.model.hf import HFCheckpointError, config_from_hf, convert_hf_state_dict, load_hf_checkpoint
from backends.model.llama import LlamaModel

HF = {"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500.0, "rms_norm_eps": 1e-5,
      "hidden_act": "silu", "tie_word_embeddings": False, "max_position_embeddings": 128}


def _write_checkpoint(tmp_path, model: LlamaModel, hf_cfg: dict):
    sd = {("lm_head.weight" if n == "lm_head.weight" else f"model.{n}"): p.detach().clone()
          for n, p in model.named_parameters()}
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_gives_identical_logits(tmp_path, tied):
    hf = {**HF, "tie_word_embeddings": tied}
    cfg = config_from_hf(hf)
    assert cfg == ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                              num_kv_heads=2, rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                              max_position_embeddings=128)
    assert config_from_hf({**hf, "rope_scaling": {"type": "linear", "factor": 2.0}, "head_dim": 16}) == \
        dataclasses.replace(cfg, rope_type="linear", rope_factor=2.0, head_dim=16)
    src = LlamaModel.from_seed(cfg, 3)
    _write_checkpoint(tmp_path, src, hf)
    loaded = load_hf_checkpoint(str(tmp_path))
    ids = torch.tensor([1, 2, 3, 4, 5])
    args = (ids, torch.tensor([0, 1, 2, 0, 1]), torch.tensor([0, 3, 5], dtype=torch.int32))
    with torch.no_grad():
        assert torch.equal(loaded(*args), src(*args))


@pytest.mark.parametrize("bad,match", [({"attention_bias": True}, "attention_bias"),
                                       ({"hidden_act": "gelu"}, "hidden_act"),
                                       ({"rope_scaling": {"type": "yarn", "factor": 2}}, "rope_type='yarn'"),
                                       ({"rope_scaling": {"type": "linear"}}, r"without \['factor'\]"),
                                       ({"model_type": "gpt2"}, "model_type='gpt2' is not supported")])
def test_unrepresentable_configs_are_refused(bad, match):
    with pytest.raises(HFCheckpointError, match=match):
        config_from_hf({**HF, **bad})
    cfg = dict(HF)
    del cfg["vocab_size"]
    with pytest.raises(HFCheckpointError, match="vocab_size"):
        config_from_hf(cfg)


def test_weight_mismatches_and_missing_files(tmp_path):
    cfg = config_from_hf(HF)
    sd = {f"model.{n}": p for n, p in LlamaModel(cfg).named_parameters() if n != "lm_head.weight"}
    with pytest.raises(HFCheckpointError, match="missing.*lm_head"):
        convert_hf_state_dict(sd, cfg)
    sd["lm_head.weight"] = torch.zeros(3, 32)
    with pytest.raises(HFCheckpointError, match="lm_head.weight has shape"):
        convert_hf_state_dict(sd, cfg)
    with pytest.raises(HFCheckpointError, match="config.json"):
        load_hf_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(HF))
    with pytest.raises(HFCheckpointError, match="weight files"):
        load_hf_checkpoint(str(tmp_path))
