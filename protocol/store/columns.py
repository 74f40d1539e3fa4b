"""Columns: how :class:`~protocol.store.LocalStore` holds values, one own buffer per field of each put.

A put of ``n`` keys copies each field once into a :class:`Column` — dense rows ``[n, *shape]``, or ragged rows
(``values [T, *rest]`` cut at ``offsets [n + 1]``) — and each key refers to its row ``(column, i)``. A get joins
the rows it asks for with one slice or one index per column, so neither side does a tensor operation per key.
What comes back follows the same rule as :func:`~protocol.store.batching.assemble_field` (dense when every
row has the same shape, jagged when only dim 0 differs, ``FieldShapeError`` otherwise).

A column's buffer is freed when its last row is cleared or overwritten; :meth:`Column.take` copies the rows
still in use into a smaller buffer, which the store does once half of a column's bytes are no longer used.
"""
from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from protocol.batch.nested import field_parts, is_jagged, jagged_parts, nested_from_lengths
from protocol.checks import only_types
from .batching import assemble_field, batch_fields, own_copy as _own
from .errors import FieldShapeError, preview

__all__ = ["Column", "columns_of_put", "gather_field", "gather_packed", "row_ranges"]


class Column:
    """One field of one put: the store's own buffer and the key of each row (``keys[i]`` owns row ``i``)."""

    __slots__ = ("field", "values", "offsets", "keys", "live", "nbytes", "live_bytes", "unit_bytes", "_array",
                 "_offsets_array")

    def __init__(self, field: str, values: torch.Tensor, offsets: list[int] | None, keys: Sequence[str]):
        self.field = field
        self.values = values  # never written after construction
        self.offsets = offsets  # ragged rows: row i is values[offsets[i]:offsets[i + 1]]; None: row i is values[i]
        self.keys = keys if type(keys) is list else list(keys)
        self.live = len(self.keys)  # rows some key still refers to
        size = values.element_size()
        self.nbytes = values.numel() * size  # bytes of the whole buffer (live rows or not)
        self.live_bytes = self.nbytes  # bytes of the live rows
        self.unit_bytes = math.prod(values.shape[1:]) * size  # a dense row, or one ragged step
        self._array: np.ndarray | None = None
        self._offsets_array: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        """The buffer as a numpy view (same memory): slicing it costs a fraction of slicing the tensor. Dtypes numpy
        lacks (bfloat16, float8) are viewed as the integer of their width; :func:`_to_tensor` views them back."""
        if self._array is None:
            try:
                self._array = self.values.numpy()
            except TypeError:
                self._array = self.values.view(_INT_OF_WIDTH[self.values.element_size()]).numpy()
        return self._array

    @property
    def offsets_array(self) -> np.ndarray:
        """``offsets`` as an int64 array (made once), for reads that take many rows at a time."""
        if self._offsets_array is None:
            self._offsets_array = np.asarray(self.offsets, dtype=np.int64)
        return self._offsets_array

    def row(self, i: int) -> torch.Tensor:
        """Row ``i`` as a view of the buffer (callers copy before handing it out)."""
        if self.offsets is None:
            return self.values[i]
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    def drop(self, rows: Sequence[int]) -> int:
        """Rows ``rows`` (distinct, each dropped once) are no longer referred to: count them out of ``live`` /
        ``live_bytes``; returns their bytes."""
        n = len(rows)
        if self.offsets is None:
            size = n * self.unit_bytes
        elif n == len(self.keys):  # every row at once: the whole buffer
            size = (self.offsets[-1] - self.offsets[0]) * self.unit_bytes
        else:
            off, idx = self.offsets_array, np.asarray(rows, dtype=np.int64)
            size = int((off[idx + 1] - off[idx]).sum()) * self.unit_bytes
        self.live -= n
        self.live_bytes -= size
        return size

    def take(self, rows: Sequence[int]) -> "Column":
        """A new column (own buffer) of ``rows``, in that order."""
        keys = [self.keys[i] for i in rows]
        tokens, starts, lengths = _tokens(self, np.asarray(rows, dtype=np.int64), None)
        values = _to_tensor(_take(tokens, starts, lengths), self.values.dtype)
        return Column(self.field, values, None if self.offsets is None else _offsets(lengths), keys)


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TENSOR = frozenset({torch.Tensor})


