"""TensorDict <-> plain (numpy bytes) form: a pickle-, torch- and version-independent way to ship a batch.

:func:`serialize_tensordict` turns every leaf of a TensorDict (dense or jagged, any dtype including bfloat16,
nested sub-dicts included) into raw little-endian bytes in a numpy ``uint8`` array plus its dtype and shape, so
the result pickles with numpy alone and carries no tensor storage sharing. :func:`deserialize_tensordict`
rebuilds an equal TensorDict.

Example::

    >>> import torch
    >>> from tensordict import TensorDict, is_non_tensor
    >>> td = TensorDict({"x": torch.arange(3)}, batch_size=[3])
    >>> deserialize_tensordict(serialize_tensordict(td))["x"].tolist()
    [0, 1, 2]
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, is_non_tensor

from protocol.batch.nested import is_jagged, nested_from_values, nested_offsets, nested_values

__all__ = ["SerializationError", "serialize_tensordict", "deserialize_tensordict"]

_FORMAT = "rldispatch.td.v1"


class SerializationError(ValueError):
    """A serialized TensorDict that this module did not write or cannot read back."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _to_bytes(t: torch.Tensor) -> np.ndarray:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).numpy().copy() if flat.numel() else np.zeros(0, dtype=np.uint8)


def _from_bytes(raw: np.ndarray, dtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise SerializationError(f"unknown dtype {dtype_name!r} in serialized tensor")
    storage_dtype = torch.uint8 if dtype == torch.bool else dtype
    buf = torch.from_numpy(np.ascontiguousarray(raw).copy())
    flat = buf.view(storage_dtype) if buf.numel() else torch.zeros(0, dtype=storage_dtype)
    flat = flat.to(torch.bool) if dtype == torch.bool else flat
    return flat.reshape(shape)


def serialize_tensordict(td: TensorDict) -> dict[str, Any]:
    """A TensorDict as a dict of numpy byte arrays plus dtype/shape/offsets (jagged fields keep their lengths)."""
    if not isinstance(td, TensorDict):
        raise TypeError(f"serialize_tensordict: expected a TensorDict, found {type(td).__name__}")
    fields: dict[tuple[str, ...], dict[str, Any]] = {}
    for key in td.keys(include_nested=True):
        value = td.get(key)
        path = key if isinstance(key, tuple) else (key,)
        if isinstance(value, TensorDict) and not is_non_tensor(value):
            continue  # a sub-dict: its leaves come as their own keys
        if not isinstance(value, torch.Tensor) or is_non_tensor(value):
            raise TypeError(f"serialize_tensordict: field {key!r} holds {type(value).__name__}; only tensors "
                            f"(dense or jagged) can be serialized, keep other data in non_tensor_batch")
        if is_jagged(value):
            vals = nested_values(value)
            fields[path] = {"kind": "jagged", "dtype": _dtype_name(vals.dtype), "shape": tuple(vals.shape),
                            "data": _to_bytes(vals), "offsets": nested_offsets(value).cpu().numpy().copy()}
        elif value.is_nested:
            raise TypeError(f"serialize_tensordict: field {key!r} is a strided nested tensor; use layout=torch.jagged")
        else:
            fields[path] = {"kind": "dense", "dtype": _dtype_name(value.dtype), "shape": tuple(value.shape),
                            "data": _to_bytes(value)}
    return {"format": _FORMAT, "batch_size": tuple(td.batch_size), "fields": fields}


def deserialize_tensordict(data: dict[str, Any]) -> TensorDict:
    """Rebuild the TensorDict written by :func:`serialize_tensordict` (on CPU)."""
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise SerializationError(f"deserialize_tensordict: expected a dict with format {_FORMAT!r}, found {found!r}")
    out = TensorDict({}, batch_size=list(data["batch_size"]))
    for path, spec in data["fields"].items():
        values = _from_bytes(spec["data"], spec["dtype"], tuple(spec["shape"]))
        if spec["kind"] == "jagged":
            value = nested_from_values(values, torch.from_numpy(np.asarray(spec["offsets"], dtype=np.int64)))
        elif spec["kind"] == "dense":
            value = values
        else:
            raise SerializationError(f"field {path!r}: unknown kind {spec['kind']!r}; expected 'dense' or 'jagged'")
        out.set(path if len(path) > 1 else path[0], value)
    return out
