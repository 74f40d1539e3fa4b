"""FSDP-engine pieces that need no process group: share validation, SP padding/head checks, dtypes, registry."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tensordict import TensorDict

from backends.base import Share, get_engine_class, known_engines
from backends.fsdp.engine import FSDPEngine, resolve_dtype
from backends.fsdp.share import ShareError, read_share
from backends.fsdp.ulysses import check_sp_heads, pad_to_multiple
from protocol.batch.nested import to_nested


def _share(lens=((3, 2), (4, 3)), mbs=None, **over):
    ids = [torch.arange(p + r) for p, r in lens]
    rm = [torch.ones(r, dtype=torch.long) for _, r in lens]
    fields = {"input_ids": to_nested(ids), "response_mask": to_nested(rm),
              "old_log_probs": to_nested([torch.zeros(r) for _, r in lens]),
              "advantages": to_nested([torch.ones(r) for _, r in lens])}
    fields.update(over)
    fields = {k: v for k, v in fields.items() if v is not None}
    return Share(TensorDict(fields, batch_size=[len(lens)]), mbs or [[i] for i in range(len(lens))])


def test_read_share_lengths():
    v = read_share(_share(), train=True)
    assert v.n == 2 and v.seq_lens == [5, 7] and v.response_lens == [2, 3]
    assert v.is_padding is None and v.ref_log_prob is None
    v = read_share(_share(is_padding=torch.tensor([False, True])), train=False)
    assert v.is_padding.tolist() == [False, True] and v.old_log_probs is None


def test_read_share_accepts_dense_rows():
    s = _share(lens=((2, 2), (2, 2)), input_ids=torch.zeros(2, 4, dtype=torch.long),
               response_mask=torch.ones(2, 2, dtype=torch.long))
    assert read_share(s, train=True).seq_lens == [4, 4]


@pytest.mark.parametrize("drop", ["input_ids", "response_mask", "old_log_probs", "advantages"])
def test_missing_field_is_a_key_error_naming_it(drop):
    with pytest.raises(KeyError, match=drop):
        read_share(_share(**{drop: None}), train=True)


def test_kl_loss_needs_ref_log_prob():
    with pytest.raises(KeyError, match="ref_log_prob.*use_kl_loss"):
        read_share(_share(), train=True, use_kl_loss=True)


def test_bad_fields_and_budget():
    with pytest.raises(ShareError, match="old_log_probs.*sample 1.*response_len=3"):
        read_share(_share(old_log_probs=to_nested([torch.zeros(2), torch.zeros(4)])), train=True)
    with pytest.raises(ShareError, match="prompt_len"):
        read_share(_share(lens=((0, 3),)), train=False)
    with pytest.raises(TypeError, match="integer token ids"):
        read_share(_share(input_ids=to_nested([torch.zeros(5), torch.zeros(7)])), train=False)
    with pytest.raises(ShareError, match="is_padding"):
        read_share(_share(is_padding=torch.tensor([[True], [False]])), train=False)
    with pytest.raises(ShareError, match="micro-batch 0 holds 12 tokens.*max_token_len_per_gpu=10.*sample 1"):
        read_share(_share(mbs=[[0, 1]]), train=False, max_tokens=10)
    assert read_share(_share(mbs=[[0, 1]]), train=False, max_tokens=12).n == 2
    with pytest.raises(ShareError, match=r"micro-batches \[1\] are empty"):
        read_share(_share(mbs=[[0, 1], []]), train=False)
    with pytest.raises(TypeError, match="Share"):
        read_share({"input_ids": None}, train=False)
    with pytest.raises(ValueError, match="exactly once"):
        _share(mbs=[[0], [0]])


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 9), min_size=1, max_size=5), sp=st.integers(1, 4))
def test_pad_to_multiple(lens, sp):
    ids = torch.arange(sum(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    ids2, pos2, cu2, pad = pad_to_multiple(ids, pos, cu, sp)
    assert ids2.shape[0] % sp == 0 and pad == ids2.shape[0] - ids.shape[0] < sp
    assert torch.equal(ids2[: ids.shape[0]], ids) and torch.equal(pos2[: ids.shape[0]], pos)
    assert int(cu2[-1]) == ids2.shape[0] and torch.equal(cu2[: cu.numel()], cu)
    assert cu2.numel() == cu.numel() + (1 if pad else 0)


def test_sp_head_check_and_dtypes():
    check_sp_heads(8, 2, 4)
    with pytest.raises(ValueError, match="ulysses_sp=3 must divide model.num_heads=8"):
        check_sp_heads(8, 2, 3)
    with pytest.raises(ValueError, match="ulysses_sp"):
        check_sp_heads(8, 2, 0)
    assert resolve_dtype("auto", "k", on_gpu=True) is torch.bfloat16
    assert resolve_dtype("auto", "k", on_gpu=False) is torch.float32
    assert resolve_dtype("bf16", "k", on_gpu=False) is torch.bfloat16
    with pytest.raises(ValueError, match="actor.fsdp.param_dtype"):
        resolve_dtype("int8", "actor.fsdp.param_dtype", on_gpu=False)


def test_registry_knows_fsdp():
    assert get_engine_class("fsdp") is FSDPEngine and "fsdp" in known_engines()
    with pytest.raises(ValueError, match="is not a known backend; known:"):
        get_engine_class("nope")
    with pytest.raises(RuntimeError, match="init_process_group"):
        FSDPEngine.__new__(FSDPEngine).__init__(None, None)
