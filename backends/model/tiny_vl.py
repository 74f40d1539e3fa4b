"""A tiny randomly initialised Qwen2-VL folder, written locally (no download): the vision-language policy of
``grpo_vl_tiny``, as ``grpo_tiny``'s seeded decoder is the text one.

The folder is what a real checkpoint carries: ``config.json`` + safetensors (transformers'
``Qwen2VLForConditionalGeneration``, its own initialisation under ``seed``), a tokenizer (the character tokenizer
plus the vision special tokens, with its chat template, and the ``colors`` task's colour names as whole-word tokens,
as a BPE vocabulary holds common words) and the image processor (transformers' Qwen2-VL one with 4-pixel patches: a
28 x 28 picture becomes 8 x 8 patches, 16 image tokens).

``format_steps`` > 0 first teaches the answer format, not the answer, as an instruct checkpoint knows its format
before RL: supervised steps on ``colors_blank`` rows (grey pictures) whose target is one of the two named colours
drawn at random, then eos. The model then names either colour about half of the time whatever the picture, and
only RL on real pictures can tell it which. From random weights a policy this small rarely samples a colour name
followed by eos, and GRPO's groups collapse onto whatever string it settled on first (docs/multimodal.md).
"""
from __future__ import annotations

import os
import tempfile

__all__ = ["VISION_TOKENS", "write_tiny_vl"]

#: the special tokens a Qwen2-VL tokenizer adds, in id order after the character tokenizer's 128
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


def write_tiny_vl(out: str, *, seed: int = 0, hidden_size: int = 64, layers: int = 2, vision_width: int = 32,
                  vision_depth: int = 2, patch_size: int = 4, format_steps: int = 0) -> list[str]:
    """Write the folder ``out`` (created; must not hold a model already); returns its files."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from protocol.rollout.tasks.colors import COLORS
    from protocol.rollout.tokenizer import CharTokenizer

    if os.path.isfile(os.path.join(out, "config.json")):
        raise FileExistsError(f"{out} already holds a model (config.json); choose a new folder")
    chars = CharTokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        chars.save_pretrained(tmp)
        tok = transformers.AutoTokenizer.from_pretrained(tmp)
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tok.add_tokens(sorted(COLORS))  # whole words, read wherever the text has them
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    vocab = len(tok)
    heads = max(1, hidden_size // 16)
    head_dim = hidden_size // heads
    quarter = head_dim // 2 // 4  # M-RoPE: a quarter of the rotary frequencies temporal, the rest split in two
    section = [quarter, (head_dim // 2 - quarter) // 2, head_dim // 2 - quarter - (head_dim // 2 - quarter) // 2]
    text = dict(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=chars.bos_token_id,
                eos_token_id=chars.eos_token_id, pad_token_id=chars.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section})
    vision = dict(depth=vision_depth, embed_dim=vision_width, hidden_size=hidden_size, num_heads=2, mlp_ratio=2,
                  patch_size=patch_size, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision,
                                     image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                                     vision_start_token_id=ids["<|vision_start|>"],
                                     vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen2VLForConditionalGeneration(cfg)
    unit = patch_size * 2  # the processor resizes to multiples of patch x merge
    processor = Qwen2VLImageProcessorPil(patch_size=patch_size, temporal_patch_size=2, merge_size=2,
                                         min_pixels=4 * unit * unit, max_pixels=64 * unit * unit)
    os.makedirs(out, exist_ok=True)
    tok.save_pretrained(out)
    processor.save_pretrained(out)
    if format_steps:
        _teach_format(model, out, format_steps, seed)
    model.save_pretrained(out)
    return sorted(os.listdir(out))


def _teach_format(model, folder: str, steps: int, seed: int, batch: int = 16, lr: float = 1e-3) -> None:
    """Supervised steps on grey-picture ``colors`` rows, each target a randomly chosen named colour + eos."""
    import random

    import torch

    from protocol.rollout.images import VisionProcessor, load_image_processor, open_images
    from protocol.rollout.tasks import get_task
    from protocol.rollout.tasks.colors import COLORS
    from protocol.rollout.tokenizer import load_tokenizer

    tok = load_tokenizer(folder)
    proc = VisionProcessor(load_image_processor(folder), tok)
    task, rng = get_task("colors_blank"), random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        opt.zero_grad()
        for i in range(batch):
            row = task.make_row(step * batch + i, rng)
            ids, mm = proc(row["prompt"], open_images(row["images"], "format"), "format")
            target = tok.encode(rng.choice(sorted(COLORS))) + [tok.eos_token_id]
            seq = torch.tensor([ids + target])
            labels = torch.tensor([[-100] * len(ids) + target])
            out = model(input_ids=seq, labels=labels, pixel_values=mm["pixel_values"],
                        image_grid_thw=mm["image_grid_thw"], mm_token_type_ids=(seq == proc.pad_id).int())
            (out.loss / batch).backward()
        opt.step()
    model.eval()
