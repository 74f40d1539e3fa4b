"""Padding samples (tags, fields, keys, bounds), workload formula and batch-settings validation."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dispatch import (
    DENSE_FIELDS,
    FLOAT_FIELDS,
    INT_FIELDS,
    BatchSettings,
    DispatchConfigError,
    PaddingError,
    Topology,
    WorkloadError,
    WorkloadModel,
    is_padding_key,
    make_padding,
    padding_count,
)
from protocol.store.keys import check_trajectory_tag, parse_trajectory_key


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 512))
def test_padding_count_bounds(n, multiple):
    p = padding_count(n, multiple)
    assert 0 <= p <= multiple - 1 and (n + p) % multiple == 0
    assert p == 0 or n % multiple != 0  # a padded batch gets no more


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 12), st.integers(0, 9), st.integers(0, 5))
def test_padding_samples_follow_the_contract(count, step, pad_id):
    pad = make_padding(count, global_steps=step, pad_token_id=pad_id, fields=[*INT_FIELDS, *FLOAT_FIELDS,
                                                                             *DENSE_FIELDS])
    assert len(pad) == count == len(pad.tags) == pad.data.batch_size[0]
    assert len({parse_trajectory_key(k)[0] for k in pad.keys}) == count  # own uid each
    for key, tag in zip(pad.keys, pad.tags):
        check_trajectory_tag(tag, key)
        assert is_padding_key(key) and tag["is_padding"] is True
        assert (tag["prompt_len"], tag["response_len"], tag["seq_len"], tag["global_steps"]) == (1, 1, 2, step)
    d = pad.data
    for i in range(count):
        assert d["input_ids"][i].tolist() == [pad_id, pad_id] == d["prompts"][i].tolist() + d["responses"][i].tolist()
        assert d["position_ids"][i].tolist() == [0, 1]
        assert d["response_mask"][i].tolist() == [0] == d["loss_mask"][i].tolist()
        for f in FLOAT_FIELDS:
            assert d[f][i].dtype == torch.float32 and d[f][i].tolist() == [0.0]
    assert d["reward_score"].tolist() == [0.0] * count and d["is_padding"].tolist() == [True] * count


def test_padding_keys_reproducible_and_store_ready():
    from protocol.store.local import LocalStore

    a, b = make_padding(3, seed=5), make_padding(3, seed=5)
    assert a.keys == b.keys and make_padding(3).keys != make_padding(3).keys
    store = LocalStore()
    store.kv_batch_put(a.keys, "train", a.data, a.tags)
    got = store.kv_batch_get(a.keys, "train", ["responses", "advantages"])
    assert got["advantages"][2].tolist() == [0.0]
    assert all(t["is_padding"] for t in store.kv_batch_get_tags(a.keys, "train"))
    with pytest.raises(PaddingError, match="cannot build fields \\['logits'\\]"):
        make_padding(1, fields=["logits"])
    with pytest.raises(PaddingError, match="count must be a non-negative int"):
        make_padding(-1)
    with pytest.raises(PaddingError, match="multiple must be a positive int"):
        padding_count(3, 0)
    assert not is_padding_key("abc_0_0")


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8192), st.integers(0, 100_000))
def test_workload_formula(h, s):
    m = WorkloadModel.from_hidden_size(h)
    assert (m.linear, m.quadratic) == (24.0 * h * h, 4.0 * h)
    assert m([s])[0] == pytest.approx(24 * h * h * s + 4 * h * s * s)


def test_workload_config_and_errors():
    assert WorkloadModel.from_config(None) == WorkloadModel.from_hidden_size(4096)
    assert WorkloadModel.from_config({"hidden_size": 8}) == WorkloadModel(linear=1536, quadratic=32)
    assert WorkloadModel.from_config({"linear": 1, "quadratic": 0})([3]).tolist() == [3.0]
    with pytest.raises(WorkloadError, match="both 0"):
        WorkloadModel(linear=0, quadratic=0)
    with pytest.raises(WorkloadError, match="workload.linear must be a finite number"):
        WorkloadModel(linear=-1)
    with pytest.raises(WorkloadError, match="hidden_size must be a positive int"):
        WorkloadModel.from_hidden_size(0)
    with pytest.raises(WorkloadError, match="needs hidden_size"):
        WorkloadModel.from_config({"x": 1})
    with pytest.raises(WorkloadError, match=">= 0"):
        WorkloadModel()([-1])


@settings(max_examples=100, deadline=None)
@given(dp=st.integers(1, 16), m=st.integers(1, 64), g=st.integers(1, 16), group=st.booleans())
def test_padding_multiple_formula(dp, m, g, group):
    topo = Topology.from_config({"backend": "fsdp"}, dp)
    s = BatchSettings(ppo_mini_batch_size=m, rollout_n=g, group_partition=group)
    unit = g if group else 1
    assert s.padding_multiple(topo) == math.lcm(dp * unit, m * g)
    assert BatchSettings(rollout_n=g, group_partition=group).padding_multiple(topo) == dp * unit
    ok = (m * g) % dp == 0 and (not group or m % dp == 0)
    if ok:
        s.check(topo)
    else:
        with pytest.raises(DispatchConfigError):
            s.check(topo)


def test_settings_validation_and_token_cap():
    topo = Topology.from_config({"backend": "fsdp", "ulysses_sp": 4}, 8)
    assert BatchSettings(max_token_len_per_gpu=1000).token_cap(topo) == 4000
    assert BatchSettings().token_cap(topo) is None
    cp = Topology.from_config({"backend": "megatron", "cp": 2, "tp": 2}, 8)
    assert BatchSettings(max_token_len_per_gpu=100).token_cap(cp) == 200
    s = BatchSettings.from_config({"ppo_mini_batch_size": 4, "rollout_n": 2, "workload": {"hidden_size": 8}})
    assert s.mini_batch_samples == 8 and s.workload.quadratic == 32
    for bad, needle in [({"rollout_n": 0}, "rollout_n must be a positive int"),
                        ({"micro_batch_size_per_gpu": 2, "max_token_len_per_gpu": 9}, "not both"),
                        ({"ppo_mini_batch_size": 0}, "ppo_mini_batch_size must be a positive int"),
                        ({"shuffle": 1}, "shuffle must be a bool"),
                        ({"seed": -1}, "seed must be a non-negative int"),
                        ({"mini": 3}, "unknown dispatch settings \\['mini'\\]")]:
        with pytest.raises(DispatchConfigError, match=needle):
            BatchSettings.from_config(bad)
    with pytest.raises(DispatchConfigError, match="micro_batch_size_per_gpu \\(5\\) exceeds .* = 4"):
        BatchSettings(ppo_mini_batch_size=4, rollout_n=2, micro_batch_size_per_gpu=5).check(
            Topology.from_config({"backend": "fsdp"}, 2))
    vpp = Topology.from_config({"backend": "megatron", "pp": 4, "vpp": 2}, 8)
    with pytest.raises(DispatchConfigError, match="multiple of pp=4 micro-batches .* only 2 samples"):
        BatchSettings(ppo_mini_batch_size=2, rollout_n=2, micro_batch_size_per_gpu=1).check(vpp)
    with pytest.raises(DispatchConfigError, match="multiple of pp=4 micro-batches .* only 2 samples"):
        BatchSettings(ppo_mini_batch_size=2, rollout_n=2, max_token_len_per_gpu=100).check(vpp)
    with pytest.raises(DispatchConfigError, match="5 micro-batches of micro_batch_size_per_gpu=1 round up to 8"):
        BatchSettings(ppo_mini_batch_size=5, rollout_n=2, micro_batch_size_per_gpu=1).check(vpp)
    BatchSettings(ppo_mini_batch_size=4, rollout_n=2, micro_batch_size_per_gpu=1).check(vpp)  # 4 per rank: fine
    assert np.isclose(BatchSettings().workload([1])[0], 24 * 4096 ** 2 + 4 * 4096)
