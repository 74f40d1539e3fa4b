"""TensorDict <-> plain (numpy bytes) form: a pickle-, torch- and version-independent way to ship a batch.

:func:`serialize_tensordict` returns the reference system's ``(batch_size, device, items)`` tuple: ``items`` maps
each leaf key to ``(dtype, shape, bytes)`` for a dense tensor or ``(layout, [(dtype, shape, bytes), ...])`` for a
nested one (jagged or strided, one entry per sample), the bytes as a numpy ``uint8`` array. Any dtype (bfloat16,
bool, float8) round-trips, sub-TensorDict leaves use tuple keys, and the TensorDict's device is restored.
:func:`deserialize_tensordict` reads that tuple, the reference system's own output, and this project's earlier
``{"format": "rldispatch.td.v1", ...}`` dicts.

Example::

    >>> import torch
    >>> from tensordict import TensorDict
    >>> batch_size, device, items = serialize_tensordict(TensorDict({"x": torch.arange(3)}, batch_size=[3]))
    >>> batch_size, device, items["x"][:2]
    ((3,), None, ('int64', (3,)))
    >>> deserialize_tensordict((batch_size, device, items))["x"].tolist()
    [0, 1, 2]
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, is_non_tensor

from protocol.batch.nested import (
    is_jagged, nested_from_values, nested_offsets, nested_values, strided_nested, to_nested,
)

__all__ = [
    "SerializationError",
    "serialize_single_tensor",
    "deserialize_single_tensor",
    "serialize_tensordict",
    "deserialize_tensordict",
]

_FORMAT_V1 = "rldispatch.td.v1"
_LAYOUTS = {"jagged": torch.jagged, "strided": torch.strided}


class SerializationError(ValueError, AssertionError):
    """A serialized tensor or TensorDict that this module cannot read back (also an ``AssertionError``, as the
    reference system asserts these conditions)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise SerializationError(f"unknown dtype {name!r} in serialized tensor; expected a torch dtype name such as "
                                 f"'float32' or 'bfloat16'")
    return dtype


def _to_bytes(t: torch.Tensor) -> np.ndarray:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).numpy().copy() if flat.numel() else np.zeros(0, dtype=np.uint8)


def _from_bytes(raw: Any, dtype: torch.dtype, shape: tuple[int, ...], what: str, owned: bool = False) -> torch.Tensor:
    buf = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) else np.asarray(raw)
    if buf.dtype != np.uint8 or buf.ndim != 1:
        raise SerializationError(f"{what}: expected a 1-D uint8 byte buffer, found dtype {buf.dtype} shape {buf.shape}")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    if buf.size != numel * itemsize:
        raise SerializationError(f"{what}: shape {tuple(shape)} of {_dtype_name(dtype)} needs {numel * itemsize} bytes, "
                                 f"found {buf.size}")
    flat = torch.from_numpy(buf if owned else buf.copy())  # a copy unless the buffer is already ours alone
    storage = torch.uint8 if dtype == torch.bool else dtype
    out = flat.view(storage) if flat.numel() else torch.zeros(0, dtype=storage)
    return (out.view(torch.bool) if dtype == torch.bool else out).reshape(shape)


