"""save_hf_checkpoint: the written folder loads in transformers with the project model's logits."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from backends.model.config import ModelConfig
from backends.model.hf import HFCheckpointError, load_hf_checkpoint, read_hf_config
from backends.model.hf_export import save_hf_checkpoint
from backends.model.hf_files import SafetensorsFolder
from backends.model.llama import LlamaModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
import hf_tiny  # noqa: E402

IDS = torch.tensor([3, 17, 9, 44, 2, 8, 61, 5])


def _ours(model: LlamaModel) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, torch.arange(len(IDS)), torch.tensor([0, len(IDS)], dtype=torch.int32))


def _theirs(folder: Path, dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=IDS[None]).logits[0].float()


@pytest.mark.parametrize("cfg", [
    ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, init_std=0.3),
    ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=1, init_std=0.3,
                model_type="qwen2", qkv_bias=True, tie_word_embeddings=True, rope_theta=1e6),
], ids=["llama", "qwen2-tied"])
def test_config_built_from_model_config_and_sharded_weights(tmp_path, cfg):
    """No source checkpoint (a random-init run): config.json comes from the ModelConfig; several shard files."""
    model = LlamaModel.from_seed(cfg, seed=5)
    if cfg.qkv_bias:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.5)
    files = save_hf_checkpoint(str(tmp_path), model.state_dict(), cfg, max_shard_bytes=20_000,
                               generation_config={"eos_token_id": [2, 3]})
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    assert dataclasses.replace(read_hf_config(str(tmp_path)), hf_path="", init_std=cfg.init_std) == cfg
    torch.testing.assert_close(_theirs(tmp_path), _ours(model), rtol=0, atol=1e-5)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": [2, 3]}
    assert ("lm_head.weight" in SafetensorsFolder(tmp_path)) != cfg.tie_word_embeddings


def test_source_config_is_kept_and_checked(tmp_path):
    src = hf_tiny.make_checkpoint(tmp_path / "src", "qwen2", tokenizer=False)
    cfg = read_hf_config(str(src))
    model = load_hf_checkpoint(str(src))
    out = tmp_path / "out"
    save_hf_checkpoint(str(out), model.state_dict(), cfg, source=str(src), dtype=torch.bfloat16)
    written, original = json.loads((out / "config.json").read_text()), json.loads((src / "config.json").read_text())
    assert {k: v for k, v in written.items() if k not in ("dtype", "torch_dtype")} == \
        {k: v for k, v in original.items() if k not in ("dtype", "torch_dtype")}
    assert written["dtype"] == "bfloat16" and SafetensorsFolder(out).read("model.norm.weight").dtype == torch.bfloat16
    # bf16 storage: each weight rounded to 8 mantissa bits; compare against the same rounding of our weights
    rounded = LlamaModel(cfg)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    torch.testing.assert_close(_theirs(out), _ours(rounded), rtol=0, atol=1e-4)
    other = dataclasses.replace(cfg, rms_norm_eps=1e-5)
    with pytest.raises(HFCheckpointError, match="rms_norm_eps"):
        save_hf_checkpoint(str(tmp_path / "bad"), model.state_dict(), other, source=str(src))
    with pytest.raises(HFCheckpointError, match="missing"):
        save_hf_checkpoint(str(tmp_path / "bad"), {"embed_tokens.weight": torch.zeros(3)}, cfg)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3"])
def test_round_trip_of_each_family(tmp_path, arch):
    """Checkpoint -> project model -> export -> transformers: same config.json and transformers' own logits."""
    src = hf_tiny.make_checkpoint(tmp_path / "src", arch, tokenizer=False, tie=arch == "qwen3")
    cfg = read_hf_config(str(src))
    model = load_hf_checkpoint(str(src))
    out = tmp_path / "out"
    save_hf_checkpoint(str(out), model.state_dict(), cfg, source=str(src))
    torch.testing.assert_close(_theirs(out), _theirs(src), rtol=0, atol=0)
    torch.testing.assert_close(_ours(model), _theirs(src), rtol=0, atol=1e-4)
    # the same folder from the ModelConfig alone (the source checkpoint gone) reads back as the same model
    rebuilt = tmp_path / "rebuilt"
    save_hf_checkpoint(str(rebuilt), model.state_dict(), cfg)
    assert dataclasses.replace(read_hf_config(str(rebuilt)), hf_path="") == dataclasses.replace(cfg, hf_path="")
    torch.testing.assert_close(_theirs(rebuilt), _theirs(src), rtol=0, atol=0)
