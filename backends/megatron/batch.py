"""Turn a share's micro-batch (jagged per-sample fields) into the tensors megatron-core's GPTModel consumes.

Two layouts:

* **padded** (CPU, local layer spec): input_ids ``[b, s]`` right-padded to the micro-batch's longest sequence, an
  explicit boolean attention mask ``[b, 1, s, s]`` (True = masked: the future and padding keys), positions
  ``0..s-1`` per row (equal to each sample's own positions on its real tokens);
* **packed** (GPU, transformer-engine): one row ``[1, T]`` of the sequences back to back with THD
  ``PackedSeqParams`` (cu_seqlens), positions restarting at 0 in every sequence.

In both, :attr:`MicroBatch.logit_index` / :attr:`MicroBatch.target_ids` pick, for every response token in sample
order, the flattened logit row that predicts it (position ``prompt_len + j - 1``) and its token id.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from protocol.batch.nested import is_jagged, nested_lengths, nested_offsets, nested_values

__all__ = ["ShareError", "MicroBatch", "share_lengths", "make_micro_batch"]


class ShareError(ValueError):
    """A share whose fields are missing or inconsistent; the message names the field and the sample."""


@dataclass
class MicroBatch:
    """One micro-batch ready for the GPT forward, plus what the loss needs (padded response fields)."""

    positions: list[int]  # positions into the share, in order
    input_ids: torch.Tensor  # [b, s] padded or [1, T] packed
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # [b, 1, s, s] bool (True = masked) or None when packed
    packed_seq_params: object | None
    logit_index: torch.Tensor  # [R] rows of the flattened [b*s, V] (or [T, V]) logits
    target_ids: torch.Tensor  # [R]
    response_lens: list[int]
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # padded [b, Rmax] response fields
    is_padding: torch.Tensor | None = None  # [b] bool

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def batch(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_samples(self) -> int:
        return len(self.positions)


def share_lengths(data: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seq_len, response_len)`` int64 ``[n]`` of every sample; checks the fields a share must carry."""
    for name in ("input_ids", "response_mask"):
        if name not in data.keys():
            raise ShareError(f"share.data is missing the field {name!r}; it has {sorted(data.keys())}")
        if not is_jagged(data[name]):
            raise ShareError(f"share.data[{name!r}] must be a jagged nested tensor (layout=torch.jagged)")
    seq = nested_lengths(data["input_ids"])
    resp = nested_lengths(data["response_mask"])
    bad = torch.nonzero(seq - resp < 1).flatten()
    if bad.numel():
        i = int(bad[0])
        raise ShareError(f"sample {i}: prompt_len = seq_len - response_len = {int(seq[i])} - {int(resp[i])} "
                         f"= {int(seq[i] - resp[i])}; prompt_len >= 1 is required (the first response token is "
                         "predicted from the last prompt token)")
    return seq, resp


def _per_sample(data: TensorDict, name: str) -> list[torch.Tensor]:
    nt = data[name]
    off = nested_offsets(nt).tolist()
    vals = nested_values(nt)
    return [vals[a:b] for a, b in zip(off[:-1], off[1:])]


