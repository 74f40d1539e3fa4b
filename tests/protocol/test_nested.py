"""Jagged <-> padded <-> packed conversions: round trips, the log-prob shift, and every refusal."""
from __future__ import annotations

import math
import pickle

import pytest
import torch
from hypothesis import given, settings, strategies as st

from protocol.batch.nested import (
    NestedLayoutError,
    NestedShapeError,
    PackedBatch,
    is_jagged,
    nested_from_values,
    nested_lengths,
    nested_offsets,
    nested_values,
    pack_nested,
    packed_to_padded,
    padded_to_packed,
    jagged_to_padded,
    padded_to_jagged,
    padded_to_jagged_many,
    response_from_nested,
    response_to_nested,
    response_values_from_packed,
    response_values_to_packed,
    to_nested,
    unpack_to_nested,
)

SETTINGS = settings(max_examples=40, deadline=None)
lengths_st = st.lists(st.integers(0, 7), min_size=1, max_size=6)
trailing_st = st.sampled_from([(), (2,), (2, 3)])


def _samples(lengths, trailing=(), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        t = torch.randn((n, *trailing), generator=g) * 10
        out.append(t.to(dtype))
    return out


# ----------------------------------------------------------------------------------------------- to_nested


@SETTINGS
@given(lengths=lengths_st, trailing=trailing_st, dtype=st.sampled_from([torch.float32, torch.int64, torch.bool]))
def test_to_nested_keeps_every_sample(lengths, trailing, dtype):
    samples = _samples(lengths, trailing, dtype)
    nt = to_nested(samples)
    assert is_jagged(nt) and nt.dtype == dtype and nt.shape[0] == len(lengths)
    assert nested_lengths(nt).tolist() == lengths
    assert nested_offsets(nt).tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    for got, want in zip(nt.unbind(), samples):
        assert torch.equal(got, want)


def test_to_nested_zero_length_and_single_and_empty_batch():
    nt = to_nested([torch.zeros(0, dtype=torch.int64)])
    assert nt.shape[0] == 1 and nested_lengths(nt).tolist() == [0]
    assert jagged_to_padded(nt).shape == (1, 0)
    one = to_nested([torch.arange(4)])
    assert nested_values(one).tolist() == [0, 1, 2, 3]
    empty = to_nested([], dtype=torch.int64)
    assert empty.shape[0] == 0 and empty.dtype == torch.int64 and nested_lengths(empty).tolist() == []
    assert jagged_to_padded(empty).shape == (0, 0)
    # A dense [n, L] tensor is taken as n samples of length L.
    assert nested_lengths(to_nested(torch.ones(3, 2))).tolist() == [2, 2, 2]


def test_to_nested_dtype_device_and_autograd():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(2, requires_grad=True)
    nt = to_nested([a, b])
    (jagged_to_padded(nt) * torch.arange(3.0)).sum().backward()
    assert a.grad.tolist() == [0.0, 1.0, 2.0] and b.grad.tolist() == [0.0, 1.0]
    assert to_nested([torch.ones(2)], dtype=torch.float64).dtype == torch.float64


def test_to_nested_refusals():
    with pytest.raises(NestedShapeError, match=r"tensors\[1\].*trailing shape"):
        to_nested([torch.ones(2, 3), torch.ones(2, 4)])
    with pytest.raises(TypeError, match=r"tensors\[1\].*dtype"):
        to_nested([torch.ones(2), torch.ones(2, dtype=torch.int64)])
    with pytest.raises(NestedShapeError, match=r"tensors\[0\].*scalar"):
        to_nested([torch.tensor(1.0)])
    with pytest.raises(TypeError, match="already a nested"):
        to_nested(to_nested([torch.ones(2)]))
    with pytest.raises(TypeError, match=r"tensors\[0\].*nested"):
        to_nested([to_nested([torch.ones(2)])])


def test_nested_from_values_refusals():
    with pytest.raises(NestedShapeError, match="end at len"):
        nested_from_values(torch.ones(5), torch.tensor([0, 2, 4]))
    with pytest.raises(NestedShapeError, match="non-decreasing"):
        nested_from_values(torch.ones(5), torch.tensor([0, 3, 2, 5]))
    with pytest.raises(TypeError, match="integer"):
        nested_from_values(torch.ones(5), torch.tensor([0.0, 5.0]))
    with pytest.raises(TypeError, match="dense"):
        nested_from_values(to_nested([torch.ones(2)]), torch.tensor([0, 2]))
    with pytest.raises(NestedShapeError, match="scalar"):
        nested_from_values(torch.tensor(1.0), torch.tensor([0]))
    with pytest.raises(NestedShapeError, match=r"\[n \+ 1\]"):
        nested_from_values(torch.ones(2), torch.tensor([[0, 2]]))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_jagged_only_functions_refuse_dense():
    for fn in (nested_lengths, nested_offsets, nested_values, pack_nested, jagged_to_padded):
        with pytest.raises(TypeError, match="jagged"):
            fn(torch.ones(2, 3))
    strided = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(TypeError, match="layout"):
        nested_lengths(strided)


def test_non_contiguous_jagged_is_compacted():
    dense = torch.arange(10).view(2, 5)
    # A jagged view with holes (offsets + lengths), as torch.nested.narrow makes.
    holed = torch.nested.narrow(dense, 1, torch.tensor([1, 0]), torch.tensor([2, 3]), layout=torch.jagged)
    assert nested_lengths(holed).tolist() == [2, 3]
    assert nested_values(holed).tolist() == [1, 2, 5, 6, 7]
    assert jagged_to_padded(holed).tolist() == [[1, 2, 0], [5, 6, 7]]
    assert pack_nested(holed).values.tolist() == [1, 2, 5, 6, 7]


def test_jagged_pickles():
    nt = to_nested([torch.arange(3), torch.zeros(0, dtype=torch.int64), torch.arange(2)])
    back = pickle.loads(pickle.dumps(nt))
    assert nested_lengths(back).tolist() == [3, 0, 2] and torch.equal(nested_values(back), nested_values(nt))


# ----------------------------------------------------------------------------------- padded response <-> jagged


@SETTINGS
@given(lengths=lengths_st, trailing=trailing_st, extra=st.integers(0, 3), pad=st.sampled_from([0, -1, 7]))
def test_response_padded_round_trip(lengths, trailing, extra, pad):
    samples = _samples(lengths, trailing)
    nt = to_nested(samples)
    width = max(lengths) + extra
    padded = jagged_to_padded(nt, pad_value=pad, max_len=width)
    assert padded.shape == (len(lengths), width, *trailing)
    for i, (row, n) in enumerate(zip(padded, lengths)):
        assert torch.equal(row[:n], samples[i])
        assert bool((row[n:] == pad).all())
    back = padded_to_jagged(padded, torch.tensor(lengths))
    assert nested_lengths(back).tolist() == lengths
    assert torch.equal(nested_values(back), nested_values(nt))


@SETTINGS
@given(lengths=lengths_st, width_extra=st.integers(0, 3))
def test_padded_to_jagged_matches_loop(lengths, width_extra):
    width = max(lengths) + width_extra
    padded = torch.arange(len(lengths) * width).view(len(lengths), width)
    nt = padded_to_jagged(padded, torch.tensor(lengths))
    for i, comp in enumerate(nt.unbind()):
        assert comp.tolist() == padded[i, : lengths[i]].tolist()


@SETTINGS
@given(lengths=lengths_st, trailing=trailing_st, width_extra=st.integers(0, 3), count=st.integers(1, 4))
def test_padded_to_jagged_many_is_each_one_cut_at_shared_offsets(lengths, trailing, width_extra, count):
    """Several padded tensors cut at one set of lengths give what each cut alone gives, sharing one offsets tensor
    (one ragged structure); their dtypes may differ."""
    width = max(lengths) + width_extra
    dtypes = [torch.float32, torch.int64, torch.bool, torch.bfloat16]
    padded = [(torch.arange(len(lengths) * width * max(1, math.prod(trailing))) % 5)
              .view(len(lengths), width, *trailing).to(dtypes[i]) for i in range(count)]
    got = padded_to_jagged_many(padded, torch.tensor(lengths))
    assert len(got) == count and all(g.offsets() is got[0].offsets() for g in got)
    for p, g in zip(padded, got):
        one = padded_to_jagged(p, torch.tensor(lengths))
        assert g.dtype == p.dtype and torch.equal(nested_values(g), nested_values(one))
        assert nested_lengths(g).tolist() == lengths
    assert padded_to_jagged_many([], torch.tensor(lengths)) == []


@SETTINGS
@given(lengths=lengths_st, trailing=trailing_st, extra=st.integers(0, 2), pad=st.sampled_from([0, 3]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.int64, torch.int32, torch.bool, torch.bfloat16]),
       grad=st.booleans())
