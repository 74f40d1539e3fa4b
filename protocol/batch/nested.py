"""Jagged (nested) per-sample tensors and their padded and packed forms: the shapes every stage converts between.

Three representations of a batch of ``n`` variable-length sequences appear in this project:

* **jagged** – a ``torch.nested`` tensor with ``layout=torch.jagged``: ``nt.values()`` holds all tokens back to
  back (``[T, ...]``) and ``nt.offsets()`` (int64 ``[n + 1]``) marks where each sample starts. The store keeps
  per-trajectory fields in this form. Zero-length samples are allowed (equal consecutive offsets).
* **padded** – a dense ``[n, L, ...]`` tensor plus per-sample lengths or a 0/1 attention mask; responses are right
  padded, prompts may be left padded (:func:`jagged_to_padded` / :func:`padded_to_jagged`).
* **packed** – :class:`PackedBatch`: the jagged values with ``cu_seqlens`` (int32 ``[n + 1]``), ``position_ids``
  restarting at 0 in every sequence and ``max_seqlen``; what a remove-padding (varlen) forward consumes.

Every conversion here is lossless in both directions and keeps autograd (values move by ``cat`` / indexing).
:func:`response_from_nested` and :func:`response_to_nested` carry the reference system's names *and* meaning (a nested
response mask gives the lengths; the former slices the response out of a full-sequence model output, shifted by one).

Example::

    >>> import torch
    >>> nt = to_nested([torch.tensor([1, 2, 3]), torch.tensor([], dtype=torch.int64), torch.tensor([4])])
    >>> nested_lengths(nt).tolist()
    [3, 0, 1]
    >>> jagged_to_padded(nt, pad_value=-1).tolist()
    [[1, 2, 3], [-1, -1, -1], [4, -1, -1]]
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import torch
from torch import Tensor
# torch's jagged-layout tensor class: an isinstance check and its fields cost ~0.1 us, where the public accessors
# (``t.layout``, ``values()``, ``is_contiguous()``) each pass through its Python dispatch (~25-35 us)
from torch.nested._internal.nested_tensor import NestedTensor as _Jagged
from torch.nested._internal.nested_tensor import _store_val_in_tensor

__all__ = [
    "NestedShapeError",
    "NestedLayoutError",
    "is_jagged",
    "is_strided_nested",
    "strided_nested",
    "to_nested",
    "nested_from_values",
    "nested_from_lengths",
    "nested_lengths",
    "nested_offsets",
    "nested_values",
    "padded_to_jagged",
    "padded_to_jagged_many",
    "field_parts",
    "jagged_to_padded",
    "jagged_parts",
    "response_to_nested",
    "response_from_nested",
    "PackedBatch",
    "pack_nested",
    "unpack_to_nested",
    "padded_to_packed",
    "packed_to_padded",
    "response_values_from_packed",
    "response_values_to_packed",
]


class NestedShapeError(ValueError, AssertionError):
    """A tensor whose lengths, offsets, mask or shape do not describe a valid batch of sequences.

    Also an ``AssertionError``: the reference system asserts these conditions, so its ``except`` clauses still match.
    """


class NestedLayoutError(TypeError, AssertionError):
    """A tensor that is not in the layout a function needs (a jagged nested tensor where one is required)."""


def is_jagged(t: object) -> bool:
    """True for a ``torch.nested`` tensor with jagged layout (the store's per-sample variable-length form)."""
    return isinstance(t, _Jagged)


def _records_grad(t: Tensor) -> bool:
    """Whether an op on ``t`` records autograd history: only then must values be read through the view-tracking
    public calls (a jagged tensor's own ``_values`` carry no graph back to it)."""
    if not torch.is_grad_enabled():
        return False
    with torch._C.DisableTorchFunctionSubclass():  # the plain attribute, not the jagged tensor's dispatch
        return t.requires_grad


def is_strided_nested(t: object) -> bool:
    """True for a ``torch.nested`` tensor with the strided layout (samples may be ragged in several dimensions)."""
    return isinstance(t, Tensor) and t.is_nested and t.layout == torch.strided


def strided_nested(components: Sequence[Tensor], *, dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None) -> Tensor:
    """Strided nested tensor from per-sample tensors of one rank (any of their dims may differ); ``[]`` gives ``n = 0``.

    The strided layout is what the reference system builds with ``torch.nested.as_nested_tensor(list)``; torch's
    prototype-stage warning for it is silenced here, since choosing the layout is deliberate.
    """
    components = list(components)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if not components:
            return torch.nested.as_nested_tensor([], dtype=dtype or torch.float32, device=device,
                                                 layout=torch.strided)
        return torch.nested.as_nested_tensor(components, dtype=dtype, device=device, layout=torch.strided)


def _check_jagged(nt: Tensor, name: str = "nt") -> None:
    if not is_jagged(nt):
        found = f"{type(nt).__name__}" if not isinstance(nt, Tensor) else f"tensor with layout {nt.layout}"
        raise NestedLayoutError(f"{name}: expected a jagged nested tensor (layout=torch.jagged), found {found}")
    if nt._ragged_idx != 1:
        raise NestedShapeError(f"{name}: expected the ragged dimension at dim 1, found it at dim {nt._ragged_idx}")


def _check_lengths(lengths: Tensor, name: str = "lengths") -> Tensor:
    if not isinstance(lengths, Tensor):
        lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1:
        raise NestedShapeError(f"{name}: expected a 1-D tensor of per-sample lengths, found shape {tuple(lengths.shape)}")
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.is_complex():
        raise TypeError(f"{name}: expected an integer tensor, found dtype {lengths.dtype}")
    lengths = lengths.to(torch.int64)
    if lengths.numel() and int(lengths.min()) < 0:
        i = int(torch.nonzero(lengths < 0)[0, 0])
        raise NestedShapeError(f"{name}[{i}] = {int(lengths[i])} is negative; lengths must be >= 0")
    return lengths


def _offsets_from_lengths(lengths: Tensor) -> Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def nested_from_values(values: Tensor, offsets: Tensor) -> Tensor:
    """Jagged tensor viewing ``values`` ``[T, ...]`` split at ``offsets`` (int ``[n + 1]``, 0 .. T, non-decreasing).

    Works for ``n = 0`` (``offsets = [0]``) and for zero-length samples; caches min/max length so later
    padding needs no extra pass.
    """
    if not isinstance(values, Tensor) or values.is_nested:
        raise TypeError(f"values: expected a dense tensor [T, ...], found {type(values).__name__}")
    if values.dim() < 1:
        raise NestedShapeError("values: expected at least 1 dimension [T, ...], found a scalar")
    offsets = torch.as_tensor(offsets)
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise NestedShapeError(f"offsets: expected a 1-D tensor [n + 1] with n >= 0, found shape {tuple(offsets.shape)}")
    if offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
        raise TypeError(f"offsets: expected an integer tensor, found dtype {offsets.dtype}")
    offsets = offsets.to(device=values.device, dtype=torch.int64)
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0 or last != values.shape[0]:
        raise NestedShapeError(
            f"offsets: expected to start at 0 and end at len(values) = {values.shape[0]}, found {first} .. {last}")
    lengths = offsets.diff()
    if lengths.numel() and int(lengths.min()) < 0:
        i = int(torch.nonzero(lengths < 0)[0, 0])
        raise NestedShapeError(f"offsets: must be non-decreasing, found offsets[{i}] = {int(offsets[i])} > "
                               f"offsets[{i + 1}] = {int(offsets[i + 1])}")
    if lengths.numel():
        min_len, max_len = int(lengths.min()), int(lengths.max())
    else:
        min_len = max_len = 0
    return _jagged(values, offsets, min_len, max_len)


def nested_from_lengths(values: Tensor, lengths: np.ndarray) -> Tensor:
    """Jagged tensor cutting ``values`` ``[T, ...]`` into rows of ``lengths`` (a non-negative int64 numpy array that
    sums to ``T``), for callers that computed the lengths themselves: the checks of :func:`nested_from_values`
    become one sum, and the offsets and min/max lengths come from numpy.

    >>> nested_from_lengths(torch.arange(3), np.array([2, 0, 1])).offsets().tolist()
    [0, 2, 2, 3]
    """
    if lengths.dtype != np.int64 or lengths.ndim != 1 or int(lengths.sum()) != values.shape[0] or \
            (lengths.size and int(lengths.min()) < 0):
        return nested_from_values(values, _offsets_np(lengths.astype(np.int64, copy=False)))  # names the problem
    offsets = _offsets_np(lengths)
    if not lengths.size:
        return _jagged(values, offsets, 0, 0)
    return _jagged(values, offsets, int(lengths.min()), int(lengths.max()))


def _offsets_np(lengths: np.ndarray) -> Tensor:
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return torch.from_numpy(offsets)


def _jagged(values: Tensor, offsets: Tensor, min_len: int, max_len: int) -> Tensor:
    """A jagged tensor over checked ``values`` / ``offsets`` with its min/max length cached.

    Without autograd history to keep, it is built the way torch's own view op builds it, minus that op's dispatch
    (a third of the cost); values that record gradients go through the public view, so gradients reach them.
    """
    if _records_grad(values):
        return torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=min_len, max_seqlen=max_len)
    return _Jagged(values, offsets, _ragged_idx=1, _metadata_cache={"min_seqlen": _store_val_in_tensor(min_len),
                                                                    "max_seqlen": _store_val_in_tensor(max_len)})


