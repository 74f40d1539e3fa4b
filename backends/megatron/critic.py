"""The megatron critic: the actor's megatron-core GPTModel with a scalar value head in place of its output layer.

The value head (``Linear(hidden, 1)`` with bias, the project's ``value_head``) is replicated on every TP rank: its
input, the final norm's output, is whole on each TP rank, so every rank computes the same values and the same head
gradient, and megatron-core counts a replicated parameter once in the gradient norm. With sequence parallelism the
head first gathers the sequence (its backward keeps each rank's own slice: the gradients above it are identical on
every TP rank). The critic joins the actor's megatron-core parallel state (same TP / PP / VPP / CP degrees, hence
the actor's logical DP); its optimizer, LR schedule and checkpoints are its own.
"""
from __future__ import annotations

import dataclasses

import torch
from tensordict import TensorDict

from backends.base import Share
from backends.megatron.batch import MicroBatch
from backends.megatron.convert import from_megatron_shards, to_megatron_shard
from backends.megatron.engine import MegatronEngine
from backends.megatron.model import build_model_chunks
from backends.model.critic import VALUE_HEAD, value_head_weights
from protocol.algos.losses import value_loss
from protocol.batch.nested import to_nested

__all__ = ["MegatronCriticEngine", "MegatronValueHead", "critic_to_megatron_shard", "critic_from_megatron_shards"]

_TRAIN_FIELDS = ("values", "returns")
_HEAD = ("output_layer.weight", "output_layer.bias")  # the value head's megatron names (it is the output layer)


class MegatronValueHead(torch.nn.Module):
    """``Linear(hidden, 1)`` with bias, replicated over TP, called as GPTModel calls its output layer:
    ``head(hidden [s, b, h]) -> (values [s, b, 1], None)``."""

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def _decoder_cfg(cfg):
    # the decoder and its embedding alone (no lm_head): converted as a tied model, whose output copy is dropped
    return dataclasses.replace(cfg, tie_word_embeddings=True)


def critic_to_megatron_shard(sd: dict[str, torch.Tensor], cfg, *, tp_rank: int, tp_size: int, layers: list[int],
                             pre_process: bool, post_process: bool) -> dict[str, torch.Tensor]:
    """One chunk's megatron weights of a :class:`backends.model.critic.ValueModel` state dict on one TP rank: the
    decoder as the actor's converter lays it out, the value head whole as ``output_layer.{weight,bias}``."""
    body = {k: v for k, v in sd.items() if k not in VALUE_HEAD}
    out = to_megatron_shard(body, _decoder_cfg(cfg), tp_rank=tp_rank, tp_size=tp_size, layers=layers,
                            pre_process=pre_process, post_process=post_process)
    out.pop("output_layer.weight", None)
    if post_process:
        for mine, theirs in zip(_HEAD, VALUE_HEAD):
            out[mine] = sd[theirs].detach().clone()
    return out