def test_padding_and_cutting_agree_with_the_rows_on_the_numpy_and_the_torch_path(lengths, trailing, extra, pad,
                                                                                   dtype, grad):
    """CPU tensors of numpy's dtypes that record no gradient pad and cut through numpy, the rest (bfloat16, a
    tensor that requires grad) through torch: both give each row, then the pad value, exactly."""
    samples = _samples(lengths, trailing, dtype)
    if grad:
        if not dtype.is_floating_point:
            return
        samples = [x.requires_grad_() for x in samples]
    width = max(lengths) + extra
    padded = jagged_to_padded(to_nested(samples), pad_value=pad, max_len=width)
    assert padded.dtype == dtype and padded.shape == (len(lengths), width, *trailing)
    assert padded.requires_grad == grad
    fill = torch.tensor(pad).to(dtype)  # a bool tensor pads with True for 3
    for row, sample, n in zip(padded, samples, lengths):
        assert torch.equal(row[:n], sample) and bool((row[n:] == fill).all())
    back, = padded_to_jagged_many([padded], torch.tensor(lengths))
    assert back.dtype == dtype and nested_lengths(back).tolist() == lengths
    assert torch.equal(nested_values(back), torch.cat(samples))


def test_padded_to_jagged_many_refuses_tensors_of_other_rows():
    with pytest.raises(NestedShapeError, match=r"rows and width \(2, 3\)"):
        padded_to_jagged_many([torch.zeros(2, 3), torch.zeros(2, 4)], torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="dense"):
        padded_to_jagged_many([torch.zeros(2, 3), to_nested([torch.ones(2)])], torch.tensor([1, 2]))


