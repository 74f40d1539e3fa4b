"""Checkpoints of a run: ``run_dir/checkpoints/step_N`` written atomically (every rank done, then renamed), and
resume from a named folder or the newest one that loads."""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from backends.comm import allreduce_counts
from protocol.config import to_plain
from rldispatch.config import ConfigError, RunConfig
from rldispatch.launch import DistContext
from rldispatch.run_dir import RUN_RECORD, check_resume_config, checkpoint_candidates, write_run_record

__all__ = ["Checkpoints", "Resumed"]

logger = logging.getLogger(__name__)


@dataclass
class Resumed:
    """What a resumed run continues from."""

    step: int
    path: Path
    extra: dict[str, Any] = field(default_factory=dict)  # the actor's extra state (kl_coef, schedule, config)
    changes: list = field(default_factory=list)  # (key, old, new) of the config keys changed since the save


class Checkpoints:
    """``run_dir/checkpoints/step_N``: the actor's engine state with the run's extra state, the critic's beside it,
    and the run record; ``latest`` names the newest complete one."""

    def __init__(self, cfg: RunConfig, ctx: DistContext, run_dir: Path):
        self.cfg, self.ctx, self.run_dir = cfg, ctx, run_dir

    def folder(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{step}"

    def resume(self, engine: Any, critic: Any) -> Resumed | None:
        """``trainer.resume``: a folder, or ``auto`` = the newest checkpoint that loads (each skipped one is named
        with its reason). The saved config is compared first: model, layout and data-order changes are refused."""
        mode = self.cfg.trainer.resume
        if mode == "never":
            return None
        if mode == "auto":
            candidates = checkpoint_candidates(self.run_dir / "checkpoints")
            if not candidates:
                if self.ctx.is_main:
                    logger.info("trainer.resume=auto: no checkpoint under %s; starting fresh", self.run_dir)
                return None
        else:
            if not Path(mode).is_dir():
                raise ConfigError(f"trainer.resume={mode!r}: checkpoint folder {mode} does not exist; give a "
                                  "checkpoint folder (run_dir/checkpoints/step_N), auto or never")
            candidates = [Path(mode)]
        skipped = []
        for path in candidates:
            record = path / RUN_RECORD
            if record.is_file():  # refused changes raise (a config error is not a damaged checkpoint)
                changes = check_resume_config(json.loads(record.read_text()), to_plain(self.cfg), str(path))
            else:
                changes = []
            try:
                extra = engine.load_checkpoint(str(path))
                if critic is not None:
                    critic.load(path, int(extra["step"]))
                error = ""
            except Exception as exc:  # a damaged or partial checkpoint: say why, try the previous one
                extra, error = {}, f"{type(exc).__name__}: {exc}"
            failed = allreduce_counts([1.0 if error else 0.0], device=self.ctx.device)[0]
            if not failed:
                break
            skipped.append((path, error or "another rank could not load it"))
            if mode != "auto":
                raise RuntimeError(f"trainer.resume={mode!r}: cannot load the checkpoint: {skipped[-1][1]}")
            logger.warning("trainer.resume=auto: skipping checkpoint %s (%s)", path, skipped[-1][1])
        else:
            raise RuntimeError("trainer.resume=auto: no checkpoint under " f"{self.run_dir / 'checkpoints'} loads: "
                               + "; ".join(f"{p.name}: {why}" for p, why in skipped)
                               + ". Set trainer.resume=never with trainer.run_dir_exists=overwrite to start over")
        if not (path / RUN_RECORD).is_file() and "config" in extra:  # a checkpoint from before run.json
            changes = check_resume_config({"config": extra["config"]}, to_plain(self.cfg), str(path))
        return Resumed(int(extra["step"]), path, extra, changes)

    def save(self, step: int, engine: Any, critic: Any, extra: dict[str, Any]) -> None:
        """Write into ``step_N.partial`` and rename when every rank is done; ``latest`` names it only then, so a
        killed save leaves the previous checkpoint as the newest intact one."""
        path = self.folder(step)
        partial = path.with_name(path.name + ".partial")
        if self.ctx.is_main and partial.exists():
            shutil.rmtree(partial)  # a killed save's leftovers
        dist.barrier()
        engine.save_checkpoint(str(partial), extra_state={"step": step, **extra, "config": to_plain(self.cfg)})
        if critic is not None:
            critic.save(partial, step)
        dist.barrier()
        if self.ctx.is_main:
            write_run_record(partial, step, to_plain(self.cfg))
            if path.exists():
                shutil.rmtree(path)
            os.replace(partial, path)
            marker = self.run_dir / "checkpoints" / "latest"
            marker.with_suffix(".tmp").write_text(path.name)
            os.replace(marker.with_suffix(".tmp"), marker)
        dist.barrier()
