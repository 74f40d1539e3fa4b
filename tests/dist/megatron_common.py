"""Helpers shared by the megatron worker scripts: deterministic shares, reference log-probs, engine set-up."""
from __future__ import annotations

import torch
from tensordict import TensorDict

from backends.base import Share
from backends.config import EngineConfig, MegatronConfig, OptimConfig
from protocol.algos.logprob import token_logprobs_and_entropy
from backends.model.config import ModelConfig
from backends.model.llama import LlamaModel
from dispatch.topology import Topology
from protocol.batch.nested import to_nested

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2)


def make_samples(n: int, seed: int, vocab: int = 64, with_train: bool = True, padding: tuple[int, ...] = ()):
    """``n`` samples with prompt_len 1..6, response_len 1..8, random response masks and training fields."""
    g = torch.Generator().manual_seed(seed)
    ids, masks, old, adv, ref = [], [], [], [], []
    for i in range(n):
        p = int(torch.randint(1, 7, (1,), generator=g))
        r = int(torch.randint(1, 9, (1,), generator=g))
        ids.append(torch.randint(0, vocab, (p + r,), generator=g))
        m = (torch.rand(r, generator=g) < 0.8).long()
        m[0] = 1
        if i in padding:
            m.zero_()
        masks.append(m)
        old.append(-torch.rand(r, generator=g) * 4 - 0.5)
        adv.append(torch.randn(r, generator=g))
        ref.append(-torch.rand(r, generator=g) * 4 - 0.5)
    fields = {"input_ids": to_nested(ids), "response_mask": to_nested(masks)}
    if with_train:
        fields.update(old_log_probs=to_nested(old), advantages=to_nested(adv), ref_log_prob=to_nested(ref))
    if padding:
        fields["is_padding"] = torch.tensor([i in padding for i in range(n)])
    return TensorDict(fields, batch_size=[n])


def reference_logprobs(model: LlamaModel, data: TensorDict, temperature: float = 1.0, with_entropy: bool = True):
    """Per-sample log-probs (and entropy) from the single-process reference model over the packed batch."""
    ids = data["input_ids"]
    off = ids.offsets()
    cu = off.to(torch.int32)
    lens = off.diff()
    pos = torch.cat([torch.arange(int(l)) for l in lens])
    rl = data["response_mask"].offsets().diff()
    with torch.no_grad():
        logits = model(ids.values(), pos, cu)
        lp, ent = token_logprobs_and_entropy(logits, ids.values(), cu, rl, temperature, with_entropy)
    return list(torch.split(lp, rl.tolist())), (list(torch.split(ent, rl.tolist())) if with_entropy else None)


def positions(topo, n: int) -> list[int]:
    """The samples of ``n`` this rank's DP replica holds (round robin over the replicas)."""
    import torch.distributed as dist

    return list(range(topo.dp_rank(dist.get_rank()), n, topo.dp_size))


def gather_outputs(out, pos: list[int], n: int, key: str = "log_probs") -> list[torch.Tensor]:
    """Every sample's ``key`` output on every rank (reporting ranks contribute their replica's samples)."""
    import torch.distributed as dist

    mine = {p: v for p, v in zip(pos, out[key].unbind())} if out is not None else {}
    parts: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(parts, mine)
    merged: dict = {}
    for part in parts:
        merged.update(part)
    assert sorted(merged) == list(range(n)), sorted(merged)
    return [merged[i] for i in range(n)]


def engine_config(par: MegatronConfig, model: ModelConfig = MODEL, optim: OptimConfig | None = None,
                  **kw) -> EngineConfig:
    optim = optim or OptimConfig(name="adamw", lr=0.01, eps=1e-3, clip_grad=1e6)
    return EngineConfig(model=model, megatron=par, optim=optim,
                        seed=kw.pop("seed", 3), **kw)


def topology(par: MegatronConfig, world: int) -> Topology:
    return Topology.from_config({"backend": "megatron", "tp": par.tp, "pp": par.pp, "vpp": par.vpp, "cp": par.cp,
                                 "ep": par.ep}, world)


def split_micro(n: int, k: int) -> list[list[int]]:
    """``k`` contiguous micro-batches over ``n`` positions (sizes differ by at most one)."""
    base, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def share_of(data: TensorDict, positions: list[int], k: int) -> Share:
    sub = data[positions]
    return Share(sub, split_micro(len(positions), k))


def pad_rows(rows, width=None):
    """Right-pad 1-D tensors into a float [n, width] matrix (keeps autograd)."""
    width = width if width is not None else max(r.numel() for r in rows)
    return torch.stack([torch.nn.functional.pad(r.float(), (0, width - r.numel())) for r in rows])


def reference_step(model: LlamaModel, data: TensorDict, optim: OptimConfig, steps: int = 1):
    """Plain-torch full-batch policy-loss steps on ``data``; returns (losses, grad_norms)."""
    from backends.optim import build_optimizer, clip_grad_norm, lr_factor
    from protocol.algos.losses import policy_loss

    opt = build_optimizer(model.parameters(), optim)
    ids = data["input_ids"]
    off = ids.offsets()
    cu = off.to(torch.int32)
    pos = torch.cat([torch.arange(int(l)) for l in off.diff()])
    rl = data["response_mask"].offsets().diff()
    mask = pad_rows([m.float() for m in data["response_mask"].unbind()])
    if "is_padding" in data.keys():
        mask = mask * (~data["is_padding"]).float()[:, None]
    old = pad_rows(list(data["old_log_probs"].unbind()))
    adv = pad_rows(list(data["advantages"].unbind()))
    real = data["is_padding"].logical_not().sum() if "is_padding" in data.keys() else len(rl)
    losses, norms = [], []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = optim.lr * lr_factor(step, optim)
        opt.zero_grad()
        logits = model(ids.values(), pos, cu)
        lp, _ = token_logprobs_and_entropy(logits, ids.values(), cu, rl)
        logp = pad_rows(list(torch.split(lp, rl.tolist())), mask.shape[1])
        loss, _ = policy_loss(old, logp, adv, mask, global_tokens=float(mask.sum()), global_seqs=float(real))
        loss.backward()
        norm, _ = clip_grad_norm(model.parameters(), optim.clip_grad)
        opt.step()
        losses.append(float(loss))
        norms.append(norm)
    return losses, norms