def to_nested(tensors: Sequence[Tensor], *, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None) -> Tensor:
    """Jagged nested tensor (``layout=torch.jagged``) from per-sample ``[len_i, ...]`` tensors.

    Zero-length samples and batches of one are supported; an empty sequence gives an ``n = 0`` jagged tensor
    (of ``dtype``, default float32, 1-D components). All samples must share dtype, device and trailing dims.
    Autograd flows through (values are concatenated, not copied out of the graph).

    >>> to_nested([torch.ones(2), torch.ones(0)]).offsets().tolist()
    [0, 2, 2]
    """
    if isinstance(tensors, Tensor):
        if tensors.is_nested:
            raise TypeError("tensors: already a nested tensor; pass a sequence of per-sample tensors")
        tensors = list(tensors.unbind(0))
    tensors = list(tensors)
    if not tensors:
        empty = torch.zeros(0, dtype=dtype or torch.float32, device=device)
        return nested_from_values(empty, torch.zeros(1, dtype=torch.int64, device=device))
    converted = []
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            t = torch.as_tensor(t)
        if t.is_nested:
            raise TypeError(f"tensors[{i}]: expected a dense per-sample tensor, found a nested tensor")
        if t.dim() < 1:
            raise NestedShapeError(f"tensors[{i}]: expected shape [len, ...] (at least 1-D), found a scalar")
        converted.append(t)
    ref = converted[0]
    for i, t in enumerate(converted[1:], start=1):
        if t.shape[1:] != ref.shape[1:]:
            raise NestedShapeError(f"tensors[{i}]: trailing shape {tuple(t.shape[1:])} differs from tensors[0]'s "
                                   f"{tuple(ref.shape[1:])}; only dim 0 may vary")
        if t.dtype != ref.dtype:
            raise TypeError(f"tensors[{i}]: dtype {t.dtype} differs from tensors[0]'s {ref.dtype}")
        if t.device != ref.device:
            raise NestedShapeError(f"tensors[{i}]: device {t.device} differs from tensors[0]'s {ref.device}")
    lengths = torch.tensor([t.shape[0] for t in converted], dtype=torch.int64, device=ref.device)
    values = torch.cat(converted, 0)
    if dtype is not None or device is not None:
        values = values.to(dtype=dtype or values.dtype, device=device or values.device)
        lengths = lengths.to(values.device)
    return nested_from_values(values, _offsets_from_lengths(lengths))


