"""Field-lineage trace: for one sampled prompt group, what each stage holds per field, written to JSONL."""
from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from protocol.store.keys import uid_of

__all__ = ["TraceError", "TraceRecorder", "uid_of_key", "read_trace", "LENGTH_KIND", "TRACE_COLUMNS"]

# Which tag length a per-trajectory field is expected to have.
LENGTH_KIND: dict[str, str] = {
    "prompts": "prompt_len",
    "input_ids": "seq_len",
    "position_ids": "seq_len",
    "attention_mask": "seq_len",
    **{f: "response_len" for f in (
        "responses", "response_mask", "loss_mask", "rollout_log_probs", "old_log_probs", "entropy", "ref_log_prob",
        "rm_scores", "token_level_scores", "token_level_rewards", "advantages", "returns", "values", "log_probs",
    )},
}

# Column order of a trace row (the report prints them in this order).
TRACE_COLUMNS = ("step", "rank", "stage", "field", "producer", "consumer", "shape", "lengths", "dtype", "device",
                 "valid_len", "mask_sum", "keys", "global_steps", "min_global_steps", "max_global_steps",
                 "is_padding", "length_ok")


class TraceError(ValueError):
    """A trace call whose keys, tags or fields do not line up; the message names the stage and field."""


def uid_of_key(key: str) -> str:
    """The uid a prompt key ``{uid}`` or trajectory key ``{uid}_{session_id}_{index}`` belongs to."""
    if not isinstance(key, str) or not key:
        raise TraceError(f"a store key must be a non-empty str, got {key!r}")
    return uid_of(key)


def _row_tensor(t: torch.Tensor, i: int) -> torch.Tensor:
    return t[i]


