"""Prompt datasets: read parquet / json / jsonl rows, filter over-long prompts, collate, and a resumable sampler.

The reference system's row format is read as it is: the message list in the ``prompt`` column (``prompt_key``;
a file without it may use ``raw_prompt``), ``data_source``, ``reward_model = {"style", "ground_truth"}``,
``extra_info`` and any other column. A row as :class:`RLHFDataset` returns it (no final tokenization: the rollout
applies the chat template)::

    {"raw_prompt": [{"role": "user", "content": "..."}, ...],   # the message list
     "data_source": "openai/gsm8k",                             # routes the reward
     "reward_model": {"style": "rule", "ground_truth": "7"},   # as in the file
     "extra_info": {"index": 7, "tools_kwargs": {}, "interaction_kwargs": {}, ...the file's extra_info...},
     "multi_modal_data": {...},                                 # only when the file has images / videos
     ...every other column as it is (e.g. ability)}

Every row is checked at load time, before any step: the prompt column's shape and, given ``needs_ground_truth``
(the reward's view of each ``data_source``), that the data source has a scorer and a ground truth where the scorer
needs one. Errors name the file, the row and the column.

File formats: ``.parquet``; ``.json`` holding a list of row objects; ``.jsonl`` with one row object per line
(blank lines skipped), both UTF-8; a folder written by Hugging Face ``datasets``' ``save_to_disk`` (needs the
``datasets`` package). Several files (mixed formats too) are read in the order given.
"""
from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable

import numpy as np
import torch

from protocol.rollout.images import ImageError

__all__ = ["DatasetError", "RLHFDataset", "read_rows", "ground_truth_of", "collate_rows", "PromptSampler",
           "PromptLoader"]

logger = logging.getLogger(__name__)

_MM_COLUMNS = {"images": "image", "videos": "video", "audios": "audio"}
_FALLBACK_PROMPT_KEY = "raw_prompt"  # this project's earlier column name, read when the prompt_key column is absent


class DatasetError(ValueError):
    """A data file or row that cannot be used; the message names the file and the row."""


def _utf8(path: str, raw: bytes, first_line: int = 1) -> str:
    """``raw`` decoded as UTF-8; a bad byte is an error naming the file, line and byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + raw.count(b"\n", 0, exc.start)
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DatasetError(f"{path}: line {line} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {col}); "
                           f"json / jsonl data files must be UTF-8 encoded") from None


def _read_json(path: str) -> list[tuple[str, Any]]:
    with open(path, "rb") as f:
        text = _utf8(path, f.read())
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); a .json "
                           f"data file must hold a list of row objects (use .jsonl for one row per line)") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a .json data file must hold a list of row objects, got {type(data).__name__}")
    return [(f"row {i}", row) for i, row in enumerate(data)]


def _read_jsonl(path: str) -> list[tuple[str, Any]]:
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _utf8(path, raw, lineno)
            if not line.strip():
                continue
            try:
                out.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: line {lineno} is not valid JSON ({exc.msg} at column {exc.colno})"
                                   ) from None
    return out


def _read_parquet(path: str) -> list[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DatasetError(f"{path}: cannot read as parquet: {type(exc).__name__}: {exc}") from None
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist())]


def _is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, "dataset_info.json"))
                                    or os.path.isfile(os.path.join(path, "state.json")))


def _read_hf_folder(path: str) -> list[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{path}: a Hugging Face datasets folder (save_to_disk) needs the 'datasets' package; "
                           f"install it or convert the folder to parquet") from None
    try:
        ds = datasets.load_from_disk(path)
    except Exception as exc:  # datasets raises several types for unreadable folders
        raise DatasetError(f"{path}: cannot read as a datasets folder: {type(exc).__name__}: {exc}") from None
    if isinstance(ds, datasets.DatasetDict):
        raise DatasetError(f"{path}: holds a DatasetDict with splits {sorted(ds)}; give the folder of one split "
                           f"(e.g. {path}/{sorted(ds)[0]})")
    return [(f"row {i}", row) for i, row in enumerate(ds)]


_READERS: dict[str, Callable[[str], list[tuple[str, Any]]]] = {
    ".parquet": _read_parquet, ".json": _read_json, ".jsonl": _read_jsonl,
}


def read_rows(files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[tuple[str, str, Any]]:
    """``(file, position, row)`` for every row of ``files`` in order (position: ``row i`` or ``line n``)."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    files = [os.fspath(f) for f in files]
    if not files:
        raise DatasetError("no data files given (data.train_files / data.val_files is empty)")
    out = []
    for path in files:
        if _is_hf_folder(path):
            out.extend((path, pos, row) for pos, row in _read_hf_folder(path))
            continue
        ext = os.path.splitext(path)[1].lower()
        if ext not in _READERS:
            raise DatasetError(f"{path}: unsupported data file extension {ext!r}; expected one of {sorted(_READERS)} "
                               f"or a datasets save_to_disk folder")
        if not os.path.isfile(path):
            raise DatasetError(f"{path}: data file not found")
        out.extend((path, pos, row) for pos, row in _READERS[ext](path))
    return out