def _contiguous(nt: Tensor) -> Tensor:
    # A jagged tensor with holes (``lengths()`` set, e.g. from narrow) is compacted so values/offsets describe it;
    # the test is the jagged ``is_contiguous`` itself: no holes and contiguous values
    if nt._lengths is not None or not nt._values.is_contiguous():
        nt = nt.contiguous()
    return nt


def _values_of(nt: Tensor) -> Tensor:
    return nt.values() if _records_grad(nt) else nt._values


def jagged_parts(nt: Tensor) -> tuple[Tensor, Tensor]:
    """``(values [T, ...], int64 offsets [n + 1])`` of a jagged tensor, compacting it first if it has holes.

    >>> v, o = jagged_parts(to_nested([torch.ones(2), torch.ones(1)]))
    >>> v.shape, o.tolist()
    (torch.Size([3]), [0, 2, 3])
    """
    _check_jagged(nt)
    nt = _contiguous(nt)
    offsets = nt._offsets
    return _values_of(nt), offsets if offsets.dtype == torch.int64 else offsets.to(torch.int64)


def field_parts(value: Tensor) -> tuple[Tensor, Tensor | None]:
    """A batch field as what travels or is stored flat: ``(values, int64 offsets)`` of a jagged tensor (compacted
    first if it has holes), ``(value, None)`` of a dense one."""
    return jagged_parts(value) if is_jagged(value) else (value, None)


