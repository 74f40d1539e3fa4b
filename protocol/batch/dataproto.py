"""DataProto: a batch of trajectories as tensors (TensorDict), per-sample Python objects and shared meta info.

``batch`` is a :class:`tensordict.TensorDict` with one batch dimension (dense fields ``[n, ...]`` and jagged
fields ``[n, j, ...]`` side by side, or ``None``); ``non_tensor_batch`` maps names to numpy arrays (normally
``dtype=object``) whose first dimension is ``n``; ``meta_info`` is a dict shared by the whole batch. Lengths are
checked at construction, so a split that does not line up fails where it happens.

Method names and semantics follow the widely used reference ``DataProto``, so code ports with an import change.
Jagged (``torch.nested``, ``layout=torch.jagged``) fields survive every operation: indexing, select, slice, chunk,
split, concat, union, repeat, reorder, pad/unpad, pickling and save/load; strided nested tensors (ragged in more than
one dimension) survive them too, sample by sample. Refusals are ``ValueError``/``KeyError``/``TypeError`` subclasses
that are also ``AssertionError``, because the reference system asserts the same conditions.

Example::

    >>> import numpy as np, torch
    >>> from protocol.batch.nested import to_nested
    >>> data = DataProto.from_dict(
    ...     tensors={"responses": to_nested([torch.tensor([5, 6]), torch.tensor([7])])},
    ...     non_tensors={"uid": ["a", "b"]}, meta_info={"global_steps": 3})
    >>> len(data), data.repeat(2)[1].non_tensor_batch["uid"]
    (2, 'a')
"""
from __future__ import annotations

import contextlib
import copy
import math
import numbers
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

try:  # the function tensordict itself uses to unpickle a consolidated TensorDict
    from tensordict._reductions import _rebuild_tensordict_files_consolidated as _rebuild_consolidated
except ImportError:  # pragma: no cover - depends on the installed tensordict
    _rebuild_consolidated = None

from protocol.batch.nested import (
    is_jagged, is_strided_nested, nested_lengths, nested_values, strided_nested, to_nested,
)
from protocol.batch.serialize import (
    deserialize_single_tensor, deserialize_tensordict, serialize_single_tensor, serialize_tensordict,
)

__all__ = [
    "DataProtoError",
    "DataProtoKeyError",
    "DataProtoTypeError",
    "BatchSizeMismatchError",
    "UnionConflictError",
    "MetaInfoConflictError",
    "DataProtoConfig",
    "auto_padding",
    "DataProto",
    "DataProtoItem",
    "to_object_array",
    "union_tensor_dict",
    "union_numpy_dict",
    "union_meta_info",
    "list_of_dict_to_dict_of_list",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
    "fold_batch_dim",
    "unfold_batch_dim",
    "collate_fn",
    "serialize_single_tensor",
    "deserialize_single_tensor",
    "serialize_tensordict",
    "deserialize_tensordict",
]


class DataProtoError(ValueError, AssertionError):
    """Base class of every refusal raised by :class:`DataProto` (an ``AssertionError`` too, as the reference
    system asserts these conditions, so its ``except AssertionError`` clauses keep working)."""


class DataProtoKeyError(KeyError, AssertionError):
    """A batch, non-tensor or meta_info key that was asked for and is not there (or already taken)."""


class DataProtoTypeError(DataProtoError, TypeError):
    """A value of the wrong type handed to DataProto (where the reference system asserts or raises ValueError)."""


class BatchSizeMismatchError(DataProtoError):
    """Two fields (or two batches) that must have the same number of samples do not."""


class UnionConflictError(DataProtoError):
    """``union`` found one key holding two different values."""


class MetaInfoConflictError(DataProtoError):
    """``concat`` found one meta_info key with different values across parts (other than ``metrics``)."""


# ----------------------------------------------------------------------------------------------- helpers


def to_object_array(values: Any, name: str = "values") -> np.ndarray:
    """A 1-D numpy ``object`` array with one entry per element of ``values`` (lists stay whole, never broadcast).

    Numpy arrays are returned unchanged (any dtype, first dimension = samples).

    >>> to_object_array([[1, 2], [3, 4]]).shape
    (2,)
    """
    if isinstance(values, np.ndarray):
        if values.ndim == 0:
            raise BatchSizeMismatchError(f"{name}: expected an array with one entry per sample, found a 0-d array")
        return values
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise TypeError(f"{name}: expected a sequence with one entry per sample, found {type(values).__name__}")
    items = list(values)
    out = np.empty(len(items), dtype=object)
    for i, v in enumerate(items):
        out[i] = v
    return out


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if is_jagged(a) != is_jagged(b) or a.is_nested != b.is_nested:
        return False
    if is_strided_nested(a):
        ca, cb = a.unbind(), b.unbind()
        return len(ca) == len(cb) and all(_tensors_equal(x, y) for x, y in zip(ca, cb))
    if is_jagged(a):
        if not torch.equal(nested_lengths(a).cpu(), nested_lengths(b).cpu()):
            return False
        a, b = nested_values(a), nested_values(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype.is_floating_point or a.is_complex():
        return bool(torch.equal(torch.isnan(a), torch.isnan(b))) and bool(
            torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)))
    return bool(torch.equal(a, b))


def _is_nan(x: Any) -> bool:
    try:
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isnan(x)
    except (TypeError, ValueError):
        return False


def _values_equal(a: Any, b: Any, _active: set[tuple[int, int]] | None = None) -> bool:
    """Deep equality for tensors, arrays and containers that treats NaN as equal to NaN and stops on cycles.

    A pair of containers met again while it is still being compared (a self-referencing object array, a list that
    holds itself) counts as equal, so comparing two cyclic structures terminates with the structural answer.
    """
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensors_equal(a, b)
    if isinstance(a, (np.ndarray, Mapping, list, tuple)) and isinstance(b, (np.ndarray, Mapping, list, tuple)):
        active = set() if _active is None else _active
        pair = (id(a), id(b))
        if pair in active:
            return True
        active.add(pair)
        try:
            return _containers_equal(a, b, active)
        finally:
            active.discard(pair)
    if _is_nan(a) and _is_nan(b):
        return True
    try:
        result = a == b
        return bool(result)
    except Exception:  # noqa: BLE001 - objects whose == is not a boolean are treated as different
        return False


