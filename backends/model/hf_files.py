"""The tensors of a Hugging Face checkpoint folder's safetensors files, read one tensor (or row range) at a time.

A checkpoint is either one ``model.safetensors`` or several shards listed by ``model.safetensors.index.json``
(``{"weight_map": {name: file}}``). :class:`SafetensorsFolder` maps every tensor name to its file and reads
only what is asked for, so a rank that holds 1/N of a parameter never materialises the rest of it.

Example::

    folder = SafetensorsFolder("/ckpt/Qwen2.5-0.5B")
    rows = folder.read_rows("model.embed_tokens.weight", 0, 1024)   # the first 1024 rows only
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch

__all__ = ["SafetensorsFolder", "WeightFileError", "INDEX_FILE"]

INDEX_FILE = "model.safetensors.index.json"


class WeightFileError(ValueError):
    """A checkpoint folder without safetensors files, an index naming a missing file, or an unknown tensor."""


class SafetensorsFolder:
    """Name -> file map of a folder's safetensors tensors (index.json when present, else every ``*.safetensors``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise WeightFileError(f"model.hf_path={self.path!r} is not a directory")
        index = os.path.join(self.path, INDEX_FILE)
        self.files: dict[str, str] = {}
        if os.path.isfile(index):
            with open(index) as fh:
                weight_map = json.load(fh).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise WeightFileError(f"{index} has no 'weight_map' of tensor name -> file")
            missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(self.path, f))})
            if missing:
                raise WeightFileError(f"{index} names shard files that are not in the folder: {missing[:4]}")
            self.files = {name: os.path.join(self.path, f) for name, f in weight_map.items()}
        else:
            shards = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
            if not shards:
                raise WeightFileError(f"{self.path} has no *.safetensors weight files (and no {INDEX_FILE})")
            from safetensors import safe_open

            for f in shards:
                with safe_open(os.path.join(self.path, f), framework="pt") as fh:
                    for name in fh.keys():
                        if name in self.files:
                            raise WeightFileError(f"tensor {name!r} is in both {self.files[name]} and {f}")
                        self.files[name] = os.path.join(self.path, f)

    def names(self) -> list[str]:
        """Every tensor name of the checkpoint, sorted."""
        return sorted(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _file(self, name: str) -> str:
        if name not in self.files:
            raise WeightFileError(f"tensor {name!r} is not in the checkpoint at {self.path} "
                                  f"({len(self.files)} tensors, e.g. {self.names()[:3]})")
        return self.files[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name`` (read from the file header, no data)."""
        from safetensors import safe_open

        with safe_open(self._file(name), framework="pt") as fh:
            return tuple(fh.get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``."""
        from safetensors import safe_open

        with safe_open(self._file(name), framework="pt") as fh:
            return fh.get_tensor(name)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` along dim 0 of ``name``; only those bytes are read."""
        from safetensors import safe_open

        with safe_open(self._file(name), framework="pt") as fh:
            sl = fh.get_slice(name)
            rows = sl.get_shape()[0] if sl.get_shape() else 0
            if not 0 <= start <= stop <= rows:
                raise WeightFileError(f"rows [{start}, {stop}) of {name!r} are outside its {rows} rows")
            return sl[start:stop]

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every tensor, one at a time, file by file."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for name, f in self.files.items():
            by_file.setdefault(f, []).append(name)
        for f in sorted(by_file):
            with safe_open(f, framework="pt") as fh:
                for name in sorted(by_file[f]):
                    yield name, fh.get_tensor(name)