def nested_offsets(nt: Tensor) -> Tensor:
    """Int64 offsets ``[n + 1]`` of a jagged tensor, compacting it first if it has holes."""
    return jagged_parts(nt)[1]


def nested_values(nt: Tensor) -> Tensor:
    """All components of a jagged tensor back to back (``[T, ...]``), compacting it first if it has holes."""
    return jagged_parts(nt)[0]


def nested_lengths(nt: Tensor) -> Tensor:
    """Per-sample lengths (int64 ``[n]``) of a jagged tensor's ragged dimension."""
    _check_jagged(nt)
    if nt._lengths is not None:
        return nt._lengths.to(torch.int64)
    return nt._offsets.diff().to(torch.int64)


def padded_to_jagged(padded: Tensor, lengths: Tensor) -> Tensor:
    """Jagged tensor keeping the first ``lengths[i]`` entries of row ``i`` of right-padded ``padded`` ``[n, L, ...]``.

    >>> padded_to_jagged(torch.tensor([[1, 2, 0], [3, 0, 0]]), torch.tensor([2, 1])).values().tolist()
    [1, 2, 3]
    """
    return padded_to_jagged_many([padded], lengths)[0]


def padded_to_jagged_many(padded: Sequence[Tensor], lengths: Tensor) -> list[Tensor]:
    """:func:`padded_to_jagged` of several ``[n, L, ...]`` tensors cut at the same ``lengths``: the lengths are
    checked, and the row mask and offsets made, once (the jagged tensors share their offsets).

    >>> [t.values().tolist() for t in padded_to_jagged_many([torch.ones(2, 2), torch.zeros(2, 2)], torch.tensor([1, 2]))]
    [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    """
    padded = list(padded)
    for t in padded:
        if not isinstance(t, Tensor) or t.is_nested:
            raise TypeError(f"padded: expected a dense tensor [n, L, ...], found {type(t).__name__}")
        if t.dim() < 2:
            raise NestedShapeError(f"padded: expected shape [n, L, ...], found {tuple(t.shape)}")
        if t.shape[:2] != padded[0].shape[:2] or t.device != padded[0].device:
            raise NestedShapeError(f"padded: every tensor must have the rows and width {tuple(padded[0].shape[:2])} "
                                   f"on {padded[0].device} of the first, found {tuple(t.shape[:2])} on {t.device}")
    if not padded:
        return []
    first = padded[0]
    lengths = _check_lengths(lengths).to(first.device)
    n, width = first.shape[0], first.shape[1]
    if lengths.numel() != n:
        raise NestedShapeError(f"lengths: expected {n} entries (one per row of padded), found {lengths.numel()}")
    lo, hi = (int(lengths.min()), int(lengths.max())) if n else (0, 0)  # lengths are checked: len >= 0
    if hi > width:
        i = int(torch.nonzero(lengths > width)[0, 0])
        raise NestedShapeError(f"lengths[{i}] = {int(lengths[i])} exceeds the padded width L = {width} "
                               f"(sample {i} would read past its row)")
    offsets = _offsets_from_lengths(lengths)
    if all(map(_numpy_ok, padded)):  # the CPU rows taken by numpy: a third of the torch mask's cost
        keep_np = np.arange(width) < lengths.numpy()[:, None]
        return [_jagged(torch.from_numpy(t.numpy()[keep_np]), offsets, lo, hi) for t in padded]
    keep = torch.arange(width, device=first.device).unsqueeze(0) < lengths.unsqueeze(1)
    return [_jagged(t[keep], offsets, lo, hi) for t in padded]


