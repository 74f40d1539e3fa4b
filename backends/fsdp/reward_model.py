"""A frozen reward model on the FSDP engine's mesh: the sequence-classification checkpoint sharded like the actor,
each rank reading its own rows, scoring the actor's inference shares (the same plan, micro-batches and padding).

``infer_batch`` returns ``rm_scores``: per sample, the response-length row with the sequence's score at its last
policy token and 0 elsewhere (:func:`protocol.algos.reward.compute_rm_scores`, the rule-based scores' contract);
a padding sample's row is all zero. The score is read at the last token of the whole sequence (prompt + response).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from backends.base import Share
from backends.fsdp import checkpoint as ckpt
from backends.fsdp.engine import FSDPEngine
from backends.fsdp.share import read_share
from backends.fsdp.ulysses import gather_seq, pad_to_multiple
from backends.model.reward_model import RewardModel, RewardModelError, last_token_positions, reward_state_dict
from protocol.algos.reward import compute_rm_scores
from protocol.batch.nested import to_nested

__all__ = ["FSDPRewardModelEngine"]


class FSDPRewardModelEngine(FSDPEngine):
    """``config.model``: the reward model folder's config (:func:`backends.model.reward_model.read_reward_config`).
    Frozen, eval mode, inference only (no optimizer).

    ``max_length`` (default: the model's ``max_position_embeddings``): a longer sequence is an error
    (``truncation="error"``) or keeps its last ``max_length`` tokens (``"left"``; counted in ``rm_truncated``).
    ``micro_batch_size``: at most that many sequences per forward, cutting the share's micro-batches further (the
    scores do not depend on the split)."""

    def __init__(self, config, topology=None, *, max_length: int | None = None, truncation: str = "error",
                 micro_batch_size: int | None = None) -> None:
        if truncation not in ("error", "left"):
            raise ValueError(f"reward.model.truncation must be 'error' or 'left', got {truncation!r}")
        self.truncation, self.micro_batch_size = truncation, micro_batch_size
        super().__init__(config, topology)
        self.max_length = int(max_length or self.model.cfg.max_position_embeddings)

    def _build_model(self, mp: MixedPrecisionPolicy) -> RewardModel:
        cfg = self.config.model  # the folder's own config (read_reward_config), as the caller built it
        path = cfg.hf_path
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

    def _parts_per_micro_batch(self, share: Share) -> list[int]:
        """How many forwards each micro-batch takes: 1, or with ``micro_batch_size`` the most any rank needs for it
        (one collective; a rank with fewer sequences runs its extra forwards on one token)."""
        if self.micro_batch_size is None:
            return [1] * len(share.micro_batches)
        need = torch.tensor([-(-len(mb) // self.micro_batch_size) for mb in share.micro_batches], dtype=torch.int64,
                            device=self.device)
        dist.all_reduce(need, op=dist.ReduceOp.MAX)
        return [max(int(k), 1) for k in need]

    @torch.no_grad()
    def infer_batch(self, share: Share, *, temperature: float = 1.0, with_entropy: bool = False,
                    input_ids: list[torch.Tensor] | None = None):
        """``rm_scores`` of the share's samples, jagged, in share order, on SP rank 0 of each replica (else None).
        ``temperature`` is a policy's setting: a score does not depend on it. ``input_ids``: the reward model's own
        token ids of each sample (re-tokenized; default: the share's), read in the share's micro-batches; the score
        is still placed at each sample's last policy token."""
        if with_entropy:
            raise ValueError("a reward model has no entropy: call infer_batch with with_entropy=False")
        view = read_share(share, train=False, max_tokens=self.config.max_token_len_per_gpu)
        if input_ids is not None and len(input_ids) != view.n:
            raise ValueError(f"input_ids has {len(input_ids)} rows for a share of {view.n} samples")
        ids_rows = view.input_ids if input_ids is None else input_ids
        lens = [int(r.numel()) for r in ids_rows]
        scores = torch.zeros(view.n)
        truncated = torch.tensor([n > self.max_length for n in lens])
        if self.truncation == "error" and bool(truncated.any()):
            j = int(truncated.nonzero()[0])
            raise RewardModelError(f"a sequence of {lens[j]} tokens exceeds reward.model.max_length="
                                   f"{self.max_length}; raise it or set reward.model.truncation=left (keep the "
                                   f"last {self.max_length} tokens)")
        rows = [ids[-self.max_length:] for ids in ids_rows]
        try:
            for mb, n_parts in zip(share.micro_batches, self._parts_per_micro_batch(share)):
                for part in torch.tensor_split(torch.tensor(list(mb), dtype=torch.long), n_parts):
                    part = part.tolist()
                    if part:
                        scores[part] = self._scores([rows[j] for j in part])
                    else:  # every rank runs as many forwards (each gathers the sharded weights): a 1-token one
                        self._scores([rows[mb[0]][-1:] if mb else torch.zeros(1, dtype=torch.long)])
        finally:
            ckpt.reshard(self.model)  # a no-grad forward leaves the root's parameters gathered: free them
        if view.is_padding is not None:
            scores = torch.where(view.is_padding.bool(), 0.0, scores)
        if not self.is_reporting_rank:
            return None
        placed = compute_rm_scores(scores, to_nested([m.cpu() for m in view.response_mask]))
        return TensorDict({"rm_scores": placed, "scores": scores, "rm_truncated": truncated}, batch_size=[view.n])

    def train_batch(self, share: Share) -> dict[str, float]:
        raise RuntimeError("the reward model is frozen: it has no train_batch")
