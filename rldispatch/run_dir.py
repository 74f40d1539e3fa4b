"""A run directory's ownership and its checkpoints: refuse another run's folder, find the checkpoints to resume
from (newest first), and compare a checkpoint's saved config with the resuming one.

A checkpoint folder ``step_N`` exists only once every rank finished writing it (saves go to ``step_N.partial`` and
are renamed), and holds ``run.json``: the step, the backend and the config that wrote it.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

from protocol.config import ConfigError, to_plain

__all__ = ["RUN_RECORD", "claim_run_dir", "checkpoint_candidates", "check_resume_config", "write_run_record",
           "flatten", "REFUSED_ON_RESUME"]

logger = logging.getLogger(__name__)

RUN_RECORD = "run.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")

# keys a resumed run may not change: the model, the backend and its layout (the saved shards), the data order
REFUSED_ON_RESUME = ("model.", "actor.backend", "actor.fsdp.", "actor.megatron.", "data.train_files",
                     "data.shuffle", "data.train_batch_size", "data.tokenizer", "data.prompt_key",
                     "data.max_prompt_length", "data.filter_overlong_prompts", "data.task", "data.train_size",
                     "trainer.seed", "actor.lora.")
# inside a refused section, but changes no saved state
_LAYOUT_FREE = ("actor.fsdp.activation_checkpointing", "actor.lora.dropout")
_NOT_SETTINGS = ("trainer.resume", "trainer.run_dir_exists", "trainer.progress_bar", "trainer.run_dir",
                 "trainer.gc_interval")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists are values)."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}{k}."))
    return out


def _previous_run(run_dir: Path) -> list[str]:
    """What in ``run_dir`` belongs to a run: metrics records and checkpoint folders (empty: the folder is free)."""
    found = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        n = sum(1 for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip())
        found.append(f"metrics.jsonl with {n} records")
    ckpt = run_dir / "checkpoints"
    if ckpt.is_dir():
        names = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
        if names:
            found.append("checkpoints " + ", ".join(names))
    return found


def claim_run_dir(run_dir: Path, trainer: Any, is_main: bool) -> None:
    """Refuse a run dir that holds another run unless the run continues it (``trainer.resume`` is not never) or
    ``trainer.run_dir_exists=overwrite`` (then rank 0 deletes the old metrics, checkpoints and config)."""
    found = _previous_run(run_dir)
    if not found or trainer.resume != "never":
        return
    if trainer.run_dir_exists == "overwrite":
        if is_main:
            logger.warning("trainer.run_dir_exists=overwrite: deleting the previous run in %s (%s)", run_dir,
                           "; ".join(found))
            for name in ("metrics.jsonl", "config.json"):
                (run_dir / name).unlink(missing_ok=True)
            for name in ("checkpoints", "tb"):
                shutil.rmtree(run_dir / name, ignore_errors=True)
        return
    raise ConfigError(
        f"trainer.run_dir={str(run_dir)!r} already holds a run ({'; '.join(found)}); set trainer.resume=auto to "
        "continue it, trainer.run_dir_exists=overwrite to replace it, or choose another trainer.run_dir")


def checkpoint_candidates(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoint folders ``step_N``, newest first; unfinished saves (``*.partial``) are named and left."""
    if not ckpt_dir.is_dir():
        return []
    steps = []
    for p in ckpt_dir.iterdir():
        m = _STEP_DIR.match(p.name)
        if p.is_dir() and m:
            steps.append((int(m.group(1)), p))
        elif p.is_dir() and p.name.endswith(".partial"):
            logger.warning("skipping %s: an unfinished save (the process was stopped while writing it)", p)
    return [p for _, p in sorted(steps, reverse=True)]


def write_run_record(path: Path, step: int, config: dict) -> None:
    """``run.json`` of a checkpoint: step, backend and the config that wrote it."""
    record = {"step": int(step), "backend": config.get("actor", {}).get("backend"), "config": config}
    (Path(path) / RUN_RECORD).write_text(json.dumps(record, indent=1))


def check_resume_config(record: dict, current: dict, where: str) -> list[tuple[str, Any, Any]]:
    """Compare a checkpoint's saved config with the resuming one: a change to a key of :data:`REFUSED_ON_RESUME`
    is a :class:`ConfigError`; the other changes are returned as (key, saved, now) to be applied and logged."""
    saved_cfg = record.get("config") or {}
    saved_backend = saved_cfg.get("actor", {}).get("backend")
    now_backend = current.get("actor", {}).get("backend")
    if saved_backend and saved_backend != now_backend:
        raise ConfigError(f"checkpoint {where} was written by the {saved_backend} backend and this run uses "
                          f"actor.backend={now_backend}; a checkpoint resumes on the backend that wrote it (convert "
                          "it with `rldispatch export` and start a new run from model.hf_path)")
    old, new = flatten(saved_cfg), flatten(current)
    from backends.config import LoraConfig

    # a config without actor.lora (written before it existed) is a run without adapters
    for key, value in flatten({"actor": {"lora": to_plain(LoraConfig())}}).items():
        old.setdefault(key, value)
        new.setdefault(key, value)
    refused, applied = [], []
    for key in sorted(set(old) | set(new)):
        if key in _NOT_SETTINGS or old.get(key) == new.get(key):
            continue
        entry = (key, old.get(key), new.get(key))
        if key.startswith(REFUSED_ON_RESUME) and key not in _LAYOUT_FREE:
            refused.append(entry)
        else:
            applied.append(entry)
    if refused:
        raise ConfigError(
            f"resuming from {where}: " + ", ".join(f"{k} was {a!r}, now {b!r}" for k, a, b in refused)
            + "; the model, the backend layout and the data order cannot change on resume. Restore these keys, "
            "or start a new run (another trainer.run_dir, or trainer.resume=never with trainer.run_dir_exists="
            "overwrite)")
    return applied