def test_response_conversion_refusals():
    padded = torch.zeros(3, 4)
    with pytest.raises(NestedShapeError, match=r"lengths\[1\] = 5 exceeds.*L = 4.*sample 1"):
        padded_to_jagged(padded, torch.tensor([1, 5, 2]))
    with pytest.raises(NestedShapeError, match=r"lengths\[2\] = -1 is negative"):
        padded_to_jagged(padded, torch.tensor([1, 2, -1]))
    with pytest.raises(NestedShapeError, match="expected 3 entries"):
        padded_to_jagged(padded, torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="integer"):
        padded_to_jagged(padded, torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(NestedShapeError, match=r"\[n, L"):
        padded_to_jagged(torch.zeros(3), torch.tensor([1, 1, 1]))
    with pytest.raises(TypeError, match="dense"):
        padded_to_jagged(to_nested([torch.ones(2)]), torch.tensor([1]))
    nt = to_nested([torch.ones(2), torch.ones(5)])
    with pytest.raises(NestedShapeError, match=r"max_len = 3 .*sample 1 has length 5"):
        jagged_to_padded(nt, max_len=3)
    with pytest.raises(TypeError, match="max_len"):
        jagged_to_padded(nt, max_len=5.0)


# -------------------------------------------------------------------------------------------- packed forms


@SETTINGS
@given(lengths=lengths_st, trailing=trailing_st)
def test_pack_unpack_round_trip(lengths, trailing):
    samples = _samples(lengths, trailing)
    nt = to_nested(samples)
    packed = pack_nested(nt)
    assert packed.cu_seqlens.dtype == torch.int32 and packed.position_ids.dtype == torch.int64
    assert packed.num_sequences == len(lengths) and packed.num_tokens == sum(lengths)
    assert packed.max_seqlen == max(lengths) and packed.lengths.tolist() == lengths
    assert packed.position_ids.tolist() == [p for n in lengths for p in range(n)]
    back = unpack_to_nested(packed.values, packed.cu_seqlens)
    for got, want in zip(back.unbind(), samples):
        assert torch.equal(got, want)
    assert torch.equal(nested_values(packed.to_nested()), nested_values(nt))


@SETTINGS
@given(lengths=lengths_st, side=st.sampled_from(["left", "right"]), trailing=trailing_st,
       extra=st.integers(0, 2))
def test_padded_packed_round_trip(lengths, side, trailing, extra):
    samples = _samples(lengths, trailing)
    packed = pack_nested(to_nested(samples))
    width = max(lengths) + extra
    padded, mask = packed_to_padded(packed.values, packed.cu_seqlens, side=side, pad_value=-3, max_len=width)
    assert padded.shape == (len(lengths), width, *trailing) and mask.dtype == torch.int64
    for i, n in enumerate(lengths):
        real = padded[i, width - n:] if side == "left" else padded[i, :n]
        pads = padded[i, : width - n] if side == "left" else padded[i, n:]
        assert torch.equal(real, samples[i]) and bool((pads == -3).all())
        assert mask[i].sum() == n
        assert mask[i].tolist() == ([0] * (width - n) + [1] * n if side == "left" else [1] * n + [0] * (width - n))
    again = padded_to_packed(padded, mask)
    assert torch.equal(again.values, packed.values) and torch.equal(again.cu_seqlens, packed.cu_seqlens)
    assert torch.equal(again.position_ids, packed.position_ids) and again.max_seqlen == packed.max_seqlen


def test_padded_to_packed_accepts_bool_mask_and_both_sided_padding():
    padded = torch.tensor([[0, 5, 6, 0], [7, 8, 9, 1]])
    mask = torch.tensor([[False, True, True, False], [True, True, True, True]])
    packed = padded_to_packed(padded, mask)
    assert packed.values.tolist() == [5, 6, 7, 8, 9, 1] and packed.position_ids.tolist() == [0, 1, 0, 1, 2, 3]


def test_packed_refusals():
    with pytest.raises(NestedShapeError, match="row 1 has 2 separate runs"):
        padded_to_packed(torch.zeros(2, 4), torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]]))
    with pytest.raises(NestedShapeError, match=r"attention_mask\[0, 2\] = 2"):
        padded_to_packed(torch.zeros(2, 4), torch.tensor([[1, 1, 2, 0], [1, 0, 0, 0]]))
    with pytest.raises(NestedShapeError, match="expected shape"):
        padded_to_packed(torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(NestedShapeError, match="padded"):
        padded_to_packed(torch.zeros(4), torch.ones(4))
    with pytest.raises(ValueError, match="side"):
        packed_to_padded(torch.zeros(3), torch.tensor([0, 3], dtype=torch.int32), side="middle")
    with pytest.raises(TypeError, match="int32"):
        PackedBatch(torch.zeros(2), torch.tensor([0, 2]), torch.arange(2), 2)
    with pytest.raises(NestedShapeError, match="values' 3 tokens"):
        PackedBatch(torch.zeros(3), torch.tensor([0, 2], dtype=torch.int32), torch.arange(2), 2)
    with pytest.raises(NestedShapeError, match="end at"):
        unpack_to_nested(torch.zeros(3), torch.tensor([0, 2], dtype=torch.int32))


# ---------------------------------------------------------------------------------------- log-prob shift


@st.composite
def _seq_and_response(draw):
    n = draw(st.integers(1, 6))
    prompts = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    responses = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    return prompts, responses


@SETTINGS
@given(pr=_seq_and_response(), trailing=st.sampled_from([(), (3,)]))
def test_response_values_from_packed_matches_loop(pr, trailing):
    prompts, responses = pr
    seq = [p + r for p, r in zip(prompts, responses)]
    cu = torch.tensor([0] + list(torch.tensor(seq).cumsum(0).tolist()), dtype=torch.int32)
    per_token = torch.randn(int(cu[-1]), *trailing)
    got = response_values_from_packed(per_token, cu, torch.tensor(responses))
    assert nested_lengths(got).tolist() == responses
    for i, comp in enumerate(got.unbind()):
        start, p = int(cu[i]), prompts[i]
        for j in range(responses[i]):
            # logits at position start + P + j - 1 predict response token j (token start + P + j).
            assert torch.equal(comp[j], per_token[start + p + j - 1])
    # The inverse scatter puts every value back and fills the rest.
    back = response_values_to_packed(got, cu, fill=float("nan"))
    used = ~torch.isnan(back)
    assert torch.equal(back[used], per_token[used])
    assert int(used.reshape(used.shape[0], -1)[:, 0].sum()) == sum(responses)


def test_response_values_from_packed_with_real_logits():
    """The shift matches gathering next-token log-probs from a packed forward's logits."""
    torch.manual_seed(0)
    prompts, responses, vocab = [2, 1, 3], [3, 0, 2], 11
    seqs = [torch.randint(0, vocab, (p + r,)) for p, r in zip(prompts, responses)]
    packed = pack_nested(to_nested(seqs))
    logits = torch.randn(packed.num_tokens, vocab)
    next_tok = torch.roll(packed.values, -1)  # token t + 1 at position t (the wrap is never used)
    logp = torch.log_softmax(logits, -1).gather(-1, next_tok.unsqueeze(-1)).squeeze(-1)
    got = response_values_from_packed(logp, packed.cu_seqlens, torch.tensor(responses))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        start = int(packed.cu_seqlens[i])
        want = [float(torch.log_softmax(logits[start + p + j - 1], -1)[seqs[i][p + j]]) for j in range(r)]
        assert got.unbind()[i].tolist() == pytest.approx(want)


def test_response_values_from_packed_refusals():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(NestedShapeError, match=r"sample 1: seq_len = 2, response_len = 2.*prompt_len = 0"):
        response_values_from_packed(torch.zeros(5), cu, torch.tensor([1, 2]))
    with pytest.raises(NestedShapeError, match=r"response_lens\[0\] = -1"):
        response_values_from_packed(torch.zeros(5), cu, torch.tensor([-1, 1]))
    with pytest.raises(NestedShapeError, match="expected 2 entries"):
        response_values_from_packed(torch.zeros(5), cu, torch.tensor([1]))
    with pytest.raises(NestedShapeError, match="has 4 positions"):
        response_values_from_packed(torch.zeros(4), cu, torch.tensor([1, 1]))
    with pytest.raises(NestedShapeError, match="start at 0"):
        response_values_from_packed(torch.zeros(5), torch.tensor([1, 3, 5]), torch.tensor([1, 1]))
    with pytest.raises(NestedShapeError, match="non-decreasing"):
        response_values_from_packed(torch.zeros(5), torch.tensor([0, 4, 3, 5]), torch.tensor([1, 0, 1]))
    with pytest.raises(TypeError, match="jagged"):
        response_values_to_packed(torch.zeros(2, 2), cu)


# ------------------------------------------------------------- the reference system's response_{from,to}_nested


@SETTINGS
@given(pr=_seq_and_response(), trailing=st.sampled_from([(), (3,)]))
def test_response_from_nested_is_the_shifted_response_slice(pr, trailing):
    """Row i is full[i][L - R - 1 : L - 1]: the outputs at the positions that predict the response tokens."""
    prompts, responses = pr
    full = to_nested([torch.randn(p + r, *trailing) for p, r in zip(prompts, responses)])
    mask = to_nested([torch.ones(r, dtype=torch.int64) for r in responses])
    got = response_from_nested(full, mask)
    assert is_jagged(got) and nested_lengths(got).tolist() == responses
    for comp, row, p, r in zip(got.unbind(), full.unbind(), prompts, responses):
        assert torch.equal(comp, row[p - 1:p + r - 1])


@SETTINGS
@given(lengths=lengths_st, extra=st.integers(0, 3), trailing=trailing_st)
def test_response_to_nested_takes_lengths_from_the_mask(lengths, extra, trailing):
    width = max(lengths) + extra
    padded = torch.randn(len(lengths), width, *trailing)
    mask = to_nested([torch.ones(k, dtype=torch.bool) for k in lengths])
    got = response_to_nested(padded, mask)
    assert nested_lengths(got).tolist() == lengths
    for i, comp in enumerate(got.unbind()):
        assert torch.equal(comp, padded[i, :lengths[i]])
    assert torch.equal(nested_values(got), nested_values(padded_to_jagged(padded, torch.tensor(lengths))))


def test_verl_named_helpers_refusals():
    full = to_nested([torch.arange(3.0), torch.arange(2.0)])
    with pytest.raises(NestedShapeError, match=r"sample 1: seq_len = 2, response_len = 2.*prompt_len = 0"):
        response_from_nested(full, to_nested([torch.ones(1), torch.ones(2)]))
    with pytest.raises(NestedShapeError, match="has 1 samples but tensor has 2"):
        response_from_nested(full, to_nested([torch.ones(1)]))
    # A dense mask or per-sample lengths are the other helpers' inputs; the message says which to use.
    for bad in (torch.ones(2, 2), torch.tensor([1, 1])):
        with pytest.raises(NestedLayoutError, match="padded_to_jagged"):
            response_to_nested(torch.zeros(2, 2), bad)
        with pytest.raises(AssertionError):  # the reference system asserts ``response_mask.is_nested``
            response_from_nested(full, bad)
    with pytest.raises(NestedShapeError, match="exceeds the padded width"):
        response_to_nested(torch.zeros(1, 2), to_nested([torch.ones(3)]))
    with pytest.raises(TypeError, match="tensor: expected a jagged"):
        response_from_nested(torch.zeros(2, 3), to_nested([torch.ones(1), torch.ones(1)]))


def test_docstring_examples_run():
    import doctest

    import protocol.batch.nested as nested_mod
    import protocol.batch.serialize as serialize_mod

    for mod in (nested_mod, serialize_mod):
        result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.attempted > 0 and result.failed == 0, mod.__name__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_conversions_on_cuda():
    nt = to_nested([torch.arange(3, device="cuda"), torch.zeros(0, dtype=torch.int64, device="cuda")])
    assert nt.device.type == "cuda" and nested_lengths(nt).tolist() == [3, 0]
    packed = pack_nested(nt)
    padded, mask = packed_to_padded(packed.values, packed.cu_seqlens, side="left")
    assert padded.device.type == "cuda" and padded.tolist() == [[0, 1, 2], [0, 0, 0]] and mask.sum() == 3
    got = response_values_from_packed(torch.arange(3.0, device="cuda"), packed.cu_seqlens, torch.tensor([2, 0]))
    assert got.device.type == "cuda" and nested_values(got).tolist() == [0.0, 1.0]


@SETTINGS
@given(lengths=lengths_st, trailing=trailing_st)
def test_nested_from_lengths_equals_nested_from_values(lengths, trailing):
    """The trusted constructor gives the same jagged tensor (values, offsets, cached min/max, rows) as the checked
    one, and hands lengths it cannot use to it, for the same error."""
    import numpy as np

    from protocol.batch.nested import jagged_parts, nested_from_lengths

    values = torch.cat(_samples(lengths, trailing))
    offsets = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)
    got, want = nested_from_lengths(values, np.array(lengths, dtype=np.int64)), nested_from_values(values, offsets)
    assert is_jagged(got) and got.shape[0] == want.shape[0]
    assert torch.equal(jagged_parts(got)[1], jagged_parts(want)[1]) and torch.equal(got.values(), want.values())
    assert got._metadata_cache.keys() == want._metadata_cache.keys()
    assert (got._min_seqlen, got._max_seqlen) == (want._min_seqlen, want._max_seqlen)
    assert all(torch.equal(a, b) for a, b in zip(got.unbind(), want.unbind()))
    with pytest.raises(NestedShapeError):
        nested_from_lengths(values, np.array([*lengths, 1], dtype=np.int64))  # one token more than values hold