def critic_from_megatron_shards(shards: list[dict], cfg, *, layers: list[int]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`critic_to_megatron_shard` for one chunk (index = TP rank)."""
    out = from_megatron_shards([{k: v for k, v in s.items() if k not in _HEAD} for s in shards], _decoder_cfg(cfg),
                               layers=layers)
    for mine, theirs in zip(_HEAD, VALUE_HEAD):
        if mine in shards[0]:
            out[theirs] = shards[0][mine].clone()
    return out


class MegatronCriticEngine(MegatronEngine):
    """A value model on the megatron engine's machinery; ``config.optim`` is the critic's own optimizer and
    ``config.value_loss`` its loss. Starts from ``model.hf_path`` (the decoder; the head from the seed) or from the
    seeded initial policy's decoder, as :meth:`backends.model.critic.ValueModel.from_seed` draws it."""

    joins_parallel_state = True

    def _build_chunks(self) -> list:
        par = self.config.megatron
        # untied: the head replaces the output layer (a tied one would share the embedding's weight); GPTModel
        # still builds its vocabulary projection first, a transient vocab x hidden / tp allocation on the last stage
        chunks = build_model_chunks(dataclasses.replace(self.config.model, tie_word_embeddings=False), par,
                                    self.tcfg, use_te=self.use_te)
        for gpt in chunks:
            if gpt.post_process:
                gpt.output_layer = MegatronValueHead(self.config.model.hidden_size, self.tcfg.params_dtype,
                                                     gpt.decoder.final_layernorm.weight.device,
                                                     bool(par.sequence_parallel))
        return chunks

    def _initial_weights(self) -> dict[str, torch.Tensor]:
        from backends.model.hf import initial_model

        cfg = self.config.model
        sd = {k: v for k, v in initial_model(cfg, int(self.config.seed)).state_dict().items() if k != "lm_head.weight"}
        sd.update(value_head_weights(cfg, int(self.config.seed)))
        return sd

    def _to_shard(self, sd, **where):
        return critic_to_megatron_shard(sd, self.config.model, **where)

    def _from_shards(self, shards, layers):
        return critic_from_megatron_shards(shards, self.config.model, layers=layers)

    def _expected_names(self) -> list[str]:
        return [n for n in super()._expected_names() if n != "lm_head.weight"] + list(VALUE_HEAD)

    # ------------------------------------------------------------------ values and the value loss
    @staticmethod
    def _values(out: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """Flat values [R] of the micro-batch's response tokens from the head's output [b, s, 1] (fp32)."""
        return out.reshape(-1).index_select(0, mb.logit_index).float()

    def _padded(self, flat: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        rmax = mb.fields["response_mask"].shape[1]
        return torch.stack([torch.nn.functional.pad(r, (0, rmax - r.numel()))
                            for r in torch.split(flat, mb.response_lens)])

    @torch.no_grad()
    def infer_batch(self, share: Share, *, temperature: float = 1.0, with_entropy: bool = False):
        """``values`` of the response tokens, jagged, in share order, on the reporting rank of each replica; 0 where
        ``response_mask`` is 0. ``temperature`` is a policy's setting: a value does not depend on it."""
        if with_entropy:
            raise ValueError("a critic has no entropy: call infer_batch with with_entropy=False")
        mbs = self._micro_batches(share, ())

        def loss_func(mb: MicroBatch, out: torch.Tensor):
            return out.new_zeros(()), torch.tensor(0, dtype=torch.int), {"values": self._values(out, mb).cpu()}

        store = self._forward_only(mbs, loss_func)
        if store is None:
            return None
        n = share.data.batch_size[0]
        rows: list = [None] * n
        for mb, out in zip(mbs, store):
            masks = mb.fields["response_mask"].cpu()
            for i, (pos, vals) in enumerate(zip(mb.positions, torch.split(out["values"], mb.response_lens))):
                rows[pos] = torch.where(masks[i, :vals.numel()].bool(), vals, 0.0)  # values on policy tokens only
        return TensorDict({"values": to_nested(rows)}, batch_size=[n])

    def _value_loss(self, mb: MicroBatch, out: torch.Tensor, counts: tuple[float, float]):
        """This micro-batch's share of the step's value loss and of its metrics."""
        vc = self.config.value_loss
        mask = mb.fields["response_mask"].bool()
        if mb.is_padding is not None:  # a padding sample moves no value loss
            mask = mask & ~mb.is_padding[:, None]
        loss, m = value_loss(self._padded(self._values(out, mb), mb), mb.fields["values"], mb.fields["returns"], mask,
                             cliprange_value=vc.cliprange_value, loss_agg_mode=vc.loss_agg_mode,
                             global_tokens=counts[0], global_seqs=counts[1], horizon=vc.horizon)
        metrics = torch.stack([x.detach().float().reshape(()) for x in
                               (loss, m["vf_clipfrac"], m["vpred_mean"])]).cpu()
        return loss, torch.tensor(1, dtype=torch.int), {"metrics": metrics}

    def train_batch(self, share: Share) -> dict[str, float]:
        """One optimizer step of the value loss on this replica's share; metrics are global (same on every rank)."""
        sums, common = self._train_step(share, _TRAIN_FIELDS, _call_value_loss, 3)
        vf_loss, clipfrac, vpred = sums.tolist()
        return {"vf_loss": vf_loss, "vf_clipfrac": clipfrac, "vpred_mean": vpred, **common}


def _call_value_loss(engine: MegatronCriticEngine, counts, mb: MicroBatch, out: torch.Tensor):
    return engine._value_loss(mb, out, counts)
