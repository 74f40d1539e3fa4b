"""Cutting a batch of fields into per-key values and joining per-key values back into a batch.

The rule both stores follow when they hand a field back (``assemble_field``):

* every key's value has the same shape ``s``  -> a dense tensor ``[n, *s]``;
* the shapes differ only in dim 0             -> a jagged nested tensor ``[n, j, *rest]``
  (``layout=torch.jagged``, the ragged dim right after the batch dim);
* a field named in ``jagged`` is returned jagged even when all shapes agree (values of dim >= 1);
* anything else (different dtypes, different ndim, shapes differing beyond dim 0) -> FieldShapeError.

The TransferQueue store keeps these per-key values as their own CPU tensors; :class:`LocalStore` keeps one
buffer per field of each put (:mod:`protocol.store.columns`) and joins rows by the same rule.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from protocol.checks import SCALAR
from protocol.batch.nested import is_jagged, jagged_parts, nested_from_values
from .errors import FieldShapeError, preview

__all__ = [
    "jagged_rows",
    "split_rows",
    "per_key_fields",
    "batch_fields",
    "single_key_fields",
    "assemble_field",
    "assemble_batch",
    "batch_of",
    "same_value",
    "nbytes",
    "normalize_tag",
    "own_copy",
]


def nbytes(t: torch.Tensor) -> int:
    """Bytes of the elements of a stored (dense, contiguous) value."""
    return t.numel() * t.element_size()


def own_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached, contiguous CPU copy with its own storage (never a view into the caller's buffer)."""
    if t.requires_grad:
        t = t.detach()
    if t.is_cpu:
        return t.clone(memory_format=torch.contiguous_format)
    return t.to("cpu").contiguous()


def jagged_rows(nt: torch.Tensor) -> list[torch.Tensor]:
    """The components of a jagged nested tensor as views of its values, cut once at its offsets.

    Same result as ``nt.unbind(0)``, without the nested tensor's per-component checks; indexing ``nt[i]`` per
    component would instead unbind the whole tensor each time (quadratic in the batch).
    """
    if not is_jagged(nt):
        return list(nt.unbind(0))
    values, offsets = jagged_parts(nt)
    lengths = offsets.diff().tolist()
    return list(torch.split(values, lengths, 0)) if lengths else []


def split_rows(name: str, value: Any, n: int) -> list[torch.Tensor]:
    """Cut one batched field (dim 0 = keys) into ``n`` per-key tensors, each an own CPU copy.

    A jagged nested tensor gives each key its own length; a dense tensor gives row ``i``;
    a list/tuple of tensors gives its items.
    """
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            rows = jagged_rows(value)
        else:
            if value.dim() == 0:
                raise FieldShapeError(f"field {name!r}: a batched value needs a batch dim 0 of size {n}, "
                                      f"got a 0-d tensor")
            rows = list(value.unbind(0))
    elif isinstance(value, (list, tuple)):
        rows = list(value)
        bad = [i for i, r in enumerate(rows) if not isinstance(r, torch.Tensor)]
        if bad:
            raise TypeError(f"field {name!r}: list items must be tensors; positions {preview(bad)} are not "
                            f"(first is {type(rows[bad[0]]).__name__})")
    else:
        raise TypeError(f"field {name!r}: expected a tensor (dense or jagged) or a list of tensors, "
                        f"got {type(value).__name__}")
    if len(rows) != n:
        raise FieldShapeError(f"field {name!r}: batch dim 0 has {len(rows)} entries, expected {n} (one per key)")
    return [own_copy(r) for r in rows]


def batch_fields(fields: Any, n: int) -> list[tuple[str, Any]]:
    """The ``(name, value)`` pairs of the ``fields`` of a batch put of ``n`` keys (TensorDict or mapping), checked:
    str names, no nested TensorDict, a TensorDict's batch dim equal to ``n``."""
    if fields is None:
        return []
    if isinstance(fields, TensorDictBase):
        if len(fields.batch_size) == 0 or fields.batch_size[0] != n:
            raise FieldShapeError(f"fields: TensorDict batch_size {list(fields.batch_size)} does not match "
                                  f"{n} keys (dim 0 must equal len(keys))")
        items = []
        for name in fields.keys():
            value = fields.get(name)
            if isinstance(value, TensorDictBase):
                raise TypeError(f"fields: nested TensorDict under {name!r} is not supported; flatten it "
                                f"(e.g. td.flatten_keys('.'))")
            items.append((name, value))
    elif isinstance(fields, Mapping):
        items = list(fields.items())
    else:
        raise TypeError(f"fields must be a TensorDict or a dict of tensors, got {type(fields).__name__}")
    for name, _ in items:
        if not isinstance(name, str) or not name:
            raise TypeError(f"fields: names must be non-empty str, got {name!r}")
    return items


def per_key_fields(fields: Any, n: int) -> dict[str, list[torch.Tensor]]:
    """Turn the ``fields`` of a batch put (TensorDict or mapping, dim 0 = keys) into field -> per-key tensors."""
    return {name: split_rows(name, value, n) for name, value in batch_fields(fields, n)}