def serialize_single_tensor(obj: torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    """A dense tensor as ``(dtype name, shape, uint8 bytes)`` (copied to host memory; any dtype).

    >>> serialize_single_tensor(torch.tensor([1.0, 2.0], dtype=torch.bfloat16))[:2]
    ('bfloat16', (2,))
    """
    if not isinstance(obj, torch.Tensor) or obj.is_nested:
        found = "a nested tensor" if isinstance(obj, torch.Tensor) else type(obj).__name__
        raise TypeError(f"serialize_single_tensor: expected a dense torch.Tensor, found {found}; nested tensors go "
                        f"through serialize_tensordict")
    return _dtype_name(obj.dtype), tuple(int(d) for d in obj.shape), _to_bytes(obj)


def deserialize_single_tensor(arr: Any) -> torch.Tensor:
    """The CPU tensor described by ``(dtype name, shape, bytes)`` from :func:`serialize_single_tensor`.

    The bytes may be a numpy ``uint8`` array, ``bytes``, ``bytearray`` or ``memoryview``; the byte count must match.
    """
    if not isinstance(arr, (tuple, list)) or len(arr) != 3:
        length = f" of length {len(arr)}" if isinstance(arr, (tuple, list)) else ""
        raise SerializationError(f"deserialize_single_tensor: expected (dtype, shape, bytes), found "
                                 f"{type(arr).__name__}{length}")
    dtype_name, shape, data = arr
    return _from_bytes(data, _dtype_from(dtype_name), tuple(int(d) for d in shape), f"tensor of {dtype_name!r}")


def _nested_from(components: list[torch.Tensor], layout: str, template: Any, what: str) -> torch.Tensor:
    if not components:  # an empty batch: the template records dtype and trailing shape
        if template is None:
            raise SerializationError(f"{what}: an empty {layout} nested tensor needs its (dtype, shape) template")
        dtype = _dtype_from(template[0])
        if layout == "jagged":
            return nested_from_values(torch.zeros(tuple(int(d) for d in template[1]), dtype=dtype),
                                      torch.zeros(1, dtype=torch.int64))
        return strided_nested([], dtype=dtype)
    return to_nested(components) if layout == "jagged" else strided_nested(components)


def _jagged_components(nt: torch.Tensor) -> list[tuple[str, tuple[int, ...], np.ndarray]]:
    """Per-sample ``(dtype, shape, bytes)`` of a jagged tensor as views into one host copy of its values."""
    values, offsets = nested_values(nt), nested_offsets(nt).cpu().tolist()
    raw = _to_bytes(values)
    trailing = tuple(int(d) for d in values.shape[1:])
    row = values[:1].numel() * values.element_size() if values.shape[0] else 0
    name = _dtype_name(values.dtype)
    return [(name, (b - a, *trailing), raw[a * row:b * row]) for a, b in zip(offsets[:-1], offsets[1:])]


def _jagged_from_components(encoded: list, what: str) -> torch.Tensor | None:
    """One concatenated buffer -> values + offsets when every sample shares dtype and trailing shape (else None)."""
    names = {c[0] for c in encoded}
    trailing = {tuple(int(d) for d in c[1][1:]) for c in encoded}
    if len(names) != 1 or len(trailing) != 1 or any(len(c[1]) < 1 for c in encoded):
        return None
    dtype, tail = _dtype_from(names.pop()), trailing.pop()
    lengths = [int(c[1][0]) for c in encoded]
    parts = [np.frombuffer(c[2], dtype=np.uint8) if isinstance(c[2], (bytes, bytearray, memoryview))
             else np.asarray(c[2]) for c in encoded]
    values = _from_bytes(np.concatenate(parts), dtype, (sum(lengths), *tail), what, owned=True)
    return nested_from_values(values, torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64))


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[Any, tuple]]:
    """``(batch_size, device, items)``: every leaf as bytes (dense, jagged or strided; sub-dict leaves by tuple key).

    ``device`` is ``str(batch.device)`` or ``None``; tensors are copied to host memory on the way.
    """
    if not isinstance(batch, TensorDict):
        raise TypeError(f"serialize_tensordict: expected a TensorDict, found {type(batch).__name__}")
    items: dict[Any, tuple] = {}
    for key in batch.keys(include_nested=True):
        value = batch.get(key)
        if isinstance(value, TensorDict) and not is_non_tensor(value):
            continue  # a sub-dict: its leaves come as their own (tuple) keys
        if not isinstance(value, torch.Tensor) or is_non_tensor(value):
            raise TypeError(f"serialize_tensordict: field {key!r} holds {type(value).__name__}; only tensors "
                            f"(dense or nested) can be serialized, keep other data in non_tensor_batch")
        if value.is_nested:
            layout = "jagged" if is_jagged(value) else "strided"
            components = _jagged_components(value) if is_jagged(value) else \
                [serialize_single_tensor(c) for c in value.unbind()]
            if components:
                items[key] = (layout, components)
            else:
                values = value.values() if is_jagged(value) else torch.zeros(0, dtype=value.dtype)
                items[key] = (layout, components, (_dtype_name(value.dtype), tuple(values.shape)))
        else:
            items[key] = serialize_single_tensor(value)
    device = str(batch.device) if batch.device is not None else None
    return tuple(int(d) for d in batch.batch_size), device, items


def _decode_item(key: Any, encoded: Any) -> torch.Tensor:
    if not isinstance(encoded, (tuple, list)) or not encoded:
        raise SerializationError(f"field {key!r}: expected (dtype, shape, bytes) or (layout, components), found "
                                 f"{type(encoded).__name__}")
    if encoded[0] in _LAYOUTS:
        if len(encoded) not in (2, 3) or not isinstance(encoded[1], (list, tuple)):
            raise SerializationError(f"field {key!r}: a nested entry is (layout, [components]), found {len(encoded)} "
                                     f"parts")
        if encoded[0] == "jagged" and encoded[1]:
            fast = _jagged_from_components(list(encoded[1]), f"field {key!r}")
            if fast is not None:
                return fast
        components = [deserialize_single_tensor(c) for c in encoded[1]]
        return _nested_from(components, encoded[0], encoded[2] if len(encoded) == 3 else None, f"field {key!r}")
    if len(encoded) != 3:
        raise SerializationError(f"field {key!r}: expected (dtype, shape, bytes) (3 parts) or (layout, components) "
                                 f"(2 parts), found {len(encoded)} parts")
    return deserialize_single_tensor(encoded)


def _deserialize_v1(data: dict[str, Any]) -> TensorDict:
    out = TensorDict({}, batch_size=list(data["batch_size"]))
    for path, spec in data["fields"].items():
        values = _from_bytes(spec["data"], _dtype_from(spec["dtype"]), tuple(spec["shape"]), f"field {path!r}")
        if spec["kind"] == "jagged":
            value = nested_from_values(values, torch.from_numpy(np.asarray(spec["offsets"], dtype=np.int64)))
        elif spec["kind"] == "dense":
            value = values
        else:
            raise SerializationError(f"field {path!r}: unknown kind {spec['kind']!r}; expected 'dense' or 'jagged'")
        out.set(path if len(path) > 1 else path[0], value)
    return out


def deserialize_tensordict(arr: Any) -> TensorDict:
    """Rebuild the TensorDict of :func:`serialize_tensordict` on its recorded device (or CPU when it had none).

    Also reads the reference system's tuples and this project's earlier ``rldispatch.td.v1`` dicts.
    """
    if isinstance(arr, dict):
        if arr.get("format") != _FORMAT_V1:
            raise SerializationError(f"deserialize_tensordict: a dict must have format {_FORMAT_V1!r}, found "
                                     f"{arr.get('format')!r}")
        return _deserialize_v1(arr)
    if not isinstance(arr, (tuple, list)) or len(arr) != 3 or not isinstance(arr[2], dict):
        raise SerializationError(f"deserialize_tensordict: expected (batch_size, device, items) as written by "
                                 f"serialize_tensordict, found {type(arr).__name__}")
    batch_size, device, items = arr
    out = TensorDict({}, batch_size=list(batch_size))
    for key, encoded in items.items():
        out.set(key, _decode_item(key, encoded))
    return out.to(device) if device is not None else out
