"""The FSDP engine starts from a Hugging Face checkpoint without building the full model on any rank."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from backends.fsdp.checkpoint import local_rows
from backends.model.hf_files import SafetensorsFolder, WeightFileError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
import hf_tiny  # noqa: E402


def test_safetensors_folder_reads_rows_of_sharded_checkpoints(tmp_path):
    from safetensors.torch import load_file

    path = hf_tiny.make_checkpoint(tmp_path / "q", "qwen2", max_shard_size="40KB", tokenizer=False)
    folder = SafetensorsFolder(path)
    files = sorted(path.glob("*.safetensors"))
    assert len(files) > 1 and (path / "model.safetensors.index.json").is_file()
    full = {k: v for f in files for k, v in load_file(f).items()}
    assert folder.names() == sorted(full)
    for name, t in full.items():
        assert folder.shape(name) == tuple(t.shape)
        assert torch.equal(folder.read_rows(name, 1, 3), t[1:3])
    assert dict(folder.iter_tensors()).keys() == full.keys()
    with pytest.raises(WeightFileError, match="not in the checkpoint"):
        folder.read("model.nope.weight")
    with pytest.raises(WeightFileError, match=r"rows \[0, 999\)"):
        folder.read_rows("model.norm.weight", 0, 999)
    with pytest.raises(WeightFileError, match="no \\*.safetensors"):
        SafetensorsFolder(tmp_path)


def test_local_rows_of_a_plain_tensor():
    assert local_rows(torch.zeros(5, 3)) == (0, 5)


@pytest.mark.dist
def test_meta_init_loads_each_ranks_shards(torchrun, tmp_path):
    """Sharded (index.json) Qwen2 and a Qwen3 (q/k norms) on a 2-rank FSDP mesh, a tied Llama 3 on a 2x1 HSDP mesh:
    every rank's shards are exactly the checkpoint's rows."""
    qwen = hf_tiny.make_checkpoint(tmp_path / "qwen2", "qwen2", max_shard_size="40KB", tokenizer=False)
    qwen3 = hf_tiny.make_checkpoint(tmp_path / "qwen3", "qwen3", tokenizer=False)
    llama = hf_tiny.make_checkpoint(tmp_path / "llama", "llama3", tie=True, num_layers=3, tokenizer=False)
    out = torchrun("fsdp_hf_load_worker.py", 2, f"{qwen}:-1", f"{qwen3}:-1", f"{llama}:1", timeout=300)
    assert out.count("OK meta load") == 3, out