def single_key_fields(fields: Any) -> dict[str, torch.Tensor]:
    """The ``fields`` of a single-key put: a dict of per-key tensors, or a TensorDict of batch [] or [1]."""
    if fields is None:
        return {}
    if isinstance(fields, TensorDictBase):
        if list(fields.batch_size) == [1]:
            return {k: v[0] for k, v in per_key_fields(fields, 1).items()}
        if len(fields.batch_size) != 0:
            raise FieldShapeError(f"fields: a single-key TensorDict must have batch_size [] or [1], "
                                  f"got {list(fields.batch_size)}")
        fields = {k: fields.get(k) for k in fields.keys()}
    if not isinstance(fields, Mapping):
        raise TypeError(f"fields must be a dict of tensors or a TensorDict, got {type(fields).__name__}")
    out = {}
    for name, value in fields.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"fields: names must be non-empty str, got {name!r}")
        if not isinstance(value, torch.Tensor) or value.is_nested:
            raise TypeError(f"field {name!r}: a single-key value must be a plain (non-nested) tensor, "
                            f"got {type(value).__name__}")
        out[name] = own_copy(value)
    return out


def assemble_field(name: str, parts: Sequence[torch.Tensor], jagged: bool = False) -> torch.Tensor:
    """Join per-key values of one field into a batch: dense when all shapes agree, else jagged (see module doc)."""
    if not parts:
        raise FieldShapeError(f"field {name!r}: cannot assemble a field from zero keys")
    dtypes = {p.dtype for p in parts}
    if len(dtypes) != 1:
        raise FieldShapeError(f"field {name!r}: per-key values have different dtypes {sorted(map(str, dtypes))}; "
                              f"write one dtype per field")
    shapes = [tuple(p.shape) for p in parts]
    if not jagged and all(s == shapes[0] for s in shapes):
        return torch.stack(list(parts))
    ndims = {len(s) for s in shapes}
    if ndims != {len(shapes[0])} or len(shapes[0]) == 0:
        raise FieldShapeError(f"field {name!r}: per-key values cannot be batched jagged: shapes "
                              f"{preview(sorted(set(shapes)))}; they must share ndim >= 1")
    rests = {s[1:] for s in shapes}
    if len(rests) != 1:
        raise FieldShapeError(f"field {name!r}: per-key shapes may differ only in dim 0 to come back jagged; "
                              f"found trailing shapes {preview(sorted(rests))}")
    lengths = torch.tensor([s[0] for s in shapes], dtype=torch.int64)
    offsets = torch.zeros(len(parts) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    values = torch.cat(list(parts), 0)
    return nested_from_values(values, offsets)


def batch_of(fields: Mapping[str, Any], n: int) -> TensorDict:
    """A TensorDict ``[n]`` of ``fields``, for values a store or stage built with dim 0 = ``n``.

    Dim 0 is checked on the tensors' own attributes; tensordict's per-value validation reads a jagged tensor's
    shape through its Python dispatch (~25 us a field), so the checked batch is built without it. Anything else
    (not a tensor, a wrong dim 0) goes to the TensorDict constructor, which names the problem.
    """
    ok = all(map(_leads_with, fields.values(), itertools.repeat(n)))
    if ok and hasattr(TensorDict, "_new_unsafe"):
        return TensorDict._new_unsafe(dict(fields), batch_size=torch.Size([n]))
    return TensorDict(dict(fields), batch_size=[n])


def _leads_with(value: Any, n: int) -> bool:
    if is_jagged(value):
        return value._offsets.shape[0] == n + 1
    return type(value) is torch.Tensor and value.dim() >= 1 and value.shape[0] == n


def assemble_batch(n: int, columns: Mapping[str, Sequence[torch.Tensor]], jagged: Iterable[str] = ()) -> TensorDict:
    """A TensorDict of batch ``[n]`` holding each column assembled by :func:`assemble_field`."""
    jagged = set(jagged)
    data = {name: assemble_field(name, parts, name in jagged) for name, parts in columns.items()}
    return TensorDict(data, batch_size=[n])


def same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and elements (NaN equals NaN): writing ``b`` over ``a`` would change nothing."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(a, b) or ((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


_SCALARS = tuple(SCALAR)  # for isinstance, which subclasses pass too


def _json_value(value: Any, where: str) -> Any:
    if type(value) in SCALAR or isinstance(value, _SCALARS):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_json_value(v, where) for v in value]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: nested tag keys must be str, got {k!r}")
            out[k] = _json_value(v, where)
        return out
    hint = " (use .item() / .tolist())" if isinstance(value, (torch.Tensor, np.ndarray)) else ""
    raise TypeError(f"{where}: tag values must be JSON-able (str, int, float, bool, None, list, dict), "
                    f"got {type(value).__name__}{hint}")


def normalize_tag(tag: Any, key: str) -> dict:
    """A validated copy of one tag: str names, JSON-able values (numpy scalars become Python scalars)."""
    if type(tag) is not dict and not isinstance(tag, Mapping):
        raise TypeError(f"tag of key {key!r} must be a dict, got {type(tag).__name__}")
    out = {}
    for name, value in tag.items():
        if type(name) is not str and not isinstance(name, str):
            raise TypeError(f"tag of key {key!r}: names must be str, got {name!r}")
        out[name] = value if type(value) in SCALAR else _json_value(value, f"tag {name!r} of key {key!r}")
    return out
