"""Images in the dispatch: the vision tower's cost per sample in the workload the balancer equalises, and equal
micro-batch counts on every DP rank whatever mix of samples with and without images a batch holds."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dispatch import BatchSettings, PlanError, Topology, WorkloadModel, build_plan, make_padding, padding_count
from protocol.store.keys import trajectory_key, trajectory_tag

TEXT = WorkloadModel.from_hidden_size(64)


def test_vision_terms_are_the_flop_count_per_block_scaled_to_one_decoder_layer():
    """Qwen2-VL-like tower: width 32, MLP 2 x (32 x 128), 4 blocks beside 2 decoder layers: per patch
    2·(4·32² + 2·32·128) FLOPs and per span 4·32·p², times 4 / 2."""
    m = TEXT.with_vision(width=32, mlp_matrices=2, mlp_width=128, blocks=4, decoder_layers=2)
    assert (m.linear, m.quadratic) == (TEXT.linear, TEXT.quadratic)
    assert m.vision_linear == 2 * 2.0 * (4 * 32 ** 2 + 2 * 32 * 128)
    assert m.vision_quadratic == 2 * 4.0 * 32
    spans = [[16, 24], [], [64]]
    want = [sum(m.vision_linear * p + m.vision_quadratic * p * p for p in s) for s in spans]
    assert m.vision(spans).tolist() == want
    assert TEXT.vision(spans).tolist() == [0.0, 0.0, 0.0]  # a text model's tower costs nothing


@st.composite
def mixes(draw):
    dp = draw(st.sampled_from([1, 2, 4]))
    groups = draw(st.integers(1, 8))
    g = draw(st.integers(1, 4))
    # per trajectory: no images, or 1-3 images of 4-64 patches (the images add their tokens to the prompt)
    images = draw(st.lists(st.lists(st.integers(4, 64), max_size=3), min_size=groups * g, max_size=groups * g))
    mode = draw(st.sampled_from(["tokens", "fixed"]))
    sett = BatchSettings(rollout_n=g, ppo_mini_batch_size=None, balance=True,
                         max_token_len_per_gpu=2048 if mode == "tokens" else None,
                         micro_batch_size_per_gpu=draw(st.integers(1, 3)) if mode == "fixed" else None,
                         workload=TEXT.with_vision(width=32, mlp_matrices=3, mlp_width=96, blocks=4, decoder_layers=2))
    return dp, groups, g, images, sett, draw(st.integers(0, 99))


@settings(max_examples=60, deadline=None)
@given(mixes())
def test_any_mix_of_images_gives_every_rank_the_same_micro_batch_count(mix):
    """Random batches mixing trajectories with 0-3 images of different sizes, plus padding samples (no images):
    every DP rank gets the same number of samples and micro-batches in every mini-batch (no collective decides
    it), the plan's per-sample workload is the decoder's plus the tower's, and balancing never worsens it."""
    dp, groups, g, images, sett, seed = mix
    rng = np.random.default_rng(seed)
    topo = Topology.from_config({"backend": "fsdp"}, dp)
    keys, tags = [], []
    for u in range(groups):
        uid = f"{u:08x}{rng.integers(1 << 30):08x}"
        for s in range(g):
            spans = images[u * g + s]
            prompt = int(rng.integers(1, 30)) + sum(p // 4 for p in spans)  # the images' merged tokens
            tag = trajectory_tag(prompt, int(rng.integers(1, 100)), 3)
            if spans:
                tag["vision_spans"] = list(spans)
            keys.append(trajectory_key(uid, s, 0))
            tags.append(tag)
    pad = make_padding(padding_count(len(keys), sett.padding_multiple(topo)), global_steps=3, seed=1)
    keys, tags = keys + pad.keys, tags + pad.tags
    plan = build_plan(tags, topo, sett, keys=keys)
    seq = np.array([t["seq_len"] for t in tags])
    work = sett.workload(seq) + sett.workload.vision([t.get("vision_spans", []) for t in tags])
    for k in range(plan.num_mini_batches):
        shares = [r.mini_batches[k] for r in plan.ranks]
        assert len({len(s.indices) for s in shares}) == 1
        assert len({len(s.micro_batches) for s in shares}) == 1
        for s in shares:
            assert s.workload == pytest.approx(float(work[s.indices].sum()), rel=1e-12)
    assert plan.metrics["dispatch/balance_after_max"] <= plan.metrics["dispatch/balance_before_max"] + 1e-9
    assert sum(r.workload for r in plan.ranks) == pytest.approx(float(work.sum()), rel=1e-12)


def test_bad_vision_tags_are_named():
    topo = Topology.from_config({"backend": "fsdp"}, 1)
    tag = trajectory_tag(5, 3, 1)
    with pytest.raises(PlanError, match=r"vision_spans must be a list of positive patch counts, got \[0\]"):
        build_plan([{**tag, "vision_spans": [0]}], topo, BatchSettings(), keys=[trajectory_key("ab12", 0, 0)])
    pad = make_padding(1, global_steps=1, seed=0)
    with pytest.raises(PlanError, match="a padding sample carries no images"):
        build_plan([{**pad.tags[0], "vision_spans": [16]}], topo, BatchSettings(), keys=pad.keys)
