"""The Qwen2-VL / Qwen2.5-VL policy against transformers' own: patch positions, multimodal rotary positions and
log-probs of a packed batch mixing sequences with several images, one image and none."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dist"))
import hf_tiny  # noqa: E402
from vl_common import (END, IMAGE, START, VIDEO, reference_logprobs, sequence as _sequence, vl_rows,  # noqa: E402
                       without_placeholders)

from backends.model.vision import (VLModel, load_vl_checkpoint, mrope_positions, patch_positions,  # noqa: F401
                                   read_vl_config, vl_state_dict)



def _tiny_vl(out, seed: int = 0, scale: float = 2.0, family: str = "qwen2_vl", vocab: int = 160,
             image: int = IMAGE):
    """A random tiny Qwen2-VL (or Qwen2.5-VL: windows of 2 x 2 merged units, block 1 attending over whole frames)
    saved to ``out`` (matrices ~ normal(0, scale / sqrt(fan_in)), norms near 1: logits far from uniform, so position
    or ordering mistakes show)."""
    import transformers

    text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    common = dict(depth=2, num_heads=2, patch_size=2, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    if family == "qwen2_vl":
        vision = dict(common, embed_dim=16, hidden_size=32, mlp_ratio=2)
        cfg_cls, cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        vision = dict(common, hidden_size=16, out_hidden_size=32, intermediate_size=24, window_size=8,
                      fullatt_block_indexes=[1])
        cfg_cls, cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    cfg = cfg_cls(text_config=text, vision_config=vision, image_token_id=image, video_token_id=151,
                  vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(seed)
    model = cls(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight"))
                         else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * scale / p[0].numel() ** 0.5)
    model.save_pretrained(str(out))
    return model.eval()


@given(grids=st.lists(st.tuples(st.integers(1, 2), st.integers(1, 4), st.integers(1, 4)), min_size=1, max_size=3))
def test_patch_positions_are_transformers_vision_positions(grids):
    from transformers.vision_utils import get_vision_position_ids

    g = torch.tensor([(t, 2 * h, 2 * w) for t, h, w in grids])
    assert torch.equal(patch_positions(g, 2), get_vision_position_ids(g, 2))


def test_mrope_positions_are_transformers_rope_index(tmp_path):
    """Sequences with 0, 1 and 2 images of different shapes: the [3, T] positions transformers' get_rope_index
    computes from the token types; a run of image tokens shorter than its image is refused."""
    model = _tiny_vl(tmp_path / "vl")
    cases = [([5, 6, 7], []), ([5, 6, 7, 8], [(1, 4, 4)]), ([9, 10, 11], [(1, 2, 6), (1, 6, 4)])]
    for text, grids in cases:
        ids = torch.tensor(_sequence(text, grids))
        g = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        ours = mrope_positions(ids, IMAGE, g, 2)
        if grids:
            types = (ids == IMAGE).int()[None]
            want, _ = model.model.get_rope_index(ids[None], mm_token_type_ids=types, image_grid_thw=g)
            assert torch.equal(ours, want[:, 0]), (grids, ours, want[:, 0])
        else:
            assert torch.equal(ours, torch.arange(len(ids)).expand(3, -1))
    with pytest.raises(ValueError, match="needs 4 image tokens"):
        mrope_positions(torch.tensor([5, IMAGE, IMAGE, 6]), IMAGE, torch.tensor([[1, 4, 4]]), 2)
    with pytest.raises(ValueError, match="for 0 of its 1 images"):
        mrope_positions(torch.tensor([5, 6]), IMAGE, torch.tensor([[1, 4, 4]]), 2)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_log_probs_of_a_packed_mixed_batch_equal_transformers(tmp_path, family):
    """One packed batch: a sequence with two images of different sizes, one with one image, one with none; the
    project's log-probs of every next token equal transformers' (each sequence on its own) to 1e-5 in fp32 once
    the placeholders are out of the distribution (the policy never samples them: their log-prob is below -1e8),
    and the vision tower's features equal transformers' visual model (Qwen2.5-VL: images of 1 x 3, 3 x 2 and
    2 x 2 merged units in windows of 2 x 2, so windows split them)."""
    theirs = _tiny_vl(tmp_path / "vl", family=family)
    ours = load_vl_checkpoint(str(tmp_path / "vl"))
    cfg = ours.vl
    gen = torch.Generator().manual_seed(1)
    cases = [([5, 6, 7, 8, 9], [(1, 2, 6), (1, 6, 4)]), ([10, 11, 12], [(1, 4, 4)]), ([13, 14, 15, 16], [])]
    ids_all, pos_all, pix_all, grid_all, want = [], [], [], [], []
    for text, grids in cases:
        ids = torch.tensor(_sequence(text, grids))
        g = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        n = int(sum(t * h * w for t, h, w in grids))
        pix = torch.randn(n, cfg.vision.patch_dim, generator=gen)
        kwargs = dict(pixel_values=pix, image_grid_thw=g, mm_token_type_ids=(ids == IMAGE).int()[None]) \
            if grids else {}
        with torch.no_grad():
            logits = without_placeholders(theirs(input_ids=ids[None], **kwargs).logits[0])
        want.append(torch.log_softmax(logits[:-1].double(), -1).gather(1, ids[1:, None]).squeeze(1))
        ids_all.append(ids)
        pos_all.append(mrope_positions(ids, IMAGE, g, 2))
        if grids:
            pix_all.append(pix)
            grid_all.append(g)
    ids = torch.cat(ids_all)
    pos = torch.cat(pos_all, dim=1)
    cu = torch.tensor([0] + [len(x) for x in ids_all]).cumsum(0).to(torch.int32)
    with torch.no_grad():
        logits = ours(ids, pos, cu, pixel_values=torch.cat(pix_all), image_grid_thw=torch.cat(grid_all))
        feats = ours.visual(torch.cat(pix_all), torch.cat(grid_all))
        ref_feats = theirs.model.visual(torch.cat(pix_all), grid_thw=torch.cat(grid_all)).pooler_output
    torch.testing.assert_close(feats, ref_feats, rtol=1e-5, atol=1e-5)
    logp = torch.log_softmax(logits.double(), -1)
    for i, (a, b) in enumerate(zip(cu.tolist(), cu[1:].tolist())):
        got = logp[a:b - 1].gather(1, ids[a + 1:b, None]).squeeze(1)
        text = (ids[a + 1:b] != IMAGE) & (ids[a + 1:b] != VIDEO)
        assert want[i][text].abs().max() > 0.5, "log-probs far from uniform"
        torch.testing.assert_close(got[text], want[i][text], rtol=1e-5, atol=1e-5)
        assert bool((got[~text] < -1e8).all()), "a placeholder is never sampled"


@given(grids=st.lists(st.tuples(st.integers(1, 2), st.integers(1, 7), st.integers(1, 7)), min_size=1, max_size=3),
       units=st.integers(1, 4))
def test_windows_are_transformers_window_index(grids, units):
    """Qwen2.5-VL's window order and window offsets equal transformers' get_vision_window_index for any grids and
    window size (edge windows smaller, no empty window)."""
    from transformers.vision_utils import get_vision_window_index

    from backends.model.vision import window_order

    g = torch.tensor([(t, 2 * h, 2 * w) for t, h, w in grids])
    perm, cu = window_order(g, 2, units)
    want_perm, want_cu = get_vision_window_index(g, spatial_merge_size=2, window_size=units * 2 * 2, patch_size=2)
    assert torch.equal(perm, want_perm) and torch.equal(cu, want_cu)


def _vl_share(ours, cases, pad: bool):
    """A Share's fields for ``cases`` (vl_rows: prompt + 3 response tokens, random pixels); a padding sample (one
    text sequence) last when ``pad``."""
    from tensordict import TensorDict

    from backends.fsdp.share import GRIDS, PIXELS
    from protocol.batch.nested import to_nested

    ids, masks, pixels, grids = vl_rows(ours.vl.vision.patch_dim, cases + ([([3, 4, 5, 6], [])] if pad else []))
    data = TensorDict({"input_ids": to_nested(ids), "response_mask": to_nested(masks), PIXELS: to_nested(pixels),
                       GRIDS: to_nested(grids), "is_padding": torch.tensor([False] * len(cases) + [True] * pad)},
                      batch_size=[len(ids)])
    return data, ids, pixels, grids


def test_fsdp_engine_log_probs_with_images_equal_the_model_for_any_micro_batch_split(tmp_path, one_rank_group):
    """The FSDP engine (one rank) on a Qwen2.5-VL folder: log-probs of a share mixing 2, 1 and 0 images and a
    padding sample equal the model's for each sequence on its own, whatever the micro-batch split; one training
    step moves the vision tower too (its gradients come through the image features), and with
    ``freeze_vision_tower`` the same step moves the decoder only."""
    import dataclasses

    from backends.base import Share
    from backends.config import EngineConfig, OptimConfig
    from backends.fsdp.engine import FSDPEngine
    from protocol.batch.nested import to_nested

    _tiny_vl(tmp_path / "vl", family="qwen2_5_vl")
    ours = load_vl_checkpoint(str(tmp_path / "vl"))
    cases = [([5, 6, 7, 8, 9], [(1, 2, 6), (1, 6, 4)]), ([10, 11, 12], [(1, 4, 4)]), ([13, 14, 15, 16], [])]
    data, ids, pixels, grids = _vl_share(ours, cases, pad=True)
    want = reference_logprobs(ours, ids, pixels, grids)
    cfg = EngineConfig(model=ours.vl.text, vision=ours.vl, optim=OptimConfig(name="sgd", lr=0.5))
    eng = FSDPEngine(cfg)
    for split in ([[0, 1, 2, 3]], [[0], [1], [2], [3]], [[3, 1], [0, 2]]):
        got = eng.infer_batch(Share(data, split))["log_probs"].unbind()
        for i in range(3):
            torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5)
    before = {n: p.detach().full_tensor().clone() for n, p in eng.model.named_parameters()}
    train = data.clone()
    train["old_log_probs"] = eng.infer_batch(Share(data, [[0, 1, 2, 3]]))["log_probs"]
    train["advantages"] = to_nested([torch.full((3,), a) for a in (1.0, -1.0, 0.5, 0.0)])
    metrics = eng.train_batch(Share(train, [[0, 1], [2, 3]]))
    after = {n: p.detach().full_tensor() for n, p in eng.model.named_parameters()}
    frozen = FSDPEngine(dataclasses.replace(cfg, freeze_vision_tower=True))  # the same step, the tower frozen
    start = {n: p.detach().full_tensor().clone() for n, p in frozen.model.named_parameters()}
    frozen.train_batch(Share(train, [[0, 1], [2, 3]]))
    frozen_moved = {n for n, p in frozen.model.named_parameters() if not torch.equal(start[n], p.full_tensor())}
    assert torch.isfinite(torch.tensor(metrics["pg_loss"])) and metrics["grad_norm"] > 0
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert any(n.startswith("visual.blocks.0.") for n in moved) and any(n.startswith("layers.0.") for n in moved)
    assert "visual.merger.mlp.2.weight" in moved
    assert not {n for n in frozen_moved if n.startswith("visual.")} and any(n.startswith("layers.")
                                                                         for n in frozen_moved)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_greedy_generation_with_images_equals_transformers_generate(tmp_path, family):
    """The KV-cached sampler, prompts with 2, 1 and 0 images decoded together: each prompt's greedy tokens are
    transformers' ``generate`` on that prompt alone (its text positions after the images continue from the images'
    M-RoPE offset), and the sampled tokens' log-probs are the model's recompute of the whole sequence."""
    from backends.model.generate import generate

    theirs = _tiny_vl(tmp_path / "vl", family=family)
    ours = load_vl_checkpoint(str(tmp_path / "vl"))
    gen = torch.Generator().manual_seed(3)
    cases = [([5, 6, 7, 8, 9], [(1, 2, 6), (1, 6, 4)]), ([10, 11, 12], [(1, 4, 4)]), ([13, 14, 15, 16], [])]
    prompts, images = [], []
    for text, grids in cases:
        g = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        n = int(sum(t * h * w for t, h, w in grids))
        prompts.append(_sequence(text, grids))
        images.append((torch.randn(n, ours.vl.vision.patch_dim, generator=gen), g) if grids else None)
    outs, lps = generate(ours, prompts, max_new_tokens=8, temperature=0.0, images=images)
    for prompt, im, out, lp in zip(prompts, images, outs, lps):
        ids = torch.tensor([prompt])
        kwargs = dict(pixel_values=im[0], image_grid_thw=im[1], mm_token_type_ids=(ids == IMAGE).int()) if im else {}
        with torch.no_grad():
            want = theirs.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                                   **kwargs)[0, len(prompt):].tolist()
        assert out == want, (out, want)
        seq = torch.tensor(prompt + out)
        g = im[1] if im else torch.zeros(0, 3, dtype=torch.long)
        extra = dict(pixel_values=im[0], image_grid_thw=im[1]) if im else {}
        with torch.no_grad():
            logits = ours(seq, mrope_positions(seq, IMAGE, g, 2), torch.tensor([0, len(seq)], dtype=torch.int32),
                          **extra)
        recompute = torch.log_softmax(logits[len(prompt) - 1:-1].double(), -1).gather(1, torch.tensor(out)[:, None])
        torch.testing.assert_close(torch.tensor(lp, dtype=torch.float64), recompute.squeeze(1), rtol=1e-5, atol=1e-5)


def test_the_policy_never_samples_a_placeholder(tmp_path):
    """A policy whose output head favours the image and video placeholders (their rows multiples of the likeliest
    token's row): the unmasked head would pick them, the sampler at temperature 1 never does, and its
    log-probs are still the model's recompute (sampler and trainer read the same masked logits)."""
    from backends.model.generate import generate
    from backends.model.llama import LlamaModel

    _tiny_vl(tmp_path / "vl")
    ours = load_vl_checkpoint(str(tmp_path / "vl"))
    prompt = _sequence([5, 6, 7], [(1, 2, 2)])
    image = (torch.randn(4, ours.vl.vision.patch_dim, generator=torch.Generator().manual_seed(0)),
             torch.tensor([[1, 2, 2]]))
    with torch.no_grad():
        seq = torch.tensor(prompt)
        args = (seq, mrope_positions(seq, IMAGE, image[1], 2), torch.tensor([0, len(seq)], dtype=torch.int32))
        h = ours.hidden_states(*args, pixel_values=image[0], image_grid_thw=image[1])[-1:]
        top = LlamaModel.logits(ours, h)[0]
        best = int(top.argmax())
        assert top[best] > 0
        w = ours.lm_head.weight
        w[IMAGE], w[VIDEO] = 3 * w[best], 2 * w[best]  # three and two times the likeliest token's logit
        assert int(LlamaModel.logits(ours, h)[0].argmax()) in (IMAGE, VIDEO), "the test must tempt the sampler"
    outs, lps = generate(ours, [prompt] * 16, max_new_tokens=6, temperature=1.0, seed=0, images=[image] * 16)
    assert not {IMAGE, VIDEO} & {t for out in outs for t in out}
    seq = torch.tensor(prompt + outs[0])
    with torch.no_grad():
        logits = ours(seq, mrope_positions(seq, IMAGE, image[1], 2), torch.tensor([0, len(seq)], dtype=torch.int32),
                      pixel_values=image[0], image_grid_thw=image[1])
    recompute = torch.log_softmax(logits[len(prompt) - 1:-1].double(), -1).gather(1, torch.tensor(outs[0])[:, None])
    torch.testing.assert_close(torch.tensor(lps[0], dtype=torch.float64), recompute.squeeze(1), rtol=1e-5, atol=1e-5)


def test_a_processed_row_is_what_transformers_model_reads(tmp_path):
    """A chat prompt with two ``<image>`` placeholders and two images of different sizes through the project's
    VisionProcessor (ChatML tokenizer with vision tokens, transformers' Qwen2-VL image processor): transformers'
    own model accepts the ids and pixels (it checks that the image tokens match the images' features) and its
    log-probs of the text tokens equal the project's model's on them (placeholders out of both distributions)."""
    import numpy as np
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from protocol.rollout.images import VisionProcessor
    from protocol.rollout.tokenizer import load_tokenizer

    hf = hf_tiny.make_chatml_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]})
    hf.save_pretrained(str(tmp_path / "tok"))
    tok = load_tokenizer(str(tmp_path / "tok"))
    ip = Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=256)
    proc = VisionProcessor(ip, tok)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((10, 14), (6, 6))]
    ids, inputs = proc([{"role": "user", "content": "<image> left, <image> right: which is brighter?"}], images,
                       "row 0")
    theirs = _tiny_vl(tmp_path / "vl", family="qwen2_5_vl", vocab=len(hf), image=proc.pad_id)
    ours = load_vl_checkpoint(str(tmp_path / "vl"))
    seq = torch.tensor(ids)
    assert int((seq == proc.pad_id).sum()) == int(inputs["image_grid_thw"].prod(-1).sum()) // 4
    with torch.no_grad():
        want = theirs(input_ids=seq[None], pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                      mm_token_type_ids=(seq == proc.pad_id).int()[None]).logits[0]
        want = without_placeholders(want, ours.vl.placeholder_ids)
        got = ours(seq, mrope_positions(seq, proc.pad_id, inputs["image_grid_thw"], 2),
                   torch.tensor([0, len(seq)], dtype=torch.int32), pixel_values=inputs["pixel_values"],
                   image_grid_thw=inputs["image_grid_thw"])
    lp = lambda x: torch.log_softmax(x[:-1].double(), -1).gather(1, seq[1:, None])  # noqa: E731
    text = seq[1:] != proc.pad_id
    torch.testing.assert_close(lp(got)[text], lp(want)[text], rtol=1e-5, atol=1e-5)