def ground_truth_of(row: Mapping[str, Any]) -> Any:
    """``row["reward_model"]["ground_truth"]``, where the reference system's rows keep it; None when absent."""
    rm = row.get("reward_model")
    return rm.get("ground_truth") if isinstance(rm, Mapping) else None


def _check_messages(messages: Any, where: str, prompt_key: str) -> list[dict]:
    if isinstance(messages, np.ndarray):
        messages = messages.tolist()
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DatasetError(f"{where}: {prompt_key!r} must be a non-empty list of messages "
                           f"({{'role': ..., 'content': ...}}), got {type(messages).__name__} {messages!r:.60}")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise DatasetError(f"{where}: {prompt_key}[{j}] must be a message dict, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise DatasetError(f"{where}: {prompt_key}[{j}] needs a string 'role', got {m.get('role')!r}")
        content = m.get("content")
        if not isinstance(content, (str, list, tuple)):
            raise DatasetError(f"{where}: {prompt_key}[{j}] ({m['role']}) needs 'content' as a string or a list of "
                               f"parts, got {type(content).__name__}")
        out.append(dict(m))
    return out


class RLHFDataset:
    """Prompt rows from parquet / json / jsonl files; prompts longer than ``max_prompt_length`` are filtered.

    The length of a prompt is ``len(tokenizer.apply_chat_template(raw_prompt, add_generation_prompt=True))``.
    The filtered count is logged and kept in ``num_filtered`` (their file positions in ``filtered``).
    Malformed rows raise :class:`DatasetError` naming the file and row.

    Args:
        files: one path or a list (formats may be mixed).
        tokenizer: anything with ``apply_chat_template`` (see :mod:`protocol.rollout.tokenizer`).
        max_prompt_length: the longest prompt kept, in tokens.
        prompt_key: the column holding the message list (returned as ``raw_prompt``); a file without that
            column may hold it as ``raw_prompt``.
        filter_overlong_prompts: when False, an over-long prompt is an error instead of being filtered.
        default_data_source: used for rows without ``data_source`` (None: such a row is an error).
        max_samples: keep only the first ``max_samples`` rows after filtering (None: all).
        needs_ground_truth: ``data_source -> bool`` (the reward's view: whether its scorer needs a ground truth;
            raises ValueError / KeyError for a data source without a scorer). None: data sources are not checked
            (a custom reward function scores every row).
        processor: a :class:`~protocol.rollout.images.VisionProcessor` (a vision-language policy): every row's
            images are opened and processed at load (a missing or unreadable one is an error naming the file and
            row), its ``<image>`` placeholders must match them, and its length counts the image tokens; a row
            then comes with ``prompt_ids`` and ``multi_modal_inputs`` (``pixel_values``, ``image_grid_thw``).
    """

    def __init__(self, files: str | Sequence[str], tokenizer: Any, max_prompt_length: int,
                 prompt_key: str = "prompt", filter_overlong_prompts: bool = True,
                 default_data_source: str | None = None, max_samples: int | None = None,
                 needs_ground_truth: Callable[[str], bool] | None = None, processor: Any = None) -> None:
        if isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, int) or max_prompt_length < 1:
            raise DatasetError(f"data.max_prompt_length must be a positive int, got {max_prompt_length!r}")
        if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int)
                                        or max_samples < 1):
            raise DatasetError(f"data.max_samples must be a positive int or None, got {max_samples!r}")
        if not hasattr(tokenizer, "apply_chat_template"):
            raise TypeError(f"RLHFDataset needs a tokenizer with apply_chat_template, got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        if not isinstance(prompt_key, str) or not prompt_key:
            raise DatasetError(f"data.prompt_key must name a column, got {prompt_key!r}")
        self.prompt_key = prompt_key
        self.needs_ground_truth = needs_ground_truth
        self.processor = processor
        self._needs: dict[str, bool] = {}
        self.rows: list[dict] = []
        self.prompt_lengths: list[int] = []
        self.filtered: list[tuple[str, str, int]] = []
        for global_index, (path, pos, raw) in enumerate(read_rows(files)):
            where = f"{path}: {pos}"
            row, column = self._normalize(raw, where, global_index, default_data_source)
            try:
                if processor is not None:
                    length = len(self._process(row, where)[0])
                else:
                    length = len(tokenizer.apply_chat_template(row["raw_prompt"], add_generation_prompt=True))
            except ImageError as exc:  # it names the file and row already
                raise DatasetError(str(exc)) from None
            except (ValueError, TypeError, KeyError) as exc:
                raise DatasetError(f"{where}: the chat template rejects column {column!r}: {exc}") from None
            if length > max_prompt_length:
                if not filter_overlong_prompts:
                    raise DatasetError(f"{where}: prompt has {length} tokens > data.max_prompt_length="
                                       f"{max_prompt_length} (set data.filter_overlong_prompts=true to drop such rows)")
                self.filtered.append((path, pos, length))
                continue
            self.rows.append(row)
            self.prompt_lengths.append(length)
        if max_samples is not None:
            self.rows, self.prompt_lengths = self.rows[:max_samples], self.prompt_lengths[:max_samples]
        if self.filtered:
            logger.info("RLHFDataset: filtered %d of %d prompts longer than max_prompt_length=%d tokens",
                        len(self.filtered), len(self.filtered) + len(self.rows), max_prompt_length)
        if not self.rows and self.filtered:
            raise DatasetError(f"no rows left in {files!r}: all {len(self.filtered)} prompts are longer than "
                               f"data.max_prompt_length={max_prompt_length} (the shortest has "
                               f"{min(n for _, _, n in self.filtered)} tokens)")
        if not self.rows:
            raise DatasetError(f"no rows in {files!r}")

    @property
    def num_filtered(self) -> int:
        """How many rows were dropped as longer than ``max_prompt_length``."""
        return len(self.filtered)

    def _normalize(self, raw: Any, where: str, global_index: int,
                   default_data_source: str | None) -> tuple[dict, str]:
        """The row as returned by ``__getitem__``, and the column its messages came from."""
        if not isinstance(raw, Mapping):
            raise DatasetError(f"{where}: a row must be an object/dict, got {type(raw).__name__}")
        column = self.prompt_key
        if column not in raw and _FALLBACK_PROMPT_KEY in raw:
            column = _FALLBACK_PROMPT_KEY
        if column not in raw:
            raise DatasetError(f"{where}: missing the prompt column {self.prompt_key!r} (columns: {sorted(raw)}); "
                               f"set data.prompt_key to the column holding the message list")
        row = {k: v for k, v in raw.items() if k != column}
        row["raw_prompt"] = _check_messages(raw[column], where, column)
        source = raw.get("data_source", default_data_source)
        if not isinstance(source, str) or not source:
            raise DatasetError(f"{where}: column 'data_source' must be a non-empty string, got {source!r}"
                               + ("" if "data_source" in raw else " (set a default_data_source to allow rows "
                                  "without one)"))
        row["data_source"] = source
        self._check_reward_columns(raw, source, where)
        extra = raw.get("extra_info")
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise DatasetError(f"{where}: column 'extra_info' must be an object/dict, got {type(extra).__name__}")
        extra = dict(extra)
        extra.setdefault("index", global_index)
        for name in ("tools_kwargs", "interaction_kwargs"):
            value = extra.get(name)
            if value is None:
                extra[name] = {}
            elif not isinstance(value, Mapping):
                raise DatasetError(f"{where}: extra_info.{name} must be an object/dict, got {type(value).__name__}")
        row["extra_info"] = extra
        mm = dict(raw.get("multi_modal_data") or {})
        for mm_column, kind in _MM_COLUMNS.items():
            if raw.get(mm_column) is not None:
                mm[kind] = row.pop(mm_column)
        if mm:
            row["multi_modal_data"] = mm
        return row, column

    def _check_reward_columns(self, raw: Mapping[str, Any], source: str, where: str) -> None:
        """A scorer for ``data_source`` and, where it compares against one, ``reward_model.ground_truth``."""
        rm = raw.get("reward_model")
        if rm is not None and not isinstance(rm, Mapping):
            raise DatasetError(f"{where}: column 'reward_model' must be an object/dict "
                               f"({{'style': 'rule', 'ground_truth': ...}}), got {type(rm).__name__} {rm!r:.60}")
        if self.needs_ground_truth is None:
            return
        if source not in self._needs:
            try:
                self._needs[source] = bool(self.needs_ground_truth(source))
            except (ValueError, KeyError) as exc:
                raise DatasetError(f"{where}: column 'data_source': {exc}") from None
        if self._needs[source] and ground_truth_of(raw) is None:
            found = "no column 'reward_model'" if rm is None else f"reward_model={dict(rm)!r:.80}"
            raise DatasetError(f"{where}: column 'reward_model.ground_truth' is missing ({found}); the scorer of "
                               f"data_source {source!r} compares the response against it")

    def _process(self, row: Mapping[str, Any], where: str) -> tuple[list[int], dict[str, Any]]:
        """A vision-language row's prompt ids and processed images (its ``multi_modal_data`` images opened)."""
        from protocol.rollout.images import open_images

        images = open_images((row.get("multi_modal_data") or {}).get("image"), where)
        return self.processor(row["raw_prompt"], images, where)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        """A copy of row ``index`` (message list, data_source, extra_info, optional multi_modal_data, ...)."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"RLHFDataset index must be an int, got {type(index).__name__}")
        if not -len(self.rows) <= index < len(self.rows):
            raise IndexError(f"RLHFDataset index {index} out of range for {len(self.rows)} rows")
        row = copy.deepcopy(self.rows[int(index)])
        if self.processor is not None:  # processed again here: the pixels are not kept for every row at load
            row["prompt_ids"], row["multi_modal_inputs"] = self._process(row, f"row {index}")
        return row


def collate_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Batch rows: tensor columns stacked along dim 0, every other column a 1-D numpy object array.

    All rows must have the same columns; a column missing from a row is an error naming it.
    """
    rows = list(rows)
    if not rows:
        raise DatasetError("collate_rows: got no rows")
    names = list(rows[0])
    for i, r in enumerate(rows):
        if set(r) != set(names):
            missing, extra = sorted(set(names) - set(r)), sorted(set(r) - set(names))
            raise DatasetError(f"collate_rows: row {i} has different columns than row 0 (missing {missing}, "
                               f"extra {extra})")
    out: dict[str, Any] = {}
    for name in names:
        values = [r[name] for r in rows]
        if all(isinstance(v, torch.Tensor) for v in values):
            out[name] = torch.stack(values)
        else:
            arr = np.empty(len(values), dtype=object)
            for i, v in enumerate(values):
                arr[i] = v
            out[name] = arr
    return out


@dataclass
class PromptSampler:
    """Batches of dataset indices in a per-epoch order fixed by ``seed``; resumable through ``state_dict``.

    Epoch ``e`` uses the permutation ``numpy.random.default_rng([seed, e]).permutation(num_samples)`` (or
    ``0..n-1`` without shuffle). ``drop_last`` drops the incomplete final batch of an epoch. :meth:`next_batch`
    never ends (it moves on to the next epoch). After ``load_state_dict(s.state_dict())`` the batches equal those
    the saved sampler would have produced.
    """

    num_samples: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = True

    def __post_init__(self) -> None:
        for name in ("num_samples", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DatasetError(f"PromptSampler.{name} must be a positive int, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise DatasetError(f"PromptSampler.seed must be a non-negative int, got {self.seed!r}")
        if self.drop_last and self.batch_size > self.num_samples:
            raise DatasetError(f"data batch size {self.batch_size} exceeds the dataset size {self.num_samples} with "
                               f"drop_last=True: no batch could ever be formed")
        self.epoch = 0
        self.position = 0  # batches consumed in the current epoch
        self._order: np.ndarray | None = None

    @property
    def batches_per_epoch(self) -> int:
        """Batches in one epoch (the incomplete last one counts only without ``drop_last``)."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The index order of ``epoch``."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def next_batch(self) -> list[int]:
        """The next batch of indices (moving to the next epoch when this one is used up)."""
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
            self._order = None
        if self._order is None:
            self._order = self.epoch_order(self.epoch)
        start = self.position * self.batch_size
        batch = self._order[start:start + self.batch_size].tolist()
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        """The remaining batches of the current epoch."""
        while self.position < self.batches_per_epoch:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int | bool]:
        """JSON-able position (epoch, batches consumed) plus the settings that fix the order."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_samples": self.num_samples,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`; a state from a different seed, dataset size or batch size is refused."""
        for name in ("seed", "num_samples", "batch_size", "shuffle", "drop_last"):
            if name in state and state[name] != getattr(self, name):
                raise DatasetError(f"sampler state has {name}={state[name]!r} but this sampler has "
                                   f"{name}={getattr(self, name)!r}; resuming would change the data order")
        epoch, position = state.get("epoch"), state.get("position")
        for name, value in (("epoch", epoch), ("position", position)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise DatasetError(f"sampler state {name} must be a non-negative int, got {value!r}")
        if position > self.batches_per_epoch:
            raise DatasetError(f"sampler state position {position} exceeds {self.batches_per_epoch} batches per epoch")
        self.epoch, self.position, self._order = epoch, position, None


class PromptLoader:
    """Collated batches of a dataset in :class:`PromptSampler` order; ``state_dict`` resumes the order exactly."""

    def __init__(self, dataset: Any, batch_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True,
                 collate_fn: Callable[[list], Any] = collate_rows) -> None:
        self.dataset = dataset
        self.sampler = PromptSampler(len(dataset), batch_size, seed, shuffle, drop_last)
        self.collate_fn = collate_fn

    def __len__(self) -> int:
        return self.sampler.batches_per_epoch

    def next_batch(self) -> Any:
        """The next collated batch (never ends; epochs roll over)."""
        return self.collate_fn([self.dataset[i] for i in self.sampler.next_batch()])

    def __iter__(self) -> Iterator[Any]:
        """The remaining batches of the current epoch."""
        for idx in self.sampler:
            yield self.collate_fn([self.dataset[i] for i in idx])

    @property
    def epoch(self) -> int:
        """The current epoch of the sampler."""
        return self.sampler.epoch

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state (see :meth:`PromptSampler.state_dict`)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the sampler (see :meth:`PromptSampler.load_state_dict`)."""
        self.sampler.load_state_dict(state)
