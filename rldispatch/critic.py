"""The critic: a value model beside the actor (PPO with GAE), on the actor's backend and DP ranks, trained on the
actor's mini- and micro-batches; shaped like the reference role (:mod:`rldispatch.ref`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dispatch import Topology
from protocol.store.meta import KVBatchMeta
from rldispatch.bridge import StoreBridge
from rldispatch.config import ConfigError, RunConfig
from rldispatch.metrics import StepStats, explained_variance
from rldispatch.step_state import StepState

__all__ = ["CriticRole", "CRITIC_FIELDS", "build_critic_engine"]

#: what the critic's update reads
CRITIC_FIELDS = ("input_ids", "response_mask", "values", "returns")
#: the step's sums behind ``critic/vf_explained_var`` (reduced with the other metrics, then replaced by it)
_EV_SUMS = tuple(f"critic/explained_var_sums/{k}" for k in ("n", "r", "rr", "d", "dd"))


def build_critic_engine(cfg: RunConfig, topology: Topology, world: int) -> Any:
    """The value model on its own FSDP section, whose topology must give the actor's DP ranks (one plan), or a
    Megatron critic in the actor's megatron-core parallel state (the actor's topology)."""
    if cfg.actor.backend == "megatron":
        from backends.megatron.critic import MegatronCriticEngine

        return MegatronCriticEngine(cfg.critic_engine_config(), topology)
    from backends.fsdp.critic import FSDPCriticEngine

    own = Topology.from_config(cfg.critic.fsdp, world)
    if own.dp_size != topology.dp_size or \
            [own.dp_rank(r) for r in range(world)] != [topology.dp_rank(r) for r in range(world)]:
        raise ConfigError(f"critic.fsdp gives logical DP {own.dp_size}, the actor's section gives "
                          f"{topology.dp_size}: the critic must have the actor's DP ranks")
    return FSDPCriticEngine(cfg.critic_engine_config(), own)


class CriticRole:
    """The critic's engine and its bridge to the store: values for the advantage, the value-loss update, its
    metrics and its checkpoint folder (``critic/`` beside the actor's)."""

    def __init__(self, cfg: RunConfig, topology: Topology, store: Any):
        self.cfg, self.topology = cfg, topology
        self.engine = build_critic_engine(cfg, topology, topology.world_size)
        self.bridge = StoreBridge(self.engine, store)
        self.dp_ranks = [topology.dp_rank(r) for r in range(topology.world_size)]  # of every store rank
        self.dp_rank = self.dp_ranks[store.rank]

    def infer_values(self, st: StepState) -> None:
        """The value of every response token, on the inference share the log-probs used (no new fetch)."""
        self.bridge.infer(st.mine, st.plan.infer_micro_batches(self.dp_rank), outputs={"values": "values"},
                          data=st.infer_inputs)

    def update(self, full: KVBatchMeta, st: StepState) -> list[dict[str, float]]:
        """The value loss over the actor's mini- and micro-batches (ppo_epochs x mini-batches, one optimizer step
        each); the engine's metrics of each."""
        return [self.bridge.train(mb.meta(full), mb.micro_batches, fields=CRITIC_FIELDS, wants=wants)
                for mb, wants in st.plan.train_shares(self.dp_ranks, self.dp_rank)]

    @staticmethod
    def value_metrics(values: torch.Tensor, returns: torch.Tensor, real: torch.Tensor, stats: StepStats) -> None:
        """``critic/values/mean``, ``critic/returns/mean`` over the step's policy tokens, and the sums behind
        ``critic/vf_explained_var`` (this rank's real samples; every rank's add up)."""
        v, r = values[real].double(), returns[real].double()
        stats.masked("critic/values", v, keep=("mean",))
        stats.masked("critic/returns", r, keep=("mean",))
        d = r - v
        for name, x in zip(_EV_SUMS, (float(r.numel()), r.sum(), (r * r).sum(), d.sum(), (d * d).sum())):
            stats.sum(name, float(x))

    @staticmethod
    def finish_metrics(m: dict[str, float]) -> None:
        """Replace the reduced sums of :meth:`value_metrics` by ``critic/vf_explained_var``."""
        if _EV_SUMS[0] in m:
            m["critic/vf_explained_var"] = explained_variance(*(m.pop(k) for k in _EV_SUMS))

    def save(self, checkpoint: Path, step: int) -> None:
        """Beside the actor's checkpoint (an export reads the actor's weights only)."""
        self.engine.save_checkpoint(str(checkpoint / "critic"), extra_state={"step": step})

    def load(self, checkpoint: Path, step: int) -> None:
        """The critic's state from ``checkpoint/critic``, for the same step as the actor's."""
        folder = checkpoint / "critic"
        if not folder.is_dir():
            raise FileNotFoundError(f"{checkpoint} holds no critic (no {folder.name}/ folder) but critic.enabled=true")
        saved = int(self.engine.load_checkpoint(str(folder)).get("step", -1))
        if saved != step:
            raise ValueError(f"{folder}: the critic was saved at step {saved}, the actor at step {step}")