#: dtypes numpy holds exactly (no bfloat16 or complex half)
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool})


def _numpy_ok(t: Tensor) -> bool:
    """``t`` can be read and written through numpy: a CPU tensor of a numpy dtype that records no gradient."""
    return t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES and not t.requires_grad


def jagged_to_padded(nt: Tensor, pad_value: float | int | bool = 0, max_len: int | None = None) -> Tensor:
    """Right-padded dense ``[n, L, ...]`` from a jagged tensor; ``L = max_len`` or the longest sample.

    >>> jagged_to_padded(to_nested([torch.ones(1), torch.ones(2)]), max_len=3).tolist()
    [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    """
    values, offsets = jagged_parts(nt)
    lengths = offsets.diff()
    longest = int(lengths.max()) if lengths.numel() else 0
    if max_len is None:
        width = longest
    else:
        if isinstance(max_len, bool) or not isinstance(max_len, int):
            raise TypeError(f"max_len: expected an int or None, found {type(max_len).__name__}")
        if max_len < longest:
            i = int(torch.argmax(lengths))
            raise NestedShapeError(f"max_len = {max_len} is shorter than the longest sample "
                                   f"(sample {i} has length {longest}); nothing may be truncated")
        width = max_len
    n = lengths.numel()
    if _numpy_ok(values):  # a third of the torch ops' cost on the CPU, for the small batches of a step's stages
        out = np.full((n, width, *values.shape[1:]), pad_value, dtype=values.numpy().dtype)
        out[np.arange(width) < lengths.numpy()[:, None]] = values.numpy()
        return torch.from_numpy(out)
    rows = torch.repeat_interleave(torch.arange(n, device=values.device), lengths)
    cols = torch.arange(values.shape[0], device=values.device) - torch.repeat_interleave(offsets[:-1], lengths)
    out = values.new_full((n, width, *values.shape[1:]), pad_value)
    return out.index_put((rows, cols), values)


def _mask_lengths(response_mask: Tensor) -> Tensor:
    if not is_jagged(response_mask):
        found = type(response_mask).__name__ if not isinstance(response_mask, Tensor) else \
            f"a tensor with layout {response_mask.layout}{' (dense)' if not response_mask.is_nested else ''}"
        raise NestedLayoutError(f"response_mask: expected a jagged nested tensor [n, response_len_i] whose lengths are "
                                f"the response lengths, found {found}; for per-sample lengths use padded_to_jagged / "
                                f"response_values_from_packed")
    return nested_lengths(response_mask)


def response_to_nested(tensor: Tensor, response_mask: Tensor) -> Tensor:
    """Jagged ``[n, response_len_i, ...]`` from a right-padded response tensor ``[n, L, ...]`` and a jagged mask.

    Row ``i`` keeps its first ``len(response_mask[i])`` entries (the reference system's name and signature); a row
    shorter than its response length is an error, never a silent truncation.

    >>> mask = to_nested([torch.ones(2, dtype=torch.int64), torch.ones(1, dtype=torch.int64)])
    >>> response_to_nested(torch.tensor([[1, 2, 0], [3, 0, 0]]), mask).values().tolist()
    [1, 2, 3]
    """
    return padded_to_jagged(tensor, _mask_lengths(response_mask))