def _pad_rows(rows: list[torch.Tensor], width: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r.to(dtype)
    return out


def make_micro_batch(
    data: TensorDict,
    positions: list[int],
    *,
    response_fields: tuple[str, ...] = (),
    packed: bool = False,
    pad_multiple: int = 1,
    pad_to: tuple[int, int] | None = None,
    device: torch.device | str = "cpu",
) -> MicroBatch:
    """Build the model inputs of micro-batch ``positions`` of ``data`` (see the module docstring for layouts).

    ``response_fields`` (jagged, response_len each, e.g. ``old_log_probs``) are returned right-padded in
    :attr:`MicroBatch.fields` next to ``response_mask``. ``pad_multiple`` rounds the padded / packed length up
    (context parallel needs 2·cp). ``pad_to = (b, s)`` pads to a fixed shape (padded layout: extra rows attend to
    nothing and feed no output; packed layout: ``s`` tokens in one row), which the interleaved schedule needs.
    """
    if not positions:
        raise ShareError("a micro-batch must hold at least one sample; got an empty list of positions")
    seq, resp = share_lengths(data)
    sub = data[list(positions)]
    ids = _per_sample(sub, "input_ids")
    seq_l = [int(seq[p]) for p in positions]
    resp_l = [int(resp[p]) for p in positions]
    b = len(positions)
    rmax = max(resp_l) if resp_l else 0
    fields = {"response_mask": _pad_rows(_per_sample(sub, "response_mask"), rmax, torch.float32)}
    for name in response_fields:
        if name not in data.keys():
            raise ShareError(f"share.data is missing the field {name!r} needed for training; it has "
                             f"{sorted(data.keys())}")
        rows = _per_sample(sub, name)
        for i, (r, n) in enumerate(zip(rows, resp_l)):
            if r.numel() != n:
                raise ShareError(f"share.data[{name!r}] of sample {positions[i]} has {r.numel()} values, expected "
                                 f"response_len = {n}")
        fields[name] = _pad_rows(rows, rmax, torch.float32)
    is_padding = None
    if "is_padding" in data.keys():
        is_padding = data["is_padding"][list(positions)].to(torch.bool).reshape(b)

    logit_index, targets = [], []
    if packed:
        total = sum(seq_l)
        total_padded = -(-total // pad_multiple) * pad_multiple
        if pad_to is not None:
            if pad_to[1] < total_padded:
                raise ShareError(f"pad_to = {pad_to} is smaller than the packed micro-batch ({total_padded} tokens)")
            total_padded = pad_to[1]
        input_ids = torch.zeros(1, total_padded, dtype=torch.long)
        position_ids = torch.zeros(1, total_padded, dtype=torch.long)
        cu = [0]
        for i, (t, s, r) in enumerate(zip(ids, seq_l, resp_l)):
            start = cu[-1]
            input_ids[0, start: start + s] = t
            position_ids[0, start: start + s] = torch.arange(s)
            logit_index.append(torch.arange(start + s - r - 1, start + s - 1))
            targets.append(t[s - r:])
            cu.append(start + s)
        if total_padded > total:  # trailing filler as its own sequence so no real token attends to it
            cu.append(total_padded)
        from megatron.core.packed_seq_params import PackedSeqParams

        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        max_len = int(torch.tensor(cu).diff().max())
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
                              max_seqlen_q=max_len, max_seqlen_kv=max_len)
        mask = None
    else:
        s_max = max(seq_l)
        s_max = -(-s_max // pad_multiple) * pad_multiple
        lens = torch.tensor(seq_l)
        if pad_to is not None:
            if pad_to[0] < b or pad_to[1] < s_max:
                raise ShareError(f"pad_to = {pad_to} is smaller than the micro-batch ({b} samples, {s_max} tokens)")
            ids = ids + [torch.zeros(0, dtype=torch.long)] * (pad_to[0] - b)
            lens = torch.cat([lens, torch.zeros(pad_to[0] - b, dtype=torch.long)])
            b, s_max = pad_to
        input_ids = _pad_rows(ids, s_max, torch.long)
        position_ids = torch.arange(s_max).expand(b, s_max).contiguous()
        key_valid = torch.arange(s_max)[None, :] < lens[:, None]  # [b, s]
        causal = torch.ones(s_max, s_max, dtype=torch.bool).tril()
        allowed = causal[None] & key_valid[:, None, :]
        mask = (~allowed).unsqueeze(1)  # [b, 1, s, s], True = masked
        for i, (t, s, r) in enumerate(zip(ids, seq_l, resp_l)):
            logit_index.append(torch.arange(i * s_max + s - r - 1, i * s_max + s - 1))
            targets.append(t[s - r:])
        psp = None
    dev = torch.device(device)
    return MicroBatch(
        positions=list(positions),
        input_ids=input_ids.to(dev),
        position_ids=position_ids.to(dev),
        attention_mask=mask.to(dev) if mask is not None else None,
        packed_seq_params=psp,
        logit_index=torch.cat(logit_index).to(dev) if logit_index else torch.zeros(0, dtype=torch.long, device=dev),
        target_ids=torch.cat(targets).long().to(dev) if targets else torch.zeros(0, dtype=torch.long, device=dev),
        response_lens=resp_l,
        fields={k: v.to(dev) for k, v in fields.items()},
        is_padding=is_padding.to(dev) if is_padding is not None else None,
    )
