"""A run's life around its steps: the entry point every rank runs and the fit loop (validation, metrics,
checkpoints, signals). Checkpoint save and resume are :mod:`rldispatch.checkpoints`."""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from protocol.config import to_plain
from rldispatch.collectives import gather_objects
from rldispatch.config import RunConfig
from rldispatch.launch import DistContext, die_with_parent, init_distributed
from rldispatch.summary import RunSummary

__all__ = ["run", "fit", "check_update", "NonFiniteUpdateError", "SIGNAL_EXIT"]

logger = logging.getLogger(__name__)
#: the exit code of a run stopped by each signal (after its checkpoint)
SIGNAL_EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}


class NonFiniteUpdateError(RuntimeError):
    """An update left a non-finite weight or loss and ``trainer.on_nonfinite=stop``."""


def run(cfg: RunConfig) -> int:
    """Every rank's entry point (``rldispatch train``): set up the process group, train (or, on a separate_async
    rollout rank, generate), tear down; returns the exit code."""
    from rldispatch.grpo import GRPOTrainer
    from rldispatch.schedules import schedule_class

    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    die_with_parent()
    split = None
    if schedule_class(cfg.trainer.mode).splits_world:  # the last ranks generate, the others train
        from rldispatch.separate.transport import split_world

        split = split_world(cfg)
        ctx = DistContext(dist.get_rank(), dist.get_world_size(), split.device, link=split)
    else:
        ctx = init_distributed(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    torch.manual_seed(cfg.trainer.seed)
    try:
        if split is not None and split.role == "rollout":
            from rldispatch.separate.rollout_rank import RolloutRank

            return RolloutRank(cfg, split).serve()
        return fit(GRPOTrainer(cfg, ctx))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---- the fit loop -------------------------------------------------------------------------------------------------
class _Signals:
    """SIGTERM (a scheduler's preemption) and SIGINT are noted and acted on at the next step boundary; a second
    one ends the process at once."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in SIGNAL_EXIT:
            signal.signal(signum, self._note)

    def _note(self, signum: int, _frame) -> None:
        if self.seen:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.seen.append(signum)

    def agreed(self, device: torch.device) -> int:
        """The signal any rank has received (every rank agrees, so all stop at the same step), or 0; one small
        gather, not an all-reduce."""
        return max(gather_objects(self.seen[0] if self.seen else 0, device=device))


def fit(trainer: Any) -> int:
    """Train to ``trainer.total_steps`` (or to the step boundary after SIGTERM/SIGINT); returns the exit code."""
    cfg, ctx = trainer.cfg, trainer.ctx
    signals = _Signals()
    bar = None
    if ctx.is_main and cfg.trainer.progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=cfg.trainer.total_steps, initial=trainer.step, desc="grpo", dynamic_ncols=True)
    if ctx.is_main:
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        (trainer.run_dir / "config.json").write_text(json.dumps(to_plain(cfg), indent=2))
    started = time.perf_counter()
    summary = RunSummary(start_step=trainer.step)
    with trainer.where("validate", trainer.step):
        pending_val = trainer.timed_validate() if trainer.step == 0 else {}
    summary.record(trainer.step, pending_val)
    trainer.gc.start()
    try:
        trainer.schedule.begin(trainer.step)
        code = _loop(trainer, signals, summary, started, pending_val, bar)
    finally:
        trainer.gc.stop()
        try:
            trainer.schedule.end()
        finally:
            trainer.rollout.close()
            if trainer.judge is not None:
                trainer.judge.close()
    if ctx.is_main:
        print(summary.text(trainer.step, cfg.trainer.total_steps, time.perf_counter() - started, trainer.run_dir,
                           trainer.metrics.path, code), flush=True)
    return code


def _loop(trainer: Any, signals: _Signals, summary: RunSummary, started: float, pending_val: dict[str, float],
          bar: Any) -> int:
    cfg = trainer.cfg
    code = 0
    while trainer.step < cfg.trainer.total_steps:
        metrics = {**pending_val, **trainer.train_step()}
        pending_val = {}
        check_update(cfg, trainer.step, metrics, trainer.ctx.is_main)
        trainer.step += 1
        last = trainer.step == cfg.trainer.total_steps
        if cfg.trainer.val_freq and trainer.step % cfg.trainer.val_freq == 0 or last:
            with trainer.where("validate", trainer.step):
                metrics.update(trainer.timed_validate())
            summary.record(trainer.step, metrics)
        metrics["progress/elapsed_s"] = time.perf_counter() - started
        trainer.metrics.log(trainer.step, metrics)
        signum = signals.agreed(trainer.ctx.device)
        if (cfg.trainer.save_freq and trainer.step % cfg.trainer.save_freq == 0) or last or \
                (signum and cfg.trainer.save_on_signal):
            with trainer.where("checkpoint", trainer.step):
                trainer.save_checkpoint()
        if signum:
            logger.warning("rank %d: %s received; %s at step %d, exiting", trainer.ctx.rank,
                           signal.Signals(signum).name,
                           "checkpoint saved" if cfg.trainer.save_on_signal else "no checkpoint "
                           "(trainer.save_on_signal=false)", trainer.step)
            code = SIGNAL_EXIT.get(signum, 128 + signum)
            break
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{metrics.get('reward/score/mean', float('nan')):.3f}",
                            s_per_step=f"{metrics['timing_s/step']:.1f}")
    if bar is not None:
        bar.close()
    trainer.metrics.close()
    trainer.trace.close()
    return code


def check_update(cfg: RunConfig, step: int, metrics: dict[str, float], is_main: bool) -> None:
    """A non-finite update was rolled back by the engine (``on_nonfinite=skip``: said and counted) or stops the run
    (``stop``)."""
    for model, loss in (("actor", "loss"), ("critic", "vf_loss")):
        bad = metrics.get(f"{model}/nonfinite", 0.0)
        if not bad:
            continue
        detail = ", ".join(f"{k}={metrics.get(k)}" for k in (f"{model}/{loss}", f"{model}/grad_norm",
                                                              f"{model}/lr"))
        if cfg.trainer.on_nonfinite == "stop":
            raise NonFiniteUpdateError(
                f"step {step + 1}: {int(bad)} of {int(metrics.get(f'{model}/optimizer_steps', 1))} "
                f"optimizer steps gave non-finite weights or loss ({detail}); trainer.on_nonfinite=stop. "
                f"Lower {model}.optim.lr or raise {model}.optim.eps, or set trainer.on_nonfinite=skip to roll "
                "such updates back")
        if is_main:
            logger.warning("step %d: %d %s optimizer step(s) gave non-finite weights or loss (%s); rolled back "
                           "to the pre-step weights and optimizer state (trainer.on_nonfinite=skip)",
                           step + 1, int(bad), model, detail)