def response_from_nested(tensor: Tensor, response_mask: Tensor) -> Tensor:
    """The response part of a full-sequence (prompt ⧺ response) model output, shifted by one position.

    ``tensor`` is jagged ``[n, seq_len_i, ...]`` with ``tensor[i][t]`` computed from the logits at position ``t``
    (which predict token ``t + 1``); ``response_mask`` is jagged ``[n, response_len_i]``. With ``L = seq_len_i`` and
    ``R = response_len_i`` the result's row ``i`` is ``tensor[i][L - R - 1 : L - 1]`` (the reference system's name,
    signature and meaning). ``L - R >= 1`` (a non-empty prompt) is required, else an error naming the sample.

    >>> out = to_nested([torch.tensor([10, 11, 12, 13])])  # prompt of 2, response of 2
    >>> response_from_nested(out, to_nested([torch.ones(2)])).values().tolist()
    [11, 12]
    """
    _check_jagged(tensor, "tensor")
    tensor = _contiguous(tensor)
    lengths = _mask_lengths(response_mask).to(tensor.device)
    n = tensor.size(0)
    if lengths.numel() != n:
        raise NestedShapeError(f"response_mask: has {lengths.numel()} samples but tensor has {n}")
    return response_values_from_packed(tensor.values(), tensor.offsets(), lengths)


@dataclass(frozen=True)
class PackedBatch:
    """Sequences packed back to back for a varlen (remove-padding) forward.

    ``values`` ``[T, ...]``; ``cu_seqlens`` int32 ``[n + 1]`` (cumulative lengths, starts at 0, ends at T);
    ``position_ids`` int64 ``[T]`` restarting at 0 in every sequence; ``max_seqlen`` the longest length.
    """

    values: Tensor
    cu_seqlens: Tensor
    position_ids: Tensor
    max_seqlen: int

    def __post_init__(self) -> None:
        if self.cu_seqlens.dtype != torch.int32:
            raise TypeError(f"PackedBatch.cu_seqlens: expected int32, found {self.cu_seqlens.dtype}")
        if self.position_ids.dtype != torch.int64:
            raise TypeError(f"PackedBatch.position_ids: expected int64, found {self.position_ids.dtype}")
        total = self.values.shape[0]
        if int(self.cu_seqlens[-1]) != total or self.position_ids.shape != (total,):
            raise NestedShapeError(
                f"PackedBatch: cu_seqlens ends at {int(self.cu_seqlens[-1])} and position_ids has shape "
                f"{tuple(self.position_ids.shape)}; both must match values' {total} tokens")

    @property
    def num_sequences(self) -> int:
        """Number of packed sequences ``n``."""
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        """Total packed tokens ``T``."""
        return int(self.values.shape[0])

    @property
    def lengths(self) -> Tensor:
        """Per-sequence lengths (int64 ``[n]``)."""
        return self.cu_seqlens.diff().to(torch.int64)

    def to_nested(self) -> Tensor:
        """The same sequences as a jagged tensor."""
        return unpack_to_nested(self.values, self.cu_seqlens)


def _position_ids(offsets: Tensor, lengths: Tensor, total: int) -> Tensor:
    return (torch.arange(total, device=offsets.device, dtype=torch.int64)
            - torch.repeat_interleave(offsets[:-1].to(torch.int64), lengths))


def _packed_from(values: Tensor, lengths: Tensor) -> PackedBatch:
    offsets = _offsets_from_lengths(lengths)
    return PackedBatch(values=values, cu_seqlens=offsets.to(torch.int32),
                       position_ids=_position_ids(offsets, lengths, values.shape[0]),
                       max_seqlen=int(lengths.max()) if lengths.numel() else 0)


