"""The FSDP critic: the FSDP engine's mesh, sharding, optimizer and checkpoints around a :class:`ValueModel`.

``infer_batch`` returns the value of every response token; ``train_batch`` makes one optimizer step of the clipped
value loss (:func:`protocol.algos.losses.value_loss`), normalised by the token / sequence counts of the whole
optimizer step as the actor's policy loss is, so the update does not depend on the DP size or micro-batch split.
"""
from __future__ import annotations

import time

import torch
from tensordict import TensorDict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.utils.rnn import pad_sequence

from backends.base import Share
from backends.comm import allreduce_counts
from backends.fsdp import checkpoint as ckpt
from backends.fsdp.engine import FSDPEngine
from backends.fsdp.share import ShareView, read_share
from backends.fsdp.ulysses import gather_seq, pad_to_multiple
from backends.model.critic import VALUE_HEAD, ValueModel, value_head_weights
from backends.model.hf import check_hf_config
from protocol.algos.logprob import response_logit_positions
from protocol.algos.losses import value_loss
from protocol.batch.nested import to_nested

__all__ = ["FSDPCriticEngine", "CRITIC_TRAIN_FIELDS"]

#: what the critic's update reads besides ``input_ids`` and ``response_mask``
CRITIC_TRAIN_FIELDS = ("values", "returns")


class FSDPCriticEngine(FSDPEngine):
    """A value model on the FSDP engine's machinery; ``config.optim`` / ``config.fsdp`` are the critic's own and
    ``config.value_loss`` its loss. With ``model.hf_path`` the decoder starts from that checkpoint (each rank reads
    its own rows) and the value head from the seed; without it, from the seeded initial policy's weights."""

    def _build_model(self, mp: MixedPrecisionPolicy) -> ValueModel:
        cfg = self.config.model
        if cfg.hf_path:
            check_hf_config(cfg)
            with torch.device("meta"):
                model = ValueModel(cfg)
        else:
            model = ValueModel.from_seed(cfg, self.config.seed).to(self.device)
        model.activation_checkpointing = bool(self.config.fsdp.activation_checkpointing)
        for layer in model.layers:
            fully_shard(layer, mesh=self.fsdp_mesh, mp_policy=mp)
        fully_shard(model, mesh=self.fsdp_mesh, mp_policy=mp)
        if cfg.hf_path:
            model.to_empty(device=self.device)
            ckpt.load_hf_shards(model, cfg.hf_path, skip=VALUE_HEAD)
            self._init_value_head(model)
        return model

    @torch.no_grad()
    def _init_value_head(self, model: ValueModel) -> None:
        """The value head as :meth:`ValueModel.from_seed` draws it, each rank copying its own rows."""
        own = dict(model.named_parameters())
        for name, full in value_head_weights(self.config.model, self.config.seed).items():
            p = own[name]
            start, stop = ckpt.local_rows(p)
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(full[start:stop].to(local.dtype))

    def _values(self, view: ShareView, mb: list[int]) -> torch.Tensor:
        """Flat values of the response tokens of micro-batch ``mb`` (fp32), samples in ``mb`` order."""
        ids = torch.cat([view.input_ids[i] for i in mb]).to(self.device, torch.long)
        lens = [view.seq_lens[i] for i in mb]
        rls = [view.response_lens[i] for i in mb]
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        cu_cpu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        cu = cu_cpu.to(self.device)
        idx = response_logit_positions(cu_cpu, rls)[0].to(self.device)
        if self.sp_size == 1:
            return self.model(ids, pos, cu, logits_positions=idx)
        total = ids.shape[0]
        ids_p, pos_p, cu_p, _ = pad_to_multiple(ids, pos, cu, self.sp_size)
        tl = ids_p.shape[0] // self.sp_size
        local = slice(self.sp_rank * tl, (self.sp_rank + 1) * tl)
        values = self.model(ids_p[local], pos_p[local], cu_p, attention=self._attention)
        return gather_seq(values, self.sp_group)[:total].index_select(0, idx)

    def train_batch(self, share: Share) -> dict[str, float]:
        """One optimizer step of the value loss on this replica's share; metrics are global (same on every rank)."""
        t0 = time.perf_counter()
        vc = self.config.value_loss
        view = read_share(share, train=False, max_tokens=self.config.max_token_len_per_gpu,
                          fields=CRITIC_TRAIN_FIELDS)
        g_tokens, g_seqs, n_mb = self._step_counts(view, share)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # vf_loss, vf_clipfrac, vpred_mean
        for i, mb in enumerate(share.micro_batches):
            self.model.set_requires_gradient_sync(i == n_mb - 1)
            rls = [view.response_lens[j] for j in mb]
            vpreds = pad_sequence(list(self._values(view, mb).split(rls)), batch_first=True)
            mask = self._padded([view.response_mask[j] for j in mb], torch.bool)
            if view.is_padding is not None:  # a padding sample moves no value loss
                mask = mask & ~view.is_padding[mb].to(self.device)[:, None]
            old = self._padded([view.extra["values"][j] for j in mb])
            returns = self._padded([view.extra["returns"][j] for j in mb])
            loss, m = value_loss(vpreds, old, returns, mask, cliprange_value=vc.cliprange_value,
                                 loss_agg_mode=vc.loss_agg_mode, global_tokens=g_tokens, global_seqs=g_seqs,
                                 horizon=vc.horizon)
            (loss * self.loss_scale).backward()
            sums += torch.stack([x.detach().to(self.device, torch.float64).reshape(())
                                 for x in (loss, m["vf_clipfrac"], m["vpred_mean"])])
        self.model.set_requires_gradient_sync(True)
        grad_norm, lr, finite, nonfinite = self._apply_gradients()
        tot = allreduce_counts(sums.tolist(), self._dp_group, self.device)
        return {
            "vf_loss": tot[0], "vf_clipfrac": tot[1], "vpred_mean": tot[2], "grad_norm": grad_norm, "lr": lr,
            "tokens": g_tokens, "seqs": g_seqs, "skipped": 0.0 if finite and not nonfinite else 1.0,
            "nonfinite": float(nonfinite), "micro_batches": float(n_mb), "time": time.perf_counter() - t0,
            "global_step": float(self.global_step),
        }

    @torch.no_grad()
    def infer_batch(self, share: Share, *, temperature: float = 1.0, with_entropy: bool = False):
        """``values`` of the response tokens, jagged, in share order, on SP rank 0 of each replica; 0 where
        ``response_mask`` is 0 (observation tokens, padding samples), as the policy's tokens alone have values.
        ``temperature`` is a policy's setting: a value does not depend on it."""
        if with_entropy:
            raise ValueError("a critic has no entropy: call infer_batch with with_entropy=False")
        view = read_share(share, train=False, max_tokens=self.config.max_token_len_per_gpu)
        self.model.eval()
        out: list[torch.Tensor | None] = [None] * view.n
        try:
            for mb in share.micro_batches:
                rls = [view.response_lens[j] for j in mb]
                for j, x in zip(mb, self._values(view, mb).split(rls)):  # values live on policy tokens only
                    out[j] = torch.where(view.response_mask[j].bool(), x.float().cpu(), 0.0)
        finally:
            self.model.train()
        if not self.is_reporting_rank:
            return None
        return TensorDict({"values": to_nested(out)}, batch_size=[view.n])