def test_jagged_parts_compact_holes_and_keep_gradients():
    """A narrowed jagged tensor (holes) comes back compacted; values that record gradients are read through the
    view-tracking call, so a loss on the parts reaches the leaves, also through the trusted constructor."""
    import numpy as np

    from protocol.batch.nested import jagged_parts, nested_from_lengths

    dense = torch.arange(8.0).reshape(2, 4)
    nt = torch.nested.narrow(dense, 1, torch.tensor([1, 0]), torch.tensor([2, 3]), layout=torch.jagged)
    values, offsets = jagged_parts(nt)
    assert offsets.tolist() == [0, 2, 5] and values.tolist() == [1.0, 2.0, 4.0, 5.0, 6.0]
    leaf = torch.arange(5.0, requires_grad=True)
    nt = nested_from_lengths(leaf * 1.0, np.array([2, 3], dtype=np.int64)) * 3.0
    (jagged_to_padded(nt) * torch.tensor([[1.0, 2.0, 0.0], [1.0, 1.0, 1.0]])).sum().backward()
    assert leaf.grad.tolist() == [3.0, 6.0, 3.0, 3.0, 3.0]
    with torch.no_grad():
        assert not jagged_parts(nested_from_lengths(leaf * 1.0, np.array([5], dtype=np.int64)))[0].requires_grad


def test_batch_of_equals_the_tensordict_constructor():
    """A checked batch is the TensorDict the constructor builds (same keys, batch size, value objects); a wrong dim 0
    or a value that is not a plain tensor goes to the constructor, with its error or its conversion."""
    from tensordict import TensorDict

    from protocol.store.batching import batch_of

    fields = {"x": to_nested([torch.ones(2), torch.ones(3)]), "y": torch.zeros(2, 4)}
    got, want = batch_of(fields, 2), TensorDict(fields, batch_size=[2])
    assert type(got) is type(want) and got.batch_size == want.batch_size and got.device == want.device
    assert list(got.keys()) == list(want.keys()) and got["x"] is fields["x"] and got["y"] is fields["y"]
    assert got[1]["x"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(RuntimeError, match="batch dimension mismatch"):
        batch_of({"x": fields["x"]}, 3)
    assert batch_of({"s": torch.nn.Parameter(torch.zeros(2))}, 2)["s"].shape == (2,)
    assert batch_of({}, 5).batch_size == torch.Size([5])