@pytest.mark.dist
def test_fsdp_engine_with_images_on_two_ranks(torchrun, tmp_path):
    """DP = 2, each rank its own share (one with 2, 0 and 0 images, one with 1, 1 and a padding sample): every
    sequence's log-probs are the single-process model's under two micro-batch splits, and a training step leaves
    both ranks the same weights, the vision tower's moved (tests/dist/vl_engine_worker.py)."""
    _tiny_vl(tmp_path / "vl", family="qwen2_5_vl")
    out = torchrun(Path(__file__).resolve().parent.parent / "dist" / "vl_engine_worker.py", 2, str(tmp_path / "vl"),
                   timeout=300)
    for check in ("log-probs dp=2", "step dp=2"):
        assert out.count(check) == 2, out[-3000:]


def _char_tokenizer():
    """The char tokenizer over the tiny checkpoint's vocabulary (160 ids; eos 1)."""
    from protocol.rollout.tokenizer import CharTokenizer

    tok = CharTokenizer()
    tok.vocab_size, tok.eos_token_id = 160, 1
    return tok


def _vl_engine(tmp_path):
    """A tiny Qwen2.5-VL folder, its model, and an embedded rollout engine holding its weights."""
    from backends.model.hf import read_weight_files
    from backends.model.vision import vl_state_dict
    from backends.rollout import EmbeddedEngine

    _tiny_vl(tmp_path / "vl", family="qwen2_5_vl")
    ours = load_vl_checkpoint(str(tmp_path / "vl"))
    engine = EmbeddedEngine(ours.vl, _char_tokenizer(), seed=0)
    engine.load_weights(vl_state_dict(read_weight_files(str(tmp_path / "vl")), ours.vl), version=1)
    return ours, engine