class TraceRecorder:
    """Records the lineage table of a sampled prompt group at every stage it is called from.

    ``sample_uid`` fixes the group; ``None`` takes the first uid seen by :meth:`record` (and :meth:`select`
    changes it, e.g. once per step). A disabled recorder does nothing. Each row is one (stage, field) with
    per-trajectory lists, in key order.
    """

    def __init__(self, path: str | Path, enabled: bool = True, sample_uid: str | None = None, rank: int = 0,
                 include_padding: bool = False):
        self.path = Path(path)
        self.enabled = bool(enabled)
        self.sample_uid = sample_uid
        self.rank = int(rank)
        self.include_padding = bool(include_padding)
        self.rows_written = 0
        self._fh = None
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")

    def select(self, uid: str | None) -> None:
        """Trace group ``uid`` from now on (``None``: the next uid recorded)."""
        if uid is not None and ("_" in uid or not uid):
            raise TraceError(f"sample_uid must be a prompt uid (no '_'), got {uid!r}")
        self.sample_uid = uid

    def _selected(self, keys: Sequence[str], tags: Sequence[Mapping[str, Any]]) -> list[int]:
        if self.sample_uid is None:
            for k, t in zip(keys, tags):
                if not t.get("is_padding", False):
                    self.sample_uid = uid_of_key(k)
                    break
        out = []
        for i, (k, t) in enumerate(zip(keys, tags)):
            if uid_of_key(k) == self.sample_uid or (self.include_padding and t.get("is_padding", False)):
                out.append(i)
        return out

    def record(self, stage: str, fields: Any, keys: Sequence[str], tags: Sequence[Mapping[str, Any]] | None = None,
               producer: str | Mapping[str, str] = "", consumer: str | Mapping[str, str] = "",
               step: int | None = None) -> list[dict[str, Any]]:
        """Write the rows of ``stage`` for the sampled group; return them (``[]`` when disabled or absent).

        ``fields`` is a TensorDict (or mapping of tensors, or ``None`` for a tags-only stage) whose dim 0 lines
        up with ``keys`` and ``tags``; jagged fields report per-trajectory lengths. ``producer`` / ``consumer``
        are one name for all fields or a per-field mapping.
        """
        if not self.enabled:
            return []
        keys = list(keys)
        tags = [dict(t) for t in tags] if tags is not None else [{} for _ in keys]
        if len(tags) != len(keys):
            raise TraceError(f"stage {stage!r}: {len(keys)} keys but {len(tags)} tags")
        items = self._field_items(stage, fields, len(keys))
        idx = self._selected(keys, tags)
        if not idx:
            return []
        sel_keys = [keys[i] for i in idx]
        sel_tags = [tags[i] for i in idx]
        mask_sum = None
        if "response_mask" in items:
            rm = items["response_mask"]
            mask_sum = [int(_row_tensor(rm, i).sum()) for i in idx]
        common = {
            "step": step if step is not None else _first(sel_tags, "global_steps"),
            "rank": self.rank, "stage": stage, "keys": sel_keys,
            "global_steps": [t.get("global_steps") for t in sel_tags],
            "min_global_steps": [t.get("min_global_steps") for t in sel_tags],
            "max_global_steps": [t.get("max_global_steps") for t in sel_tags],
            "is_padding": [bool(t.get("is_padding", False)) for t in sel_tags],
            "mask_sum": mask_sum,
        }
        rows = []
        if not items:
            rows.append({**common, "field": "-", "producer": _pick(producer, "-"), "consumer": _pick(consumer, "-"),
                         "shape": None, "lengths": None, "dtype": None, "device": None, "valid_len": None,
                         "length_ok": None})
        for name, t in items.items():
            rows.append({**common, "field": name, "producer": _pick(producer, name),
                         "consumer": _pick(consumer, name), **self._describe(name, t, idx, sel_tags)})
        for row in rows:
            self._fh.write(json.dumps({c: row.get(c) for c in TRACE_COLUMNS}, default=str) + "\n")
        self._fh.flush()
        self.rows_written += len(rows)
        return rows

    @staticmethod
    def _field_items(stage: str, fields: Any, n: int) -> dict[str, torch.Tensor]:
        if fields is None:
            return {}
        names = list(fields.keys(include_nested=False)) if hasattr(fields, "batch_size") else list(fields.keys())
        items = {}
        for name in names:
            t = fields[name]
            if not isinstance(t, torch.Tensor):
                continue  # nested TensorDicts / non-tensor data are not lineage fields
            rows = t.size(0) if t.dim() > 0 else 0
            if rows != n:
                raise TraceError(f"stage {stage!r}, field {name!r}: {rows} rows but {n} keys")
            items[str(name)] = t
        return items

    @staticmethod
    def _describe(name: str, t: torch.Tensor, idx: list[int], tags: list[dict]) -> dict[str, Any]:
        rows = [_row_tensor(t, i) for i in idx]
        lengths = [None if r.dim() == 0 else int(r.shape[0]) if r.dim() == 1 else list(r.shape) for r in rows]
        sizes = [x for x in lengths if isinstance(x, int)]
        if t.is_nested:
            shape = f"nested[{len(idx)}, j{min(sizes, default=0)}..{max(sizes, default=0)}]"
        else:
            shape = [len(idx), *t.shape[1:]]
        kind = LENGTH_KIND.get(name)
        valid = [tg.get(kind) for tg in tags] if kind else None
        ok = None
        if valid is not None and all(v is not None for v in valid) and len(sizes) == len(lengths):
            ok = all(l == v for l, v in zip(lengths, valid)) if t.is_nested else all(
                l >= v for l, v in zip(lengths, valid))
        return {"shape": shape, "lengths": lengths, "dtype": str(t.dtype).replace("torch.", ""),
                "device": str(t.device), "valid_len": valid, "length_ok": ok}

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> "TraceRecorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _pick(spec: str | Mapping[str, str], name: str) -> str:
    if isinstance(spec, Mapping):
        return str(spec.get(name, spec.get("*", "")))
    return str(spec)


def _first(tags: list[dict], key: str) -> Any:
    for t in tags:
        if t.get(key) is not None:
            return t[key]
    return None


def read_trace(paths: str | Path | Sequence[str | Path]) -> list[dict[str, Any]]:
    """The rows of one or more trace JSONL files (e.g. one per rank), in file order."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    out = []
    for p in map(Path, paths):
        if not p.exists():
            raise TraceError(f"no trace file at {p}")
        with open(p, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{p}:{lineno}: not JSON: {exc}") from exc
                if not isinstance(rec, dict) or "stage" not in rec or "field" not in rec:
                    raise TraceError(f"{p}:{lineno}: expected a trace row with 'stage' and 'field', got {line[:80]!r}")
                out.append(rec)
    return out
