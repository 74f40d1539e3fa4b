"""Tiny Hugging Face artefacts built offline for tests: a ChatML BPE tokenizer and random Qwen2 / Llama checkpoints.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here with the ``tokenizers`` library and wrapped in
``transformers.PreTrainedTokenizerFast``; checkpoints are random ``transformers`` models whose weights are scaled
so their logits are far from uniform (near-uniform logits would hide rotary and norm mistakes).
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["CHATML_TEMPLATE", "SPECIALS", "make_chatml_tokenizer", "make_checkpoint"]

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = ["repeat: a3", "repeat: b5", "copy: abcd", "reverse: dcba", "user", "assistant", "system",
           "aaaa bbbb cccc dddd", "the answer is 42", "call a tool", "<tool_call>{}</tool_call>"]


def make_chatml_tokenizer(out: str | Path | None = None, vocab_size: int = 320):
    """A byte-level BPE tokenizer with ChatML specials (eos ``<|im_end|>``, pad ``<|endoftext|>``), saved to ``out``
    when given; returns the ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 8, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 chat_template=CHATML_TEMPLATE)
    if out is not None:
        hf.save_pretrained(str(out))
    return hf


def make_checkpoint(out: str | Path, arch: str = "qwen2", vocab_size: int = 320, tie: bool = False, seed: int = 0,
                    scale: float = 4.0, num_layers: int = 2, tokenizer: bool = True,
                    generation_eos: tuple[int, ...] | None = None, max_shard_size: str | None = None,
                    classifier: bool = False) -> Path:
    """A random tiny ``arch`` (``qwen2``, ``qwen3``, ``llama``, ``llama3``) checkpoint written by transformers.

    ``classifier``: the family's ``*ForSequenceClassification`` with one label (a reward model; its
    ``pad_token_id`` is the tokenizer's pad, ``<|endoftext|>`` = id 0) instead of the causal LM.

    Every matrix is ``normal(0, scale / sqrt(fan_in))`` (biases too, for Qwen2), norms ``1 + 0.1 * noise``. With
    ``tokenizer`` the ChatML tokenizer is saved alongside; ``generation_eos`` writes generation_config.json's
    ``eos_token_id`` (default: ``<|im_end|>`` and ``<|endoftext|>``, as instruction-tuned Qwen checkpoints do).
    ``max_shard_size`` (e.g. ``"20KB"``) splits the weights into several files listed by model.safetensors.index.json.
    """
    import torch
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=tie, hidden_act="silu")
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1000000.0, use_sliding_window=False)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":  # per-head q/k norm, head_dim (16) != hidden_size / num_attention_heads (8)
        cfg = transformers.Qwen3Config(**common, head_dim=16, rope_theta=1000000.0, use_sliding_window=False)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=500000.0, attention_bias=False, mlp_bias=False)
        cls = transformers.LlamaForCausalLM
    elif arch == "llama3":  # Llama 3.1 frequency-banded rope scaling
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        cfg = transformers.LlamaConfig(**common, rope_parameters=rope, attention_bias=False, mlp_bias=False)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"make_checkpoint: arch must be 'qwen2', 'qwen3', 'llama' or 'llama3', got {arch!r}")
    if classifier:
        cls = getattr(transformers, cls.__name__.replace("ForCausalLM", "ForSequenceClassification"))
        cfg.num_labels, cfg.pad_token_id = 1, 0
    torch.manual_seed(seed)
    model = cls(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # q/k/v biases
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * scale / p.shape[-1] ** 0.5)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **extra)
    if tokenizer:
        hf = make_chatml_tokenizer(out, vocab_size=vocab_size)
        if len(hf) > vocab_size:
            raise ValueError(f"the tiny tokenizer has {len(hf)} tokens, more than vocab_size={vocab_size}")
        eos = (hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")) \
            if generation_eos is None else generation_eos
        if not classifier:
            (out / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos)}))
    return out