def _to_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` on the memory of ``array`` (a new array :meth:`Column.array` slices were joined into)."""
    t = torch.from_numpy(array)
    return t if t.dtype == dtype else t.view(dtype)


def _offsets(lengths: np.ndarray) -> list[int]:
    """Row offsets ``[0, l0, l0 + l1, ...]`` as a Python list (slicing with it needs no conversions)."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out.tolist()


def row_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a loop."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    shift = np.repeat(starts - (ends - lengths), lengths)
    return np.arange(total, dtype=np.int64) + shift


#: what one put of a field gives: its columns (each once) and each key's ``(column, row)``
Rows = tuple[list[Column], list[tuple[Column, int]]]


def _all_rows(col: Column) -> Rows:
    return [col], [(col, i) for i in range(len(col.keys))]


_DTYPE, _IS_CPU, _DEVICE, _NDIM = (operator.attrgetter(a) for a in ("dtype", "is_cpu", "device", "ndim"))
_NUMEL = torch.Tensor.numel


def _list_column(name: str, rows: list[torch.Tensor], keys: list[str]) -> Rows:
    """Rows given one tensor per key: one ragged or dense column when they fit one, else one column per key."""
    if not only_types(rows, _TENSOR):  # a subclass (Parameter) is looked at one by one
        bad = [i for i, r in enumerate(rows) if not isinstance(r, torch.Tensor)]
        if bad:
            raise TypeError(f"field {name!r}: list items must be tensors; positions {preview(bad)} are not "
                            f"(first is {type(rows[bad[0]]).__name__})")
    first = rows[0]
    ndim = first.ndim
    # one dtype, device and ndim, and (ndim > 1) the same trailing dims; checked in that order because reading
    # a shape or a device makes a Python object per row (C-level maps: a put may hold every row of a step)
    uniform = len(set(map(_DTYPE, rows))) == 1 and len(set(map(_NDIM, rows))) == 1 and \
        (all(map(_IS_CPU, rows)) or len(set(map(_DEVICE, rows))) == 1)
    if ndim >= 1 and uniform and (ndim == 1 or len({r.shape[1:] for r in rows}) == 1):
        # a 1-D row's length is its numel, an int: no Size object per row
        lengths = map(_NUMEL, rows) if ndim == 1 else (r.shape[0] for r in rows)
        offsets = [0, *itertools.accumulate(lengths)]
        values = torch.cat(rows, 0).detach()
        return _all_rows(Column(name, values if values.is_cpu else values.to("cpu"), offsets, keys))
    if uniform and len({r.shape for r in rows}) == 1:
        values = torch.stack(rows).detach()
        return _all_rows(Column(name, values if values.is_cpu else values.to("cpu"), None, keys))
    # values that could never be batched together still go in, each in a column of its own
    cols = [Column(name, _own(r).unsqueeze(0), None, [k]) for r, k in zip(rows, keys)]
    return cols, [(c, 0) for c in cols]


def _field_column(name: str, value: Any, keys: list[str]) -> Rows:
    """The columns and the ``(column, row)`` of each key for one batched field (dim 0 = keys), copied once."""
    n = len(keys)
    if isinstance(value, torch.Tensor):
        if is_jagged(value):
            values, offsets = jagged_parts(value)
            offsets = offsets.tolist()
            if len(offsets) - 1 != n:
                raise FieldShapeError(f"field {name!r}: batch dim 0 has {len(offsets) - 1} entries, expected {n} "
                                      f"(one per key)")
            return _all_rows(Column(name, _own(values), offsets, keys))
        if value.is_nested:  # strided layout: components may differ in any dim
            return _field_column(name, list(value.unbind(0)), keys)
        if value.dim() == 0:
            raise FieldShapeError(f"field {name!r}: a batched value needs a batch dim 0 of size {n}, got a 0-d tensor")
        if value.shape[0] != n:
            raise FieldShapeError(f"field {name!r}: batch dim 0 has {value.shape[0]} entries, expected {n} "
                                  f"(one per key)")
        return _all_rows(Column(name, _own(value), None, keys))
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise FieldShapeError(f"field {name!r}: batch dim 0 has {len(value)} entries, expected {n} (one per key)")
        return _list_column(name, list(value), keys) if n else ([], [])
    raise TypeError(f"field {name!r}: expected a tensor (dense or jagged) or a list of tensors, "
                    f"got {type(value).__name__}")


def columns_of_put(fields: Any, keys: Sequence[str]) -> dict[str, Rows]:
    """The ``fields`` of a batch put (TensorDict or mapping, dim 0 = keys) as field -> its columns and each key's
    ``(column, row)``."""
    keys = list(keys)
    return {name: _field_column(name, value, keys) for name, value in batch_fields(fields, len(keys))}


_COLUMN, _ROW = operator.itemgetter(0), operator.itemgetter(1)


def _tokens(col: Column, rows: np.ndarray, trail: torch.Size | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``col`` as a run of tokens (ragged rows: their steps; dense rows: one token each, or ``[len, *trail]``
    tokens each when ``trail`` is given) and, for ``rows``, where each starts in it and how many tokens it has."""
    if col.offsets is not None:
        off = col.offsets_array
        return col.array, off[rows], off[rows + 1] - off[rows]
    if trail is None:
        return col.array, rows, np.ones(rows.size, dtype=np.int64)
    width = col.values.shape[1]
    return col.array.reshape(-1, *trail), rows * width, np.full(rows.size, width, dtype=np.int64)


def _take(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The tokens of rows ``(starts, lengths)`` back to back, as a new array (one slice when they are adjacent)."""
    if starts.size and bool((starts[1:] == starts[:-1] + lengths[:-1]).all()):
        return tokens[int(starts[0]):int(starts[0] + lengths.sum())].copy()  # a slice is a view: copy it
    return tokens[row_ranges(starts, lengths)]


def _rows_of(refs: Sequence[tuple[Column, int]], cols: list[Column], trail: torch.Size | None
             ) -> tuple[torch.Tensor, np.ndarray]:
    """The rows ``refs`` back to back along dim 0 (a new tensor) — dense rows as they are when ``trail`` is None,
    else as ``[len, *trail]`` tokens — and each row's length in tokens. A column's rows are taken with one index
    (or one slice), whatever the order asked: no Python step per row."""
    dtype = cols[0].values.dtype
    rows = np.fromiter(map(_ROW, refs), dtype=np.int64, count=len(refs))
    if len(cols) == 1:
        tokens, starts, lengths = _tokens(cols[0], rows, trail)
        return _to_tensor(_take(tokens, starts, lengths), dtype), lengths
    number = {id(c): j for j, c in enumerate(cols)}
    which = np.fromiter(map(number.__getitem__, map(id, map(_COLUMN, refs))), dtype=np.int64, count=len(refs))
    parts, lengths = [], np.empty(len(refs), dtype=np.int64)
    for j, col in enumerate(cols):
        at = np.flatnonzero(which == j)
        tokens, starts, lengths[at] = _tokens(col, rows[at], trail)
        parts.append((at, _take(tokens, starts, lengths[at])))
    ends = np.cumsum(lengths)
    out = np.empty((int(ends[-1]) if ends.size else 0, *parts[0][1].shape[1:]), dtype=parts[0][1].dtype)
    for at, values in parts:  # each column's tokens to their places in the asked order
        out[row_ranges(ends[at] - lengths[at], lengths[at])] = values
    return _to_tensor(out, dtype), lengths


def gather_field(name: str, refs: Sequence[tuple[Column, int]], jagged: bool = False) -> torch.Tensor:
    """Join the rows ``refs`` (in order) into one batch field, by the rule of ``assemble_field`` (a new tensor)."""
    out = _gather(name, refs, jagged)
    return out if isinstance(out, torch.Tensor) else nested_from_lengths(*out)


def gather_packed(name: str, refs: Sequence[tuple[Column, int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`gather_field`'s field as ``(values, int64 offsets)`` when jagged, ``(tensor, None)`` when dense, without
    building the jagged tensor (what a transfer sends)."""
    out = _gather(name, refs, False)
    if isinstance(out, torch.Tensor):
        return field_parts(out)
    values, lengths = out
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return values, torch.from_numpy(offsets)


def _gather(name: str, refs: Sequence[tuple[Column, int]], jagged: bool) -> torch.Tensor | tuple[torch.Tensor, np.ndarray]:
    """The rows ``refs`` joined: a tensor, or ``(tokens, lengths)`` of rows that come back jagged."""
    def per_key() -> torch.Tensor:  # rows no single join covers: assemble_field decides, or names the problem
        return assemble_field(name, [c.row(i) for c, i in refs], jagged)

    n = len(refs)
    if not n:
        return per_key()
    of = list(map(_COLUMN, refs))  # C-level passes: a read may cover every key of a step
    cols = [of[0]] if of.count(of[0]) == n else list({id(c): c for c in of}.values())
    if len({c.values.dtype for c in cols}) != 1:
        return per_key()
    dense = [c for c in cols if c.offsets is None]
    shape = cols[0].values.shape[1:]
    if len(dense) == len(cols) and all(c.values.shape[1:] == shape for c in cols):  # every row has one shape
        if jagged and len(shape) == 0:
            return per_key()  # 0-d rows cannot be jagged
        values, _ = _rows_of(refs, cols, None)
        if not jagged:
            return values.reshape(n, *shape)
        return values.reshape(-1, *shape[1:]), np.full(n, shape[0], dtype=np.int64)
    # rows of ndim >= 1 that share their trailing dims: join tokens, then decide dense or jagged
    rest = {c.values.shape[1:] if c.offsets is not None else c.values.shape[2:] for c in cols}
    if len(rest) != 1 or any(c.values.dim() < 2 for c in dense):
        return per_key()
    (trail,) = rest
    values, lengths = _rows_of(refs, cols, trail)
    if not jagged and lengths.min() == lengths.max():
        return values.reshape(n, int(lengths[0]), *trail)
    return values, lengths