def test_the_embedded_engine_samples_with_images_and_in_chunks(tmp_path):
    """The embedded rollout engine on a Qwen2.5-VL policy (weights pushed from the folder): concurrent requests with
    2, 1 and 0 images give the model's own greedy tokens and log-probs, and a partial rollout in 3-token chunks
    (each chunk a new request carrying the prompt's images) gives the same response; the single-turn agent loop
    hands a prompt's images to it; an engine of a text policy refuses images."""
    import asyncio

    from backends.model.config import ModelConfig
    from backends.model.generate import generate
    from backends.rollout import EmbeddedEngine, RolloutError, VersionedGenerate

    ours, engine = _vl_engine(tmp_path)
    cases = [([5, 6, 7, 8, 9], [(1, 2, 6), (1, 6, 4)]), ([10, 11, 12], [(1, 4, 4)]), ([13, 14, 15, 16], [])]
    ids, _, pixels, grids = vl_rows(ours.vl.vision.patch_dim, cases)
    prompts = [x.tolist()[:-3] for x in ids]
    images = [(p.view(-1, ours.vl.vision.patch_dim), g.view(-1, 3)) if g.numel() else None
              for p, g in zip(pixels, grids)]
    want = generate(ours, prompts, max_new_tokens=7, temperature=0.0, eos_token_id=1, images=images)
    params = {"temperature": 0.0, "max_tokens": 7}

    async def run(gen):
        return await asyncio.gather(*[gen(p, params, images=im) for p, im in zip(prompts, images)])

    whole = asyncio.run(run(VersionedGenerate(engine)))
    chunked = asyncio.run(run(VersionedGenerate(engine, chunk=3)))
    for k, (w, a, b) in enumerate(zip(zip(*want), whole, chunked)):
        assert list(a[0]) == w[0] == list(b[0]), k
        torch.testing.assert_close(torch.tensor(a[1]), torch.tensor(w[1]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(b[1]), torch.tensor(w[1]), rtol=1e-5, atol=1e-5)
    from protocol.rollout.agent_loop.single_turn import SingleTurnAgentLoop

    loop = SingleTurnAgentLoop(VersionedGenerate(engine), max_response_length=7)
    (out,) = asyncio.run(loop.run(prompts[0], params, images=images[0]))
    assert list(out.response_ids) == want[0][0], "the agent loop hands the prompt's images to the engine"
    text = EmbeddedEngine(ModelConfig(vocab_size=160), _char_tokenizer(), seed=0)
    with pytest.raises(RolloutError, match="no vision tower"):
        text.generate_batch([prompts[2]], params, images=[images[0]])


def test_groups_store_each_prompts_images_once(tmp_path):
    """run_groups with the embedded engine on a Qwen2.5-VL policy: groups of prompts with and without images run
    together; every trajectory's response is the engine's greedy one for its prompt and images; each prompt's
    images are stored once, on its prompt key (the store's bytes grow by one copy per prompt, not per trajectory),
    every trajectory of an image prompt is tagged with its images' attention spans, the bridge hands each sample
    its prompt's images, and kv_clear leaves the store empty."""
    import asyncio

    from backends.model.generate import generate
    from backends.model.vision import attention_spans
    from backends.rollout import VersionedGenerate
    from protocol.fields import IMAGE_GRID_THW, PIXEL_VALUES
    from protocol.rollout.agent_loop import run_groups
    from protocol.rollout.agent_loop.single_turn import SingleTurnAgentLoop
    from protocol.store import LocalStore
    from protocol.store.keys import uid_of
    from protocol.store.meta import KVBatchMeta
    from rldispatch.bridge import prompt_images
    from rldispatch.dataplane import ShardedStore
    from rldispatch.rollout import prompt_inputs

    ours, engine = _vl_engine(tmp_path)
    cases = [([5, 6, 7], [(1, 2, 6)]), ([10, 11, 12], []), ([13, 14], [(1, 4, 4), (1, 2, 2)])]
    ids, _, pixels, grids = vl_rows(ours.vl.vision.patch_dim, cases)
    prompts = [x.tolist()[:-3] for x in ids]
    images = [(p.view(-1, ours.vl.vision.patch_dim), g.view(-1, 3)) if g.numel() else None
              for p, g in zip(pixels, grids)]
    rows = [{"multi_modal_inputs": {"pixel_values": im[0], "image_grid_thw": im[1]} if im else {}} for im in images]
    uids, n = ["aa01", "bb02", "cc03"], 3
    store = ShardedStore(LocalStore())
    loop = SingleTurnAgentLoop(VersionedGenerate(engine), max_response_length=5)
    asyncio.run(run_groups(store, uids, prompts, n, loop, 1, "train", {"temperature": 0.0, "max_tokens": 5},
                           row_kwargs=[{"images": im} if im else {} for im in images],
                           inputs=prompt_inputs(rows, ours.vl.vision)))
    want = generate(ours, prompts, max_new_tokens=5, temperature=0.0, eos_token_id=1, images=images)[0]
    keys = sorted(k for k in store.kv_list("train")["train"] if "_" in k)
    assert len(keys) == 3 * n
    image_bytes = sum(p.numel() * 4 + g.numel() * 8 for p, g in zip(pixels, grids))
    text = LocalStore()  # the same trajectories without any image field: the difference is one copy per prompt
    text.kv_batch_put(keys, "train", store.local.kv_batch_get(keys, "train"))
    assert store.local.stats()["bytes"] - text.stats()["bytes"] == image_bytes
    tags = store.tags_of(keys, "train")
    for key, tag in zip(keys, tags):
        i = uids.index(uid_of(key))
        assert store.local.kv_batch_get([key], "train", ["responses"])["responses"][0].tolist() == want[i]
        assert PIXEL_VALUES not in store.local.kv_batch_get([key], "train").keys()
        assert tag.get("vision_spans") == (attention_spans(ours.vl.vision, images[i][1]) if images[i] else None)
    shared = prompt_images(store, KVBatchMeta("train", keys, tags))
    for key, p, g in zip(keys, shared[PIXEL_VALUES].unbind(0), shared[IMAGE_GRID_THW].unbind(0)):
        i = uids.index(uid_of(key))
        assert torch.equal(p, pixels[i]) and torch.equal(g, grids[i])
    store.kv_clear([*keys, *uids], "train")
    assert store.local.num_keys() == 0 and store.local.stats()["bytes"] == 0
