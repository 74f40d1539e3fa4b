"""Field invariants of a trajectory batch, checked all at once and reported per key and field.

The rules (``Violation.rule``):

* ``key`` – every key parses as ``{uid}_{session_id}_{index}`` and appears once; a ``uid`` column agrees with it.
* ``tag`` – every tag is a complete trajectory tag with ``seq_len = prompt_len + response_len``.
* ``length`` – prompts have ``prompt_len`` tokens; responses, masks and every response-length float field have
  ``response_len``; ``input_ids`` has ``seq_len``; ``position_ids`` has ``seq_len`` along one dim; a non-padding
  trajectory has ``prompt_len >= 1`` (the log-prob shift needs it); dense per-sample fields have shape ``[n]``.
* ``content`` – ``input_ids = prompts ⧺ responses``; ``loss_mask = response_mask``; 1-D ``position_ids`` are
  ``0..seq_len-1``; masks hold only 0/1; a ``policy_len`` tag equals ``response_mask.sum()``.
* ``mask`` – rewards, advantages and returns are zero wherever ``response_mask`` is 0 (observation tokens and
  padding never carry a reward or an advantage).
* ``padding`` – a padding sample (tag ``is_padding=True``) has a uid of its own, ``response_mask`` all 0 and
  zero rewards, advantages and returns; an ``is_padding`` column agrees with the tags.
* ``reorder`` – (given ``before``) the batch holds exactly the same ``(key, uid, tags)`` entries as before.

Fields may be jagged (``torch.jagged`` nested, one row per sample) or padded ``[n, W]``: response-length fields
are then right padded (the tail beyond ``response_len`` must have mask 0 and zero values for masked-zero fields);
padded prompt / sequence fields are checked for width only, since their padding side is not fixed.

Example::

    >>> import torch
    >>> from tensordict import TensorDict
    >>> from protocol.batch.nested import to_nested
    >>> td = TensorDict({"responses": to_nested([torch.tensor([5, 6])]),
    ...                  "response_mask": to_nested([torch.tensor([1, 0])])}, batch_size=[1])
    >>> tag = {"prompt_len": 1, "response_len": 3, "seq_len": 4, "global_steps": 0, "min_global_steps": 0,
    ...        "max_global_steps": 0, "is_padding": False}
    >>> [v.rule for v in check_invariants(td, keys=["ab_0_0"], tags=[tag])]
    ['length', 'length']
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor

from protocol.fields import (
    DENSE_FIELDS, MASK_FIELDS, MASKED_ZERO_FIELDS, PROMPT_FIELDS, RESPONSE_FIELDS, SEQUENCE_FIELDS,
)
from protocol.store.keys import KeyFormatError, TagError, check_trajectory_tag, parse_trajectory_key

__all__ = [
    "PROMPT_FIELDS",
    "SEQUENCE_FIELDS",
    "RESPONSE_FIELDS",
    "MASK_FIELDS",
    "MASKED_ZERO_FIELDS",
    "DENSE_FIELDS",
    "Violation",
    "InvariantViolation",
    "BatchView",
    "as_batch_view",
    "check_invariants",
    "assert_invariants",
    "check_reorder",
]

_KEY_COLUMNS = ("key", "keys", "trajectory_key")
_TAG_COLUMNS = ("tag", "tags")


@dataclass(frozen=True)
class Violation:
    """One broken invariant: which trajectory (``key``), which ``field``, which ``rule``, and what was found."""

    key: str
    field: str
    rule: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.key} / {self.field}: {self.message}"


class InvariantViolation(ValueError):
    """A batch that breaks field invariants; ``violations`` lists every one, the message names them all."""

    def __init__(self, violations: Sequence[Violation]) -> None:
        self.violations = list(violations)
        shown = "\n  ".join(str(v) for v in self.violations[:50])
        more = f"\n  ... and {len(self.violations) - 50} more" if len(self.violations) > 50 else ""
        super().__init__(f"{len(self.violations)} field invariant violation(s):\n  {shown}{more}")


@dataclass
class BatchView:
    """What the checker reads: keys, tags, optional uid column, and per-field rows or dense columns.

    ``rows[name]`` is a list with one tensor per sample; ``padded`` names the fields whose rows carry padding;
    ``dense[name]`` is a per-sample column (``[n]`` tensor).
    """

    keys: list[str]
    tags: list[Mapping[str, Any]]
    rows: dict[str, list[Tensor]] = field(default_factory=dict)
    padded: set[str] = field(default_factory=set)
    dense: dict[str, Tensor] = field(default_factory=dict)
    uids: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.keys)


def _column(non_tensor: Mapping[str, Any], names: Iterable[str]) -> list | None:
    for name in names:
        if name in non_tensor:
            v = non_tensor[name]
            return list(v.tolist() if isinstance(v, np.ndarray) and v.dtype != object else v)
    return None


def as_batch_view(batch: Any, *, keys: Sequence[str] | None = None, tags: Sequence[Mapping] | None = None,
                  meta: Any = None) -> BatchView:
    """Adapt a TensorDict (+ keys, tags), a DataProto, or an object with ``keys``/``fields``/``tags`` attributes.

    ``meta`` (a KVBatchMeta, or anything with ``keys`` and ``tags``) supplies keys and tags. A DataProto may carry
    them in ``non_tensor_batch`` (``key``/``keys``/``trajectory_key`` and ``tag``/``tags``) and a ``uid`` column.
    """
    uids = None
    if meta is not None:
        keys = list(meta.keys) if keys is None else keys
        tags = list(meta.tags) if tags is None else tags
    if isinstance(batch, TensorDict) or batch is None:
        td = batch
    elif hasattr(batch, "non_tensor_batch") and hasattr(batch, "batch"):  # DataProto
        td = batch.batch
        nt = batch.non_tensor_batch
        keys = keys if keys is not None else _column(nt, _KEY_COLUMNS)
        tags = tags if tags is not None else _column(nt, _TAG_COLUMNS)
        uids = _column(nt, ("uid",))
    elif hasattr(batch, "fields") and hasattr(batch, "keys") and hasattr(batch, "tags"):  # TrajectoryBatch
        td = batch.fields
        keys = list(batch.keys) if keys is None else keys
        tags = list(batch.tags) if tags is None else tags
    else:
        raise TypeError(f"check_invariants needs a TensorDict, a DataProto or a batch with keys/fields/tags; "
                        f"got {type(batch).__name__}")
    if keys is None or tags is None:
        raise ValueError(f"check_invariants needs keys and tags (arguments keys=/tags=/meta=, or DataProto "
                         f"non_tensor_batch columns {list(_KEY_COLUMNS)} / {list(_TAG_COLUMNS)}); got "
                         f"keys={'missing' if keys is None else 'given'}, tags={'missing' if tags is None else 'given'}")
    keys, tags = list(keys), list(tags)
    if len(keys) != len(tags):
        raise ValueError(f"check_invariants: {len(keys)} keys but {len(tags)} tags; expected one tag per key")
    n = len(keys)
    view = BatchView(keys, tags, uids=uids)
    if uids is not None and len(uids) != n:
        raise ValueError(f"uid column has {len(uids)} entries, expected {n} (one per key)")
    if td is None:
        return view
    if td.batch_size[:1] != torch.Size([n]):
        raise ValueError(f"batch has batch_size {tuple(td.batch_size)} but {n} keys were given; expected [{n}]")
    for name in td.keys():
        value = td.get(name)
        if not isinstance(value, Tensor):
            continue
        if value.is_nested:
            view.rows[name] = list(value.unbind())
        elif name in DENSE_FIELDS or value.dim() == 1:
            view.dense[name] = value
        else:
            view.rows[name] = list(value.unbind(0))
            view.padded.add(name)
    return view


def _row_len(row: Tensor) -> int:
    return int(row.shape[0]) if row.dim() else 0


class _Checker:
    def __init__(self, view: BatchView) -> None:
        self.v = view
        self.out: list[Violation] = []

    def add(self, i: int, fld: str, rule: str, msg: str) -> None:
        key = self.v.keys[i] if i >= 0 else "<batch>"
        self.out.append(Violation(str(key), fld, rule, msg))

    def run(self) -> list[Violation]:
        v = self.v
        n = len(v)
        seen: Counter = Counter(v.keys)
        for name, col in v.dense.items():
            if tuple(col.shape) != (n,):
                self.add(-1, name, "length", f"dense per-sample field has shape {tuple(col.shape)}, expected ({n},)")
        for i in range(n):
            self.row(i, seen)
        self.padding_uids()
        return self.out

    def padding_uids(self) -> None:
        """A padding sample has a uid of its own: it never joins a real group's statistics."""
        v = self.v
        real_uids, pad_rows = set(), []
        for i, (key, tag) in enumerate(zip(v.keys, v.tags)):
            uid = _uid_or_none(key)
            if uid is None or not isinstance(tag, Mapping):
                continue
            if tag.get("is_padding") is True:
                pad_rows.append((i, uid))
            else:
                real_uids.add(uid)
        for i, uid in pad_rows:
            if uid in real_uids:
                self.add(i, "key", "padding", f"padding sample shares uid {uid!r} with real trajectories; "
                                              f"expected a uid of its own")

    def row(self, i: int, seen: Counter) -> None:
        v = self.v
        key, tag = v.keys[i], v.tags[i]
        if seen[key] > 1:
            self.add(i, "key", "key", f"key appears {seen[key]} times in the batch; keys must be unique")
        try:
            uid = parse_trajectory_key(key)[0]
        except KeyFormatError as exc:
            self.add(i, "key", "key", str(exc))
            uid = None
        if uid is not None and v.uids is not None and v.uids[i] != uid:
            self.add(i, "uid", "key", f"uid column holds {v.uids[i]!r} but the key's uid is {uid!r}")
        try:
            check_trajectory_tag(tag, str(key))
        except TagError as exc:
            self.add(i, "tag", "tag", str(exc))
            return  # lengths cannot be trusted
        p, r, s = tag["prompt_len"], tag["response_len"], tag["seq_len"]
        padding = bool(tag["is_padding"])
        if not padding and p < 1:
            self.add(i, "prompt_len", "length", f"prompt_len is {p}; a trajectory needs >= 1 prompt token "
                                                f"(response token j is predicted from position prompt_len + j - 1)")
        if "is_padding" in v.dense and bool(v.dense["is_padding"][i]) != padding:
            self.add(i, "is_padding", "padding", f"is_padding column is {bool(v.dense['is_padding'][i])} but the "
                                                 f"tag says {padding}")
        rows = {name: v.rows[name][i] for name in v.rows}
        for name in PROMPT_FIELDS:
            if name in rows:
                self.length(i, name, rows[name], p, "prompt_len")
        for name in SEQUENCE_FIELDS:
            if name in rows and name != "position_ids":
                self.length(i, name, rows[name], s, "seq_len")
        if "position_ids" in rows:
            self.positions(i, rows["position_ids"], s)
        resp = {}
        for name in RESPONSE_FIELDS:
            if name in rows and self.length(i, name, rows[name], r, "response_len"):
                row = rows[name]
                if name in v.padded:
                    self.padded_tail(i, name, row, r)
                    row = row[:r]
                resp[name] = row
        if all(f in rows and f not in v.padded for f in ("input_ids", "prompts", "responses")) and \
                _row_len(rows["input_ids"]) == p + r and _row_len(rows["prompts"]) == p and "responses" in resp:
            if not torch.equal(rows["input_ids"], torch.cat([rows["prompts"], resp["responses"]])):
                self.add(i, "input_ids", "content", "input_ids != prompts ⧺ responses")
        mask = resp.get("response_mask")
        if mask is not None:
            self.mask_content(i, "response_mask", mask)
            if "loss_mask" in resp:
                self.mask_content(i, "loss_mask", resp["loss_mask"])
                if not torch.equal(resp["loss_mask"].bool(), mask.bool()):
                    self.add(i, "loss_mask", "content", "loss_mask differs from response_mask")
            policy_len = int(mask.bool().sum())
            if "policy_len" in tag and tag["policy_len"] != policy_len:
                self.add(i, "policy_len", "content", f"tag policy_len {tag['policy_len']} != response_mask.sum() "
                                                     f"{policy_len}")
            off = ~mask.bool()
            for name in MASKED_ZERO_FIELDS:
                if name in resp and bool((resp[name][off] != 0).any()):
                    pos = off.nonzero().flatten()[(resp[name][off] != 0)].tolist()
                    self.add(i, name, "mask", f"non-zero at positions {pos[:8]} where response_mask is 0")
            if padding and policy_len:
                self.add(i, "response_mask", "padding", f"padding sample has {policy_len} policy token(s); "
                                                         f"expected response_mask all 0")
        if padding:
            for name in MASKED_ZERO_FIELDS:
                if name in resp and bool((resp[name] != 0).any()):
                    self.add(i, name, "padding", "padding sample has non-zero values; expected all 0")
            if "reward_score" in v.dense and float(v.dense["reward_score"][i]) != 0.0:
                self.add(i, "reward_score", "padding", f"padding sample has reward_score "
                                                       f"{float(v.dense['reward_score'][i])}; expected 0")

    def length(self, i: int, name: str, row: Tensor, expected: int, what: str) -> bool:
        got = _row_len(row)
        if name in self.v.padded:
            if got < expected:
                self.add(i, name, "length", f"padded width {got} < {what} {expected}")
                return False
            return True
        if got != expected:
            self.add(i, name, "length", f"has {got} entries, expected {what} = {expected}")
            return False
        return True

    def padded_tail(self, i: int, name: str, row: Tensor, r: int) -> None:
        tail = row[r:]
        if tail.numel() and (name in MASK_FIELDS or name in MASKED_ZERO_FIELDS) and bool((tail != 0).any()):
            self.add(i, name, "padding", f"right padding beyond response_len {r} holds non-zero values")

    def positions(self, i: int, row: Tensor, s: int) -> None:
        if "position_ids" in self.v.padded:
            if row.shape[-1] < s:
                self.add(i, "position_ids", "length", f"padded width {row.shape[-1]} < seq_len {s}")
            return
        if row.dim() == 1:
            if row.shape[0] != s:
                self.add(i, "position_ids", "length", f"has {row.shape[0]} entries, expected seq_len = {s}")
            elif not torch.equal(row.to(torch.long), torch.arange(s, device=row.device)):
                self.add(i, "position_ids", "content", f"1-D position_ids are not 0..{s - 1}")
        elif s not in tuple(row.shape):
            self.add(i, "position_ids", "length", f"shape {tuple(row.shape)} has no dim of seq_len = {s}")

    def mask_content(self, i: int, name: str, mask: Tensor) -> None:
        if bool(((mask != 0) & (mask != 1)).any()):
            self.add(i, name, "content", f"holds values other than 0/1: {sorted(set(mask.tolist()))[:8]}")