def _containers_equal(a: Any, b: Any, active: set[tuple[int, int]]) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype.kind in "biufc" and b.dtype.kind in "biufc":
            return bool(np.array_equal(a, b, equal_nan=True))
        return all(_values_equal(x, y, active) for x, y in zip(a.reshape(-1), b.reshape(-1)))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k], active) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_values_equal(x, y, active) for x, y in zip(a, b))
    return False


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add ``tensor_dict2``'s fields to ``tensor_dict1`` (in place, returned); a shared key must hold equal values."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise BatchSizeMismatchError(f"union: batch sizes differ: {tuple(tensor_dict1.batch_size)} vs "
                                     f"{tuple(tensor_dict2.batch_size)}")
    for key in tensor_dict2.keys(include_nested=True, leaves_only=True):
        value = tensor_dict2.get(key)
        if key in tensor_dict1.keys(include_nested=True, leaves_only=True):
            if not _values_equal(tensor_dict1.get(key), value):
                raise UnionConflictError(f"union: batch field {key!r} differs between the two batches; "
                                         f"rename or pop one before union")
        else:
            tensor_dict1.set(key, value)
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add ``tensor_dict2``'s arrays to ``tensor_dict1`` (in place, returned); a shared key must hold equal arrays."""
    for key, value in tensor_dict2.items():
        if key in tensor_dict1:
            if not _values_equal(tensor_dict1[key], value):
                raise UnionConflictError(f"union: non_tensor_batch[{key!r}] differs between the two batches")
        else:
            tensor_dict1[key] = value
    return tensor_dict1


def union_meta_info(meta1: dict[str, Any], meta2: Mapping[str, Any]) -> dict[str, Any]:
    """Add ``meta2``'s entries to ``meta1`` (in place, returned); a shared key must hold equal values."""
    for key, value in meta2.items():
        if key in meta1:
            if not _values_equal(meta1[key], value):
                raise UnionConflictError(f"union: meta_info[{key!r}] differs: {meta1[key]!r} vs {value!r}")
        else:
            meta1[key] = value
    return meta1


def _batch_len(value: torch.Tensor) -> int:
    return int(value.size(0))


def _as_index_array(idxs: Any, n: int) -> np.ndarray:
    """Integer positions (int64 numpy) from a list / numpy / torch index array or boolean mask over ``n`` samples."""
    if isinstance(idxs, torch.Tensor):
        idxs = idxs.detach().cpu().numpy()
    arr = np.asarray(idxs)
    if arr.ndim != 1:
        raise IndexError(f"index: expected a 1-D index array or boolean mask, found shape {arr.shape}")
    if arr.dtype == bool:
        if arr.shape[0] != n:
            raise IndexError(f"index: boolean mask has length {arr.shape[0]} but the batch has {n} samples")
        return np.nonzero(arr)[0].astype(np.int64)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"index: expected integer positions or a boolean mask, found dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = (arr < -n) | (arr >= n)
    if bad.any():
        j = int(np.nonzero(bad)[0][0])
        raise IndexError(f"index: position {int(arr[j])} (entry {j}) is out of range for a batch of {n} samples")
    return np.where(arr < 0, arr + n, arr)


def _check_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, found {type(value).__name__}")
    if int(value) < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, found {int(value)}")
    return int(value)