def pack_nested(nt: Tensor) -> PackedBatch:
    """Pack a jagged tensor into :class:`PackedBatch` (values shared, int32 cu_seqlens, restarting positions)."""
    _check_jagged(nt)
    nt = _contiguous(nt)
    return _packed_from(nt.values(), nested_lengths(nt))


def unpack_to_nested(values: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Jagged tensor from packed ``values`` ``[T, ...]`` and cumulative lengths ``cu_seqlens`` ``[n + 1]``."""
    return nested_from_values(values, cu_seqlens)


def _check_mask(mask: Tensor, shape: torch.Size, name: str = "attention_mask") -> Tensor:
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name}: expected a tensor, found {type(mask).__name__}")
    if mask.shape != shape:
        raise NestedShapeError(f"{name}: expected shape {tuple(shape)} (the first two dims of padded), "
                               f"found {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            r, c = (int(v) for v in torch.nonzero(bad)[0])
            raise NestedShapeError(f"{name}[{r}, {c}] = {mask[r, c].item()}; expected 0/1 (1 = real token)")
        mask = mask != 0
    return mask


def padded_to_packed(padded: Tensor, attention_mask: Tensor) -> PackedBatch:
    """Pack a left- or right-padded ``[n, L, ...]`` batch; ``attention_mask`` ``[n, L]`` is 1 on real tokens.

    Each row's real tokens must form one contiguous run (left padding, right padding, or both); a row with a
    hole is refused, naming the row.
    """
    if not isinstance(padded, Tensor) or padded.is_nested or padded.dim() < 2:
        raise NestedShapeError(f"padded: expected a dense tensor [n, L, ...], found "
                               f"{tuple(padded.shape) if isinstance(padded, Tensor) else type(padded).__name__}")
    mask = _check_mask(attention_mask, padded.shape[:2]).to(padded.device)
    lengths = mask.sum(1, dtype=torch.int64)
    # One contiguous run per row <=> number of 0->1 rising edges (with a 0 prepended) is <= 1.
    if mask.numel():
        edges = (mask[:, 1:] & ~mask[:, :-1]).sum(1) + mask[:, 0].to(torch.int64)
        if bool((edges > 1).any()):
            r = int(torch.nonzero(edges > 1)[0, 0])
            raise NestedShapeError(f"attention_mask row {r} has {int(edges[r])} separate runs of real tokens; "
                                   f"expected one contiguous run (left or right padding)")
    return _packed_from(padded[mask], lengths)


def packed_to_padded(values: Tensor, cu_seqlens: Tensor, side: Literal["left", "right"] = "right",
                     pad_value: float | int | bool = 0, max_len: int | None = None) -> tuple[Tensor, Tensor]:
    """Dense ``[n, L, ...]`` padded on ``side`` from packed values, with its int64 attention mask ``[n, L]``."""
    if side not in ("left", "right"):
        raise ValueError(f"side: expected 'left' or 'right', found {side!r}")
    nt = unpack_to_nested(values, cu_seqlens)
    padded = jagged_to_padded(nt, pad_value=pad_value, max_len=max_len)
    lengths = nested_lengths(nt)
    width = padded.shape[1]
    cols = torch.arange(width, device=values.device).unsqueeze(0)
    mask = cols < lengths.unsqueeze(1)
    if side == "left":
        # Shift row i right by (width - len_i): gather from column (c - shift) where valid.
        shift = (width - lengths).unsqueeze(1)
        src = (cols - shift).clamp(min=0)
        gather_idx = src.view(*src.shape, *([1] * (padded.dim() - 2))).expand_as(padded)
        shifted = torch.gather(padded, 1, gather_idx)
        mask = cols >= shift
        fill = torch.full_like(padded, pad_value)
        bmask = mask.view(*mask.shape, *([1] * (padded.dim() - 2)))
        padded = torch.where(bmask, shifted, fill)
    return padded, mask.to(torch.int64)


def _response_positions(cu_seqlens: Tensor, response_lens: Tensor) -> tuple[Tensor, Tensor]:
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 1:
        raise NestedShapeError(f"cu_seqlens: expected a 1-D tensor [n + 1], found shape {tuple(cu.shape)}")
    cu = cu.to(torch.int64)
    seq_lens = cu.diff()
    if seq_lens.numel() and int(seq_lens.min()) < 0:
        i = int(torch.nonzero(seq_lens < 0)[0, 0])
        raise NestedShapeError(f"cu_seqlens: must be non-decreasing, found a drop after sample {i}")
    response_lens = _check_lengths(response_lens, "response_lens").to(cu.device)
    if response_lens.numel() != seq_lens.numel():
        raise NestedShapeError(f"response_lens: expected {seq_lens.numel()} entries (one per packed sequence), "
                               f"found {response_lens.numel()}")
    prompt_lens = seq_lens - response_lens
    if prompt_lens.numel() and int(prompt_lens.min()) < 1:
        i = int(torch.nonzero(prompt_lens < 1)[0, 0])
        raise NestedShapeError(
            f"sample {i}: seq_len = {int(seq_lens[i])}, response_len = {int(response_lens[i])} gives prompt_len = "
            f"{int(prompt_lens[i])}; prompt_len >= 1 is required (the first response token is predicted by the "
            f"last prompt position)")
    first = cu[:-1] + prompt_lens - 1  # logits at P - 1 predict response token 0
    out_offsets = _offsets_from_lengths(response_lens)
    total = int(out_offsets[-1])
    idx = (torch.repeat_interleave(first, response_lens)
           + torch.arange(total, device=cu.device) - torch.repeat_interleave(out_offsets[:-1], response_lens))
    return idx, out_offsets


def response_values_from_packed(per_token: Tensor, cu_seqlens: Tensor, response_lens: Tensor) -> Tensor:
    """Per-response-token values (jagged) from a per-position quantity of a packed prompt ⧺ response forward.

    ``per_token[t]`` (``[T, ...]``) must be computed from the logits at packed position ``t``, which predict token
    ``t + 1`` (e.g. the log-prob of the next token). For sample ``i`` with ``L = seq_len`` (from ``cu_seqlens``),
    ``R = response_lens[i]`` and ``P = L - R``, response token ``j`` is predicted at position ``start + P + j - 1``,
    so the result holds ``per_token[start + P - 1 : start + L - 1]``. ``P >= 1`` is required (else an error
    naming the sample); the value at each sequence's last position (predicting past the end) is never used.
    """
    if not isinstance(per_token, Tensor) or per_token.is_nested or per_token.dim() < 1:
        raise NestedShapeError("per_token: expected a dense tensor [T, ...] over packed positions")
    cu = torch.as_tensor(cu_seqlens)
    if cu.numel() and int(cu[-1]) != per_token.shape[0]:
        raise NestedShapeError(f"per_token: has {per_token.shape[0]} positions but cu_seqlens ends at {int(cu[-1])}")
    if cu.numel() and int(cu[0]) != 0:
        raise NestedShapeError(f"cu_seqlens: expected to start at 0, found {int(cu[0])}")
    idx, out_offsets = _response_positions(cu.to(per_token.device), response_lens)
    return nested_from_values(per_token[idx], out_offsets)


def response_values_to_packed(response_values: Tensor, cu_seqlens: Tensor, fill: float | int = 0) -> Tensor:
    """Inverse of :func:`response_values_from_packed`: scatter jagged response values onto packed positions.

    Position ``start + P + j - 1`` of sample ``i`` receives its response value ``j``; every other position
    (the prompt's first ``P - 1`` positions and each sequence's last) holds ``fill``.
    Use it to align per-response-token targets (old log-probs, advantages) with a packed forward's outputs.
    """
    _check_jagged(response_values, "response_values")
    response_values = _contiguous(response_values)
    cu = torch.as_tensor(cu_seqlens).to(response_values.device)
    idx, _ = _response_positions(cu, nested_lengths(response_values))
    vals = response_values.values()
    total = int(cu[-1]) if cu.numel() else 0
    out = vals.new_full((total, *vals.shape[1:]), fill)
    return out.index_put((idx,), vals)