def _entries(batch: Any) -> list[tuple[str, Any, str]]:
    if isinstance(batch, tuple) and len(batch) == 2:
        keys, tags = batch
        uids = None
    else:
        view = batch if isinstance(batch, BatchView) else as_batch_view(
            batch if not _is_meta(batch) else None, meta=batch if _is_meta(batch) else None)
        keys, tags, uids = view.keys, view.tags, view.uids
    keys, tags = list(keys), list(tags)
    out = []
    for i, (k, t) in enumerate(zip(keys, tags)):
        uid = uids[i] if uids is not None else _uid_or_none(k)
        out.append((k, uid, repr(sorted((str(a), repr(b)) for a, b in dict(t).items()))))
    return out


def _is_meta(obj: Any) -> bool:
    return hasattr(obj, "keys") and hasattr(obj, "tags") and hasattr(obj, "partition_id")


def _uid_or_none(key: str) -> str | None:
    try:
        return parse_trajectory_key(key)[0]
    except KeyFormatError:
        return None


def check_reorder(before: Any, after: Any) -> list[Violation]:
    """Violations (rule ``reorder``) unless ``after`` holds exactly the ``(key, uid, tags)`` entries of ``before``.

    Each side is a KVBatchMeta, a DataProto / TrajectoryBatch, a :class:`BatchView` or a ``(keys, tags)`` pair.
    """
    b, a = Counter(_entries(before)), Counter(_entries(after))
    after_by_key = {e[0]: e for e in a}
    before_keys = {e[0] for e in b}
    out = []
    for entry in sorted(set(b) | set(a), key=repr):
        key, uid, tag = entry
        nb, na = b.get(entry, 0), a.get(entry, 0)
        if nb == na:
            continue
        if nb and not na and key in after_by_key:
            _, uid2, tag2 = after_by_key[key]
            fld = "uid" if uid2 != uid else "tags"
            out.append(Violation(str(key), fld, "reorder", f"changed by the reorder: before uid={uid!r} tags={tag}, "
                                                           f"after uid={uid2!r} tags={tag2}"))
        elif nb and not na:
            out.append(Violation(str(key), "key", "reorder", "present before the reorder, missing after it"))
        elif na and not nb and key not in before_keys:
            out.append(Violation(str(key), "key", "reorder", "present after the reorder, absent before it"))
        elif nb and na:
            out.append(Violation(str(key), "key", "reorder", f"appears {nb} time(s) before the reorder and {na} "
                                                             f"after"))
    return out


def check_invariants(batch: Any, *, keys: Sequence[str] | None = None, tags: Sequence[Mapping] | None = None,
                     meta: Any = None, before: Any = None) -> list[Violation]:
    """Every field-invariant violation of ``batch`` (empty list = all hold); see the module doc for the rules.

    ``batch``: a TensorDict of fields plus ``keys``/``tags`` (or ``meta``), a DataProto, or a TrajectoryBatch.
    ``before``: the same batch before a reorder (any form :func:`check_reorder` accepts).
    """
    view = batch if isinstance(batch, BatchView) else as_batch_view(batch, keys=keys, tags=tags, meta=meta)
    out = _Checker(view).run()
    if before is not None:
        out.extend(check_reorder(before, view))
    return out


def assert_invariants(batch: Any, **kwargs: Any) -> None:
    """Raise :class:`InvariantViolation` listing every violation of ``batch`` (same arguments as check_invariants)."""
    violations = check_invariants(batch, **kwargs)
    if violations:
        raise InvariantViolation(violations)
