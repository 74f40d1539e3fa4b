"""A frozen reward model on the FSDP engine's mesh: the sequence-classification checkpoint sharded like the actor,
each rank reading its own rows, scoring the actor's inference shares (the same plan, micro-batches and padding).

``infer_batch`` returns ``rm_scores``: per sample, the response-length row with the sequence's score at its last
policy token and 0 elsewhere (:func:`protocol.algos.reward.compute_rm_scores`, the rule-based scores' contract);
a padding sample's row is all zero. The score is read at the last token of the whole sequence (prompt + response).
"""
from __future__ import annotations

import torch
from tensordict import TensorDict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from backends.base import Share
from backends.fsdp import checkpoint as ckpt
from backends.fsdp.engine import FSDPEngine
from backends.fsdp.share import read_share
from backends.fsdp.ulysses import gather_seq, pad_to_multiple
from backends.model.reward_model import RewardModel, last_token_positions, read_reward_config, reward_state_dict
from protocol.algos.reward import compute_rm_scores
from protocol.batch.nested import to_nested

__all__ = ["FSDPRewardModelEngine"]


class FSDPRewardModelEngine(FSDPEngine):
    """``config.model.hf_path``: the reward model folder; its architecture comes from that folder. Frozen, eval
    mode, inference only (no optimizer)."""

    def _build_model(self, mp: MixedPrecisionPolicy) -> RewardModel:
        path = self.config.model.hf_path
        cfg = read_reward_config(path)
        with torch.device("meta"):
            model = RewardModel(cfg)
        for layer in model.layers:
            fully_shard(layer, mesh=self.fsdp_mesh, mp_policy=mp)
        fully_shard(model, mesh=self.fsdp_mesh, mp_policy=mp)
        model.to_empty(device=self.device)
        ckpt.load_hf_shards(model, path, convert=reward_state_dict)
        return model.requires_grad_(False).eval()

    def _scores(self, ids_rows: list[torch.Tensor]) -> torch.Tensor:
        """The score of each sequence of one micro-batch (fp32, on the CPU)."""
        ids = torch.cat(ids_rows).to(self.device, torch.long)
        lens = [int(r.numel()) for r in ids_rows]
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(self.device)
        if self.sp_size == 1:
            return self.model(ids, pos, cu).cpu()
        total = ids.shape[0]
        ids_p, pos_p, cu_p, _ = pad_to_multiple(ids, pos, cu, self.sp_size)
        tl = ids_p.shape[0] // self.sp_size
        local = slice(self.sp_rank * tl, (self.sp_rank + 1) * tl)
        per_token = self.model(ids_p[local], pos_p[local], cu_p, attention=self._attention)
        return gather_seq(per_token, self.sp_group)[:total].index_select(0, last_token_positions(cu)).cpu()

    @torch.no_grad()
    def infer_batch(self, share: Share, *, temperature: float = 1.0, with_entropy: bool = False):
        """``rm_scores`` of the share's samples, jagged, in share order, on SP rank 0 of each replica (else None).
        ``temperature`` is a policy's setting: a score does not depend on it."""
        if with_entropy:
            raise ValueError("a reward model has no entropy: call infer_batch with with_entropy=False")
        view = read_share(share, train=False, max_tokens=self.config.max_token_len_per_gpu)
        scores = torch.zeros(view.n)
        try:
            for mb in share.micro_batches:
                if mb:
                    scores[list(mb)] = self._scores([view.input_ids[j] for j in mb])
        finally:
            ckpt.reshard(self.model)  # a no-grad forward leaves the root's parameters gathered: free them
        if view.is_padding is not None:
            scores = torch.where(view.is_padding.bool(), 0.0, scores)
        if not self.is_reporting_rank:
            return None
        rows = compute_rm_scores(scores, to_nested([m.cpu() for m in view.response_mask]))
        return TensorDict({"rm_scores": rows, "scores": scores}, batch_size=[view.n])

    def train_batch(self, share: Share) -> dict[str, float]:
        raise RuntimeError("the reward model is frozen: it has no train_batch")