def list_of_dict_to_dict_of_list(list_of_dict: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """``[{k: v}, ...]`` -> ``{k: [v, ...]}`` in order; keys come in first-seen order and a dict without a key
    adds nothing to it (the reference system refuses keys missing from the first dict; here they are kept).

    >>> list_of_dict_to_dict_of_list([{"loss": 0.5}, {"loss": 0.6, "acc": 1.0}])
    {'loss': [0.5, 0.6], 'acc': [1.0]}
    """
    out: dict[str, list] = {}
    for i, entry in enumerate(list_of_dict):
        if not isinstance(entry, Mapping):
            raise DataProtoTypeError(f"list_of_dict_to_dict_of_list: entry {i} is {type(entry).__name__}; "
                                     f"expected a dict")
        for key, value in entry.items():
            out.setdefault(key, []).append(value)
    return out


def _strided_keys(batch: TensorDict) -> list[Any]:
    return [k for k in batch.keys(include_nested=True, leaves_only=True) if is_strided_nested(batch.get(k))]


def _index_batch(batch: TensorDict, idx: np.ndarray) -> TensorDict:
    """``batch[idx]``; strided nested fields (which torch cannot index by tensor) are gathered sample by sample."""
    strided = _strided_keys(batch)
    if not strided:
        return batch[torch.from_numpy(idx)]
    out = batch.exclude(*strided)[torch.from_numpy(idx)]
    for key in strided:
        value = batch.get(key)
        components = value.unbind()
        out.set(key, strided_nested([components[i] for i in idx.tolist()], dtype=value.dtype, device=value.device))
    return out


def _keys_list(keys: str | Iterable[str] | None) -> list[str] | None:
    if keys is None:
        return None
    return [keys] if isinstance(keys, str) else list(keys)


# ------------------------------------------------------------------------------------------- auto-padding

_AUTO_PADDING_ENV = "VERL_AUTO_PADDING"


class _DataProtoConfigMeta(type):
    """Class-level properties for :class:`DataProtoConfig` (``DataProtoConfig.auto_padding = True`` validates)."""

    @property
    def auto_padding(cls) -> bool:
        enabled_by_env = os.environ.get(_AUTO_PADDING_ENV, "FALSE").strip().upper() in ("TRUE", "1")
        return enabled_by_env or cls._auto_padding

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise DataProtoTypeError(f"DataProtoConfig.auto_padding: expected a bool, found {enabled!r} "
                                     f"({type(enabled).__name__})")
        cls._auto_padding = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Process-wide DataProto switches, named as in the reference system.

    ``DataProtoConfig.auto_padding`` (or the environment variable ``VERL_AUTO_PADDING=1``/``TRUE``) lets
    :meth:`DataProto.chunk` split a batch whose length the chunk count does not divide, for callers that pad with
    :meth:`DataProto.padding` first; one batch opts in alone with ``from_dict(..., auto_padding=True)``, which
    sets ``meta_info[DataProtoConfig.auto_padding_key]``.
    """

    auto_padding_key = "_verl_auto_padding"
    _auto_padding = False


@contextlib.contextmanager
def auto_padding(enabled: bool = True) -> Iterator[None]:
    """Set ``DataProtoConfig.auto_padding`` for a ``with`` block and restore the previous value afterwards.

    The environment variable still wins: with ``VERL_AUTO_PADDING=1`` padding stays enabled inside
    ``auto_padding(False)``.

    >>> with auto_padding():
    ...     DataProtoConfig.auto_padding
    True
    """
    previous = DataProtoConfig._auto_padding
    DataProtoConfig.auto_padding = enabled
    try:
        yield
    finally:
        DataProtoConfig._auto_padding = previous


# --------------------------------------------------------------------------------------------- the classes


@dataclass
class DataProtoItem:
    """One sample of a :class:`DataProto`: a 0-batch-dim TensorDict, its per-sample objects and the shared meta."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class DataProto:
    """A batch of trajectories: ``batch`` (TensorDict, dim 0 = samples), ``non_tensor_batch``, ``meta_info``."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
        if self.meta_info is None:
            self.meta_info = {}
        if not isinstance(self.non_tensor_batch, dict):
            raise DataProtoTypeError(f"non_tensor_batch: expected a dict, found {type(self.non_tensor_batch).__name__}")
        if not isinstance(self.meta_info, dict):
            raise DataProtoTypeError(f"meta_info: expected a dict, found {type(self.meta_info).__name__}")
        self.non_tensor_batch = {k: to_object_array(v, f"non_tensor_batch[{k!r}]")
                                 for k, v in self.non_tensor_batch.items()}
        self.check_consistency()

    # ------------------------------------------------------------------------------------------ construction

    def check_consistency(self) -> None:
        """Refuse a batch whose TensorDict is not 1-D or whose non-tensor arrays have another length."""
        if self.batch is not None:
            if not isinstance(self.batch, TensorDict):
                raise DataProtoTypeError(f"batch: expected a tensordict.TensorDict or None, found "
                                         f"{type(self.batch).__name__}")
            if self.batch.batch_dims != 1:
                raise BatchSizeMismatchError(f"batch: expected exactly one batch dimension, found batch_size "
                                             f"{tuple(self.batch.batch_size)}")
        n = len(self.batch) if self.batch is not None else None
        ref = "batch"
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise DataProtoTypeError(f"non_tensor_batch[{key!r}]: expected a numpy array, found "
                                         f"{type(value).__name__}")
            if n is None:
                n, ref = value.shape[0], f"non_tensor_batch[{next(iter(self.non_tensor_batch))!r}]"
            elif value.shape[0] != n:
                raise BatchSizeMismatchError(f"non_tensor_batch[{key!r}] has length {value.shape[0]} but {ref} "
                                             f"has {n} samples")

    @classmethod
    def from_single_dict(cls, data: Mapping[str, Any], meta_info: dict | None = None,
                         auto_padding: bool = False) -> DataProto:
        """Split one dict into tensors (torch) and per-sample objects (numpy arrays, lists)."""
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, (np.ndarray, list, tuple)):
                non_tensors[key] = value
            else:
                raise DataProtoTypeError(f"from_single_dict: {key!r} holds {type(value).__name__}; expected a "
                                         f"torch.Tensor (batch field) or a numpy array / list (per-sample objects); "
                                         f"put shared values in meta_info")
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info, auto_padding=auto_padding)

    @classmethod
    def from_dict(cls, tensors: Mapping[str, torch.Tensor] | None = None,
                  non_tensors: Mapping[str, Any] | None = None, meta_info: dict | None = None,
                  num_batch_dims: int = 1, auto_padding: bool = False) -> DataProto:
        """Build from tensors (dense ``[n, ...]``, jagged ``[n, j, ...]`` or strided nested), per-sample objects
        and meta info; ``auto_padding=True`` opts this batch in to :attr:`DataProtoConfig.auto_padding`."""
        if num_batch_dims != 1:
            raise BatchSizeMismatchError(f"num_batch_dims: only 1 is supported (dim 0 = samples), found "
                                         f"{num_batch_dims}")
        if not isinstance(auto_padding, bool):
            raise DataProtoTypeError(f"from_dict: auto_padding must be a bool, found {type(auto_padding).__name__}")
        tensors = dict(tensors or {})
        non_tensors = dict(non_tensors or {})
        batch = None
        if tensors:
            first_key, n = None, None
            for key, value in tensors.items():
                if not isinstance(value, torch.Tensor):
                    raise DataProtoTypeError(f"tensors[{key!r}]: expected a torch.Tensor, found {type(value).__name__}")
                if value.dim() < 1:
                    raise BatchSizeMismatchError(f"tensors[{key!r}]: expected a batch dimension, found a scalar; "
                                                 f"put shared scalars in meta_info")
                if n is None:
                    first_key, n = key, _batch_len(value)
                elif _batch_len(value) != n:
                    raise BatchSizeMismatchError(f"tensors[{key!r}] has {_batch_len(value)} samples but "
                                                 f"tensors[{first_key!r}] has {n}")
            batch = TensorDict(tensors, batch_size=[n])
        meta = dict(meta_info or {})
        if auto_padding:
            meta[DataProtoConfig.auto_padding_key] = True
        return cls(batch=batch, non_tensor_batch={k: to_object_array(v, f"non_tensors[{k!r}]")
                                                  for k, v in non_tensors.items()},
                   meta_info=meta)

    @classmethod
    def from_tensordict(cls, tensor_dict: TensorDict | None = None, meta_info: dict | None = None,
                        num_batch_dims: int = 1) -> DataProto:
        """Build from a TensorDict: tensors stay in ``batch``, ``NonTensorStack`` fields become per-sample arrays,
        ``NonTensorData`` (one value for the batch) goes to ``meta_info``."""
        if not isinstance(tensor_dict, TensorDict):
            raise TypeError(f"from_tensordict: expected a TensorDict, found {type(tensor_dict).__name__}")
        if num_batch_dims != 1 or tensor_dict.batch_dims != 1:
            raise BatchSizeMismatchError(f"from_tensordict: expected one batch dimension, found batch_size "
                                         f"{tuple(tensor_dict.batch_size)} (num_batch_dims={num_batch_dims})")
        meta = dict(meta_info or {})
        non_tensors: dict[str, np.ndarray] = {}
        tensor_keys = []
        for key in tensor_dict.keys():
            value = tensor_dict.get(key)
            if isinstance(value, NonTensorStack):
                non_tensors[key] = to_object_array(value.tolist(), f"tensor_dict[{key!r}]")
            elif isinstance(value, NonTensorData):
                if key in meta and not _values_equal(meta[key], value.data):
                    raise UnionConflictError(f"from_tensordict: {key!r} is both in meta_info and a NonTensorData "
                                             f"field with a different value")
                meta[key] = value.data
            else:
                tensor_keys.append(key)
        batch = tensor_dict.select(*tensor_keys) if tensor_keys else None
        if batch is None and not non_tensors and tensor_dict.batch_size[0] != 0:
            batch = TensorDict({}, batch_size=tensor_dict.batch_size)
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict: tensors, per-sample objects as ``NonTensorStack``, meta_info entries as ``NonTensorData``."""
        n = len(self)
        out = self.batch.copy() if self.batch is not None else TensorDict({}, batch_size=[n])
        for key, value in self.non_tensor_batch.items():
            if key in out.keys():
                raise UnionConflictError(f"to_tensordict: {key!r} is both a batch field and a non-tensor field")
            out.set(key, NonTensorStack(*[value[i] for i in range(n)], batch_size=[n]) if n else
                    NonTensorStack(batch_size=[0]))
        for key, value in self.meta_info.items():
            if key in out.keys():
                raise UnionConflictError(f"to_tensordict: meta_info key {key!r} collides with a batch field")
            out.set_non_tensor(key, value)
        return out

    # --------------------------------------------------------------------------------------------- access

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for value in self.non_tensor_batch.values():
            return int(value.shape[0])
        return 0

    def __getitem__(self, item: Any) -> DataProto | DataProtoItem:
        """int -> :class:`DataProtoItem`; slice, index array, list or boolean mask -> :class:`DataProto`."""
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (numbers.Integral, np.integer)) and not isinstance(item, bool) or (
                isinstance(item, torch.Tensor) and item.dim() == 0 and not item.dtype.is_floating_point
                and item.dtype != torch.bool):
            i = int(item)
            n = len(self)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of range for a batch of {n} samples")
            i = i + n if i < 0 else i
            return DataProtoItem(batch=self.batch[i] if self.batch is not None else None,
                                 non_tensor_batch={k: v[i] for k, v in self.non_tensor_batch.items()},
                                 meta_info=self.meta_info)
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(f"DataProto index: expected int, slice, list, numpy/torch index array or boolean mask, "
                        f"found {type(item).__name__}")

    def __iter__(self) -> Iterator[DataProtoItem]:
        for i in range(len(self)):
            yield self[i]

    def _take(self, idx: np.ndarray, meta_info: dict | None = None) -> DataProto:
        idx = np.array(idx, dtype=np.int64)  # a copy: a reversed slice can leave a negative stride behind
        batch = _index_batch(self.batch, idx) if self.batch is not None else None
        return type(self)(batch=batch, non_tensor_batch={k: v[idx] for k, v in self.non_tensor_batch.items()},
                          meta_info=dict(self.meta_info) if meta_info is None else meta_info)

    def select_idxs(self, idxs: Any) -> DataProto:
        """New DataProto of the samples at integer positions ``idxs`` (list, numpy, torch) or where a mask is True."""
        return self._take(_as_index_array(idxs, len(self)))

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """New DataProto of samples ``start:end:step`` (Python slice semantics)."""
        sl = slice(start, end, step)
        if step is not None and step <= 0 or (self.batch is not None and _strided_keys(self.batch)):
            return self._take(np.arange(len(self))[sl])
        batch = self.batch[sl] if self.batch is not None else None
        return type(self)(batch=batch, non_tensor_batch={k: v[sl] for k, v in self.non_tensor_batch.items()},
                          meta_info=dict(self.meta_info))

    def select(self, batch_keys: Sequence[str] | None = None, non_tensor_batch_keys: Sequence[str] | None = None,
               meta_info_keys: Sequence[str] | None = None, deepcopy: bool = False) -> DataProto:
        """New DataProto with only the given keys (``None`` keeps all of that kind); ``deepcopy`` copies the data."""
        batch_keys = _keys_list(batch_keys)
        non_tensor_batch_keys = _keys_list(non_tensor_batch_keys)
        meta_info_keys = _keys_list(meta_info_keys)
        if batch_keys is not None:
            if self.batch is None:
                if batch_keys:
                    raise DataProtoKeyError(f"select: batch keys {batch_keys} requested but this DataProto has "
                                            f"no batch")
                batch = None
            else:
                missing = [k for k in batch_keys if k not in self.batch.keys()]
                if missing:
                    raise DataProtoKeyError(f"select: batch keys {missing} not found; available: "
                                            f"{sorted(self.batch.keys())}")
                batch = self.batch.select(*batch_keys)
        else:
            batch = self.batch
        non_tensor = _pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch")
        meta = _pick(self.meta_info, meta_info_keys, "meta_info")
        if deepcopy:
            batch = copy.deepcopy(batch)
            non_tensor = copy.deepcopy(non_tensor)
            meta = copy.deepcopy(meta)
        elif batch is self.batch and batch is not None:
            batch = batch.copy()  # a new container sharing the tensors, so key edits do not leak back
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def pop(self, batch_keys: Sequence[str] | None = None, non_tensor_batch_keys: Sequence[str] | None = None,
            meta_info_keys: Sequence[str] | None = None) -> DataProto:
        """Remove the given keys from this DataProto and return them as a new one."""
        batch_keys = _keys_list(batch_keys) or []
        non_tensor_batch_keys = _keys_list(non_tensor_batch_keys) or []
        meta_info_keys = _keys_list(meta_info_keys) or []
        available = list(self.batch.keys()) if self.batch is not None else []
        for kind, keys, pool in (("batch", batch_keys, available),
                                 ("non_tensor_batch", non_tensor_batch_keys, self.non_tensor_batch),
                                 ("meta_info", meta_info_keys, self.meta_info)):
            missing = [k for k in keys if k not in pool]
            if missing:
                raise DataProtoKeyError(f"pop: {kind} keys {missing} not found; available: {sorted(pool)}")
        tensors = {k: self.batch.pop(k) for k in batch_keys}
        batch = TensorDict(tensors, batch_size=[len(self)]) if batch_keys else None
        non_tensor = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def rename(self, old_keys: str | Sequence[str] | None = None,
               new_keys: str | Sequence[str] | None = None) -> DataProto:
        """Rename batch fields in place (returns self); the new names must be free."""
        old_keys, new_keys = _keys_list(old_keys) or [], _keys_list(new_keys) or []
        if len(old_keys) != len(new_keys):
            raise ValueError(f"rename: {len(old_keys)} old keys but {len(new_keys)} new keys; they pair up one to one")
        if len(set(new_keys)) != len(new_keys):
            raise ValueError(f"rename: new keys {new_keys} contain duplicates")
        if old_keys and self.batch is None:
            raise DataProtoKeyError(f"rename: keys {old_keys} requested but this DataProto has no batch")
        for old, new in zip(old_keys, new_keys):
            if old not in self.batch.keys():
                raise DataProtoKeyError(f"rename: batch key {old!r} not found; available: {sorted(self.batch.keys())}")
            if new in self.batch.keys() and new not in old_keys:
                raise DataProtoKeyError(f"rename: new key {new!r} already exists in batch")
        tensors = {old: self.batch.pop(old) for old in old_keys}
        for old, new in zip(old_keys, new_keys):
            self.batch.set(new, tensors[old])
        return self

    def union(self, other: DataProto) -> DataProto:
        """Add ``other``'s fields to this DataProto in place (returns self); a shared key must hold equal values."""
        if not isinstance(other, DataProto):
            raise DataProtoTypeError(f"union: expected a DataProto, found {type(other).__name__}")
        if len(self) != len(other) and (self.batch is not None or self.non_tensor_batch) and (
                other.batch is not None or other.non_tensor_batch):
            raise BatchSizeMismatchError(f"union: this batch has {len(self)} samples, the other {len(other)}")
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch.copy()
            else:
                union_tensor_dict(self.batch, other.batch)
        union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        union_meta_info(self.meta_info, other.meta_info)
        self.check_consistency()
        return self

    # ------------------------------------------------------------------------------------- split / merge

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` equal parts; ``len(self)`` must be divisible by ``chunks``.

        With auto-padding enabled (:meth:`is_padding_enabled`) an indivisible batch is split into exactly ``chunks``
        consecutive parts whose sizes differ by at most one, the longer ones first.
        """
        chunks = _check_int(chunks, "chunk: chunks", 1)
        n = len(self)
        if n % chunks and not self.is_padding_enabled():
            raise BatchSizeMismatchError(f"chunk: {n} samples cannot be split into {chunks} equal chunks; pad with "
                                         f"pad_dataproto_to_divisor(data, {chunks}) or data.padding(...) first, or "
                                         f"enable DataProtoConfig.auto_padding")
        bounds = np.cumsum([0] + [n // chunks + (1 if i < n % chunks else 0) for i in range(chunks)])
        return [self.slice(int(bounds[i]), int(bounds[i + 1])) for i in range(chunks)]

    def is_padding_enabled(self) -> bool:
        """True when this batch opted in (``from_dict(auto_padding=True)``) or :class:`DataProtoConfig` enables it."""
        return bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False)) or DataProtoConfig.auto_padding

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the first (``"first"``) or last (``"last"``, the default ``""``) sample,
        in place; used before :meth:`chunk` so that every part has the same length."""
        padding_size = _check_int(padding_size, "padding: padding_size", 0)
        if padding_candidate not in ("", "first", "last"):
            raise ValueError(f"padding: padding_candidate must be 'first' or 'last' (or '' for last), found "
                             f"{padding_candidate!r}")
        if padding_size == 0:
            return
        if len(self) == 0:
            raise BatchSizeMismatchError("padding: the batch is empty, so there is no sample to copy")
        source = 0 if padding_candidate == "first" else len(self) - 1
        padded = DataProto.concat([self, self._take(np.full(padding_size, source, dtype=np.int64))])
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> DataProto:
        """Cut each sample of the ``split_keys`` fields into ``n_split`` equal pieces along dim 1, each piece a
        sample of its own (sample ``i`` becomes ``i * n_split .. i * n_split + n_split - 1``); every other field is
        repeated ``n_split`` times, copies adjacent.

        A 1-D object array in ``split_keys`` holds one sequence per sample; each sequence is cut the same way.
        """
        n_split = _check_int(n_split, "unfold_column_chunks: n_split", 1)
        split = set(_keys_list(split_keys) or [])
        batch_keys = set(self.batch.keys()) if self.batch is not None else set()
        unknown = sorted(split - batch_keys - set(self.non_tensor_batch))
        if unknown:
            raise DataProtoKeyError(f"unfold_column_chunks: split_keys {unknown} are neither batch nor "
                                    f"non_tensor_batch keys")
        n = len(self)
        out = self._take(np.repeat(np.arange(n), n_split).astype(np.int64))
        for key in sorted(split & batch_keys):
            value = self.batch.get(key)
            if value.is_nested or value.dim() < 2 or value.shape[1] % n_split:
                raise BatchSizeMismatchError(f"unfold_column_chunks: batch field {key!r} is {_describe(value)}; "
                                             f"expected a dense [n, L, ...] field with L divisible by {n_split}")
            out.batch.set(key, value.reshape(n * n_split, value.shape[1] // n_split, *value.shape[2:]))
        for key in sorted(split & set(self.non_tensor_batch)):
            out.non_tensor_batch[key] = _split_columns(self.non_tensor_batch[key], n_split, key)
        return out

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of ``split_size`` samples (the last may be shorter)."""
        split_size = _check_int(split_size, "split: split_size", 1)
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Join batches along dim 0; ``meta_info['metrics']`` dicts merge into lists, other meta keys must agree."""
        data = list(data)
        if not data:
            raise ValueError("concat: expected at least one DataProto, found an empty list")
        for i, d in enumerate(data):
            if not isinstance(d, DataProto):
                raise DataProtoTypeError(f"concat: data[{i}] is {type(d).__name__}, expected DataProto")
        has_batch = [d.batch is not None for d in data]
        if any(has_batch) and not all(has_batch):
            raise DataProtoError(f"concat: data[{has_batch.index(False)}] has no batch while data[0] "
                                 f"{'has' if has_batch[0] else 'has not'} one; all parts must agree")
        batch = None
        if all(has_batch):
            ref_keys = set(data[0].batch.keys(include_nested=True, leaves_only=True))
            for i, d in enumerate(data[1:], start=1):
                keys = set(d.batch.keys(include_nested=True, leaves_only=True))
                if keys != ref_keys:
                    raise DataProtoKeyError(f"concat: data[{i}] batch keys differ from data[0]: missing "
                                   f"{sorted(map(str, ref_keys - keys))}, extra {sorted(map(str, keys - ref_keys))}")
            for key in data[0].batch.keys(include_nested=True, leaves_only=True):
                first = data[0].batch.get(key)
                for i, d in enumerate(data[1:], start=1):
                    other = d.batch.get(key)
                    if _signature(first) != _signature(other):
                        raise BatchSizeMismatchError(
                            f"concat: batch field {key!r} is {_describe(other)} in data[{i}] but {_describe(first)} "
                            f"in data[0]; parts must agree on layout, dtype and per-sample shape")
            batch = torch.cat([d.batch for d in data], dim=0)
        ref_nt = set(data[0].non_tensor_batch)
        for i, d in enumerate(data[1:], start=1):
            if set(d.non_tensor_batch) != ref_nt:
                raise DataProtoKeyError(f"concat: data[{i}] non_tensor_batch keys differ from data[0]: missing "
                               f"{sorted(ref_nt - set(d.non_tensor_batch))}, extra "
                               f"{sorted(set(d.non_tensor_batch) - ref_nt)}")
        non_tensor = {k: np.concatenate([d.non_tensor_batch[k] for d in data], axis=0) for k in data[0].non_tensor_batch}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=_merge_meta([d.meta_info for d in data]))

    def reorder(self, indices: Any) -> None:
        """Permute samples in place so that new sample ``i`` is old sample ``indices[i]`` (as the reference does)."""
        idx = _as_index_array(indices, len(self))
        if idx.shape[0] != len(self):
            raise BatchSizeMismatchError(f"reorder: {idx.shape[0]} indices for a batch of {len(self)} samples; "
                                         f"use select_idxs to take a subset")
        taken = self._take(idx, meta_info=self.meta_info)
        self.batch, self.non_tensor_batch = taken.batch, taken.non_tensor_batch

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each sample ``repeat_times`` times: interleaved ``[a, a, b, b]`` (a group's copies adjacent) or tiled
        ``[a, b, a, b]``."""
        k = _check_int(repeat_times, "repeat: repeat_times", 1)
        n = len(self)
        idx = np.repeat(np.arange(n), k) if interleave else np.tile(np.arange(n), k)
        return self._take(idx.astype(np.int64))

    def sample_level_repeat(self, repeat_times: Any) -> DataProto:
        """Sample ``i`` repeated ``repeat_times[i]`` times (>= 0), copies adjacent, order kept."""
        if isinstance(repeat_times, torch.Tensor):
            repeat_times = repeat_times.detach().cpu().numpy()
        times = np.asarray(repeat_times)
        if times.ndim != 1 or times.shape[0] != len(self):
            raise BatchSizeMismatchError(f"sample_level_repeat: expected {len(self)} repeat counts (one per sample), "
                                         f"found shape {times.shape}")
        if times.size and not np.issubdtype(times.dtype, np.integer):
            raise TypeError(f"sample_level_repeat: expected integer repeat counts, found dtype {times.dtype}")
        if times.size and times.min() < 0:
            i = int(np.argmin(times))
            raise ValueError(f"sample_level_repeat: repeat_times[{i}] = {int(times[i])} is negative")
        return self._take(np.repeat(np.arange(len(self)), times.astype(np.int64)).astype(np.int64))

    # ------------------------------------------------------------------------------------- device / disk

    def to(self, device: torch.device | str) -> DataProto:
        """Move the tensors to ``device`` (in place, returns self)."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def __getstate__(self) -> dict[str, Any]:
        """Pickle state with the TensorDict consolidated into one contiguous buffer (one copy, jagged included).

        The buffer travels as one numpy ``uint8`` array (pickled at memcpy speed) next to tensordict's
        consolidation metadata; see :func:`_batch_state`.
        """
        return {"batch": _batch_state(self.batch), "non_tensor_batch": self.non_tensor_batch,
                "meta_info": self.meta_info}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.batch = _batch_from_state(state["batch"])
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]
        self.check_consistency()

    def save_to_disk(self, filepath: str | Path) -> None:
        """Pickle this DataProto (consolidated) to ``filepath``."""
        with open(filepath, "wb") as f:
            pickle.dump(self, f)

    @staticmethod
    def load_from_disk(filepath: str | Path) -> DataProto:
        """Load a DataProto written by :meth:`save_to_disk`."""
        with open(filepath, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise TypeError(f"load_from_disk: {filepath} holds a {type(data).__name__}, not a DataProto")
        return data

    # -------------------------------------------------------------------------------------------- iterate

    def make_iterator(self, mini_batch_size: int, epochs: int, seed: int | None = None,
                      dataloader_kwargs: dict | None = None) -> Iterator[DataProto]:
        """Mini-batches of ``mini_batch_size`` samples for ``epochs`` passes.

        ``dataloader_kwargs`` may hold ``shuffle`` (default False); shuffles draw from one generator seeded with
        ``seed``, so the same seed gives the same sequence of mini-batches. ``mini_batch_size`` must divide
        ``len(self)`` (nothing is dropped).
        """
        mini_batch_size = _check_int(mini_batch_size, "make_iterator: mini_batch_size", 1)
        epochs = _check_int(epochs, "make_iterator: epochs", 1)
        kwargs = dict(dataloader_kwargs or {})
        shuffle = kwargs.pop("shuffle", False)
        if kwargs:
            raise ValueError(f"make_iterator: unsupported dataloader_kwargs {sorted(kwargs)}; only 'shuffle' is "
                             f"supported (mini-batches are taken by index, no worker processes)")
        n = len(self)
        if n % mini_batch_size:
            raise BatchSizeMismatchError(f"make_iterator: {n} samples are not divisible by mini_batch_size "
                                         f"{mini_batch_size}")
        generator = torch.Generator()
        if seed is not None:
            generator.manual_seed(int(seed))
        else:
            generator.seed()

        def _iterate() -> Iterator[DataProto]:
            for _ in range(epochs):
                order = torch.randperm(n, generator=generator).numpy() if shuffle else np.arange(n)
                for start in range(0, n, mini_batch_size):
                    yield self._take(order[start:start + mini_batch_size].astype(np.int64))

        return _iterate()


_STATE_BUFFER = "consolidated-buffer"
_STATE_TD = "consolidated-tensordict"


def _batch_state(batch: TensorDict | None, fast: bool = True) -> Any:
    """Picklable form of a batch: consolidated, then (``fast``) its single buffer as a numpy array + metadata.

    The fast form uses tensordict's consolidation metadata and rebuild function; for a batch on an accelerator, or
    where those are not available (another tensordict version), the consolidated TensorDict itself is pickled: the
    same single buffer through torch's slower storage pickling, which also restores the device.
    """
    if batch is None:
        return None
    if not list(batch.keys()):
        return (_STATE_TD, batch)
    if _strided_keys(batch):  # tensordict cannot consolidate strided nested tensors; torch pickles them as they are
        return (_STATE_TD, batch)
    consolidated = batch.consolidate()
    info = getattr(consolidated, "_consolidated", None)
    if fast and _rebuild_consolidated is not None and isinstance(info, dict) and info.get("metadata") is not None \
            and isinstance(info.get("storage"), torch.Tensor) and info["storage"].dtype == torch.uint8 \
            and info["storage"].device.type == "cpu":
        return (_STATE_BUFFER, info["metadata"], info["storage"].numpy())
    return (_STATE_TD, consolidated)


def _batch_from_state(state: Any) -> TensorDict | None:
    if state is None or isinstance(state, TensorDict):
        return state
    if state[0] == _STATE_BUFFER:
        if _rebuild_consolidated is None:
            raise DataProtoError("this pickle holds a consolidated buffer but the installed tensordict cannot "
                                 "rebuild it; load it with the tensordict version that wrote it")
        return _rebuild_consolidated(state[1], torch.from_numpy(state[2]))
    if state[0] == _STATE_TD:
        return state[1]
    raise DataProtoError(f"unknown pickled batch format {state[0]!r}")


def _signature(t: torch.Tensor) -> tuple[str, torch.dtype, tuple]:
    """Layout, dtype and per-sample shape (``j`` = ragged dim, ``*`` = a strided nested tensor's free dims)."""
    if is_jagged(t):
        return "jagged", t.dtype, ("j", *(int(t.shape[d]) for d in range(2, t.dim())))
    if t.is_nested:
        return "strided-nested", t.dtype, ("*",) * (t.dim() - 1)
    return "dense", t.dtype, tuple(int(d) for d in t.shape[1:])


def _describe(t: torch.Tensor) -> str:
    layout, dtype, shape = _signature(t)
    return f"{layout} {str(dtype).removeprefix('torch.')} [n, {', '.join(map(str, shape))}]".replace(", ]", "]")


def _pick(source: dict[str, Any], keys: list[str] | None, kind: str) -> dict[str, Any]:
    if keys is None:
        return dict(source)
    missing = [k for k in keys if k not in source]
    if missing:
        raise DataProtoKeyError(f"select: {kind} keys {missing} not found; available: {sorted(source)}")
    return {k: source[k] for k in keys}


def _merge_meta(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Meta info of concatenated parts: equal keys once, ``metrics`` of every part merged into a dict of lists.

    A part's ``metrics`` may be a dict or a list of dicts (one per worker) or ``None`` (skipped); each dict adds its
    value to the list of each of its names (a list value is appended element by element, so dicts of lists from
    several parts join into one flat list per name).
    """
    merged: dict[str, Any] = {}
    metrics: dict[str, list] = {}
    any_metrics = False
    for i, meta in enumerate(metas):
        for key, value in meta.items():
            if key == "metrics":
                if value is None:
                    continue
                entries = list(value) if isinstance(value, (list, tuple)) else [value]
                for j, entry in enumerate(entries):
                    if not isinstance(entry, Mapping):
                        where = f"[{j}]" if isinstance(value, (list, tuple)) else ""
                        raise DataProtoTypeError(
                            f"concat: data[{i}].meta_info['metrics']{where} is {type(entry).__name__}; expected a "
                            f"dict of metric name -> value (or list of values), or a list of such dicts")
                    any_metrics = True
                    for name, v in entry.items():
                        metrics.setdefault(name, []).extend(v if isinstance(v, list) else [v])
            elif key in merged:
                if not _values_equal(merged[key], value):
                    raise MetaInfoConflictError(
                        f"Conflicting values for meta_info key {key!r} in concat: meta_info[{key!r}] differs between "
                        f"parts: {merged[key]!r} vs {value!r} (data[{i}]); make the parts agree or pop the key first")
            else:
                merged[key] = value
    if any_metrics:
        merged["metrics"] = metrics
    return merged


# ------------------------------------------------------------------------------------------ pad / unpad


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Append copies of the first samples (cycling) until ``len`` divides ``size_divisor``; returns (data, pad_size).

    The copies are exact duplicates, to be removed with :func:`unpad_dataproto` after a split computation; dispatch
    padding for training (samples tagged ``is_padding`` with a zero mask) is a different mechanism.
    """
    if not isinstance(data, DataProto):
        raise DataProtoTypeError(f"pad_dataproto_to_divisor: expected a DataProto, found {type(data).__name__}")
    size_divisor = _check_int(size_divisor, "pad_dataproto_to_divisor: size_divisor", 1)
    n = len(data)
    pad_size = (-n) % size_divisor
    if pad_size == 0:
        return data, 0
    padding = data._take((np.arange(pad_size) % n).astype(np.int64))
    return DataProto.concat([data, padding]), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` samples added by :func:`pad_dataproto_to_divisor`."""
    pad_size = _check_int(pad_size, "unpad_dataproto: pad_size", 0)
    if pad_size > len(data):
        raise BatchSizeMismatchError(f"unpad_dataproto: pad_size {pad_size} exceeds the batch's {len(data)} samples")
    return data if pad_size == 0 else data.slice(0, len(data) - pad_size)


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """``[n, ...]`` -> ``[new_batch_size, n // new_batch_size, ...]`` for every field: consecutive samples become
    one group (dense tensors and numpy arrays only; ``new_batch_size`` must divide ``n``)."""
    new_batch_size = _check_int(new_batch_size, "fold_batch_dim: new_batch_size", 1)
    n = len(data)
    if n % new_batch_size:
        raise BatchSizeMismatchError(f"fold_batch_dim: {n} samples cannot fold into {new_batch_size} equal groups")
    group = n // new_batch_size
    batch = None
    if data.batch is not None:
        tensors = {}
        for key in data.batch.keys():
            value = data.batch.get(key)
            if not isinstance(value, torch.Tensor) or value.is_nested:
                raise DataProtoTypeError(f"fold_batch_dim: batch field {key!r} is not a dense tensor; only dense "
                                         f"fields can be folded")
            tensors[key] = value.reshape(new_batch_size, group, *value.shape[1:])
        batch = TensorDict(tensors, batch_size=[new_batch_size], device=data.batch.device)
    non_tensor = {k: v.reshape(new_batch_size, group, *v.shape[1:]) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(data.meta_info))


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Inverse of :func:`fold_batch_dim`: the first ``batch_dims`` dims of every field become one batch dim."""
    batch_dims = _check_int(batch_dims, "unfold_batch_dim: batch_dims", 1)
    lead: tuple[int, ...] | None = None
    ref = ""
    fields: list[tuple[str, Any]] = []
    if data.batch is not None:
        fields += [(f"batch field {k!r}", data.batch.get(k)) for k in data.batch.keys()]
    fields += [(f"non_tensor_batch[{k!r}]", v) for k, v in data.non_tensor_batch.items()]
    for name, value in fields:
        if isinstance(value, torch.Tensor) and value.is_nested:
            raise DataProtoTypeError(f"unfold_batch_dim: {name} is a nested tensor; only dense fields unfold")
        shape = tuple(int(d) for d in value.shape[:batch_dims])
        if len(shape) < batch_dims:
            raise BatchSizeMismatchError(f"unfold_batch_dim: {name} has {len(shape)} dims, fewer than "
                                         f"batch_dims={batch_dims}")
        if lead is None:
            lead, ref = shape, name
        elif shape != lead:
            raise BatchSizeMismatchError(f"unfold_batch_dim: {name} starts with {shape} but {ref} with {lead}")
    total = int(np.prod(lead)) if lead is not None else 0
    batch = None
    if data.batch is not None:
        batch = TensorDict({k: data.batch.get(k).reshape(total, *data.batch.get(k).shape[batch_dims:])
                            for k in data.batch.keys()}, batch_size=[total], device=data.batch.device)
    non_tensor = {k: v.reshape(total, *v.shape[batch_dims:]) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(data.meta_info))


def _split_columns(values: np.ndarray, n_split: int, key: str) -> np.ndarray:
    """Each sample's entries along dim 1 (or its sequence, for a 1-D object array) cut into ``n_split`` samples."""
    n = values.shape[0]
    if values.ndim >= 2:
        if values.shape[1] % n_split:
            raise BatchSizeMismatchError(f"unfold_column_chunks: non_tensor_batch[{key!r}] has {values.shape[1]} "
                                         f"columns, not divisible by {n_split}")
        return values.reshape(n * n_split, values.shape[1] // n_split, *values.shape[2:])
    out = np.empty(n * n_split, dtype=object)
    for i, item in enumerate(values):
        if isinstance(item, (str, bytes)) or not hasattr(item, "__len__") or len(item) % n_split:
            found = f"length {len(item)}" if hasattr(item, "__len__") else type(item).__name__
            raise BatchSizeMismatchError(f"unfold_column_chunks: non_tensor_batch[{key!r}][{i}] is {found}; expected "
                                         f"a sequence whose length is divisible by {n_split}")
        size = len(item) // n_split
        for j in range(n_split):
            out[i * n_split + j] = item[j * size:(j + 1) * size]
    return out


# ------------------------------------------------------------------------------------------------ collate


def _stack(values: list[torch.Tensor], key: str) -> torch.Tensor:
    shapes = {tuple(v.shape) for v in values}
    if len(shapes) == 1:
        return torch.stack(values, dim=0)
    trailing = {s[1:] for s in shapes}
    if any(v.dim() == 0 for v in values) or len(trailing) != 1:
        raise BatchSizeMismatchError(f"collate_fn: field {key!r} has shapes {sorted(shapes)}; only dim 0 may vary "
                                     f"(variable length samples become a jagged tensor)")
    return to_nested(values)


def collate_fn(x: Sequence[DataProtoItem] | Sequence[Mapping[str, Any]]) -> DataProto | dict[str, Any]:
    """Batch samples: tensors stack along a new dim 0 (variable-length ones become jagged), the rest object arrays.

    A list of :class:`DataProtoItem` gives a :class:`DataProto` (meta_info of the first item); a list of dicts
    (dataset rows) gives a dict of stacked tensors and numpy object arrays.
    """
    items = list(x)
    if not items:
        raise ValueError("collate_fn: expected at least one sample, found none")
    if all(isinstance(x, DataProtoItem) for x in items):
        tensors: dict[str, list[torch.Tensor]] = {}
        if items[0].batch is not None:
            keys = list(items[0].batch.keys())
            for i, x in enumerate(items):
                if x.batch is None or set(x.batch.keys()) != set(keys):
                    raise DataProtoKeyError(f"collate_fn: item {i} has batch keys "
                                   f"{sorted(x.batch.keys()) if x.batch is not None else None}, item 0 has {sorted(keys)}")
            tensors = {k: [x.batch.get(k) for x in items] for k in keys}
        nt_keys = list(items[0].non_tensor_batch)
        for i, x in enumerate(items):
            if set(x.non_tensor_batch) != set(nt_keys):
                raise DataProtoKeyError(f"collate_fn: item {i} has non_tensor keys {sorted(x.non_tensor_batch)}, "
                                        f"item 0 has "
                               f"{sorted(nt_keys)}")
        return DataProto.from_dict(tensors={k: _stack(v, k) for k, v in tensors.items()},
                                   non_tensors={k: [x.non_tensor_batch[k] for x in items] for k in nt_keys},
                                   meta_info=dict(items[0].meta_info))
    if all(isinstance(x, Mapping) for x in items):
        keys = list(items[0])
        for i, x in enumerate(items):
            if set(x) != set(keys):
                raise DataProtoKeyError(f"collate_fn: row {i} has keys {sorted(x)}, row 0 has {sorted(keys)}")
        out: dict[str, Any] = {}
        for k in keys:
            column = [x[k] for x in items]
            if all(isinstance(v, torch.Tensor) for v in column):
                out[k] = _stack(column, k)
            else:
                out[k] = to_object_array(column, f"collate_fn[{k!r}]")
        return out
    kinds = sorted({type(x).__name__ for x in items})
    raise TypeError(f"collate_fn: expected all DataProtoItem or all dicts, found {kinds}")
