"""LoRA adapters on megatron-core's tensor-parallel linears, split like the weight they adapt (docs/lora.md).

Every adapted linear keeps one ``(A, B)`` pair per original projection (``linear_qkv``: q, k, v; ``linear_fc1``:
gate, up), held in ``lora_A`` / ``lora_B`` parameter dicts keyed by the projection's name, and adds
``(alpha / r) (x A^T) B^T`` to the base output:

* column-parallel (``linear_qkv``, ``linear_fc1``; output rows split over TP): A [r, in] replicated, B [out/tp, r]
  this rank's rows. ``x A^T`` is computed whole on every rank and enters a copy-to-TP region (identity forward,
  all-reduce of its gradient), so A's gradient and the input's gradient through the adapter are the full sums on
  every rank. The local deltas are laid out as megatron's weight is: per query group [q rows, k rows, v rows]
  for qkv, [gate; up] for fc1.
* row-parallel (``linear_proj``, ``linear_fc2``; input split over TP): A [r, in/tp] this rank's columns, B [out, r]
  replicated. ``x_local A_local^T`` is all-reduced (a reduce-from-TP region: identity backward) into ``x A^T`` and
  ``· B^T`` is added after the base output's own all-reduce.

Dropout on the adapters' input follows megatron-core's rule for random numbers: the default generator where the
activation is replicated over TP (the same mask on every TP rank), the model-parallel tracker where it is split.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from backends.megatron.convert import ADAPTER_SPLIT
from backends.model.config import ModelConfig
from backends.model.lora import LoraSpec

__all__ = ["apply_megatron_lora", "adapted_linears"]


def adapted_linears(spec: LoraSpec) -> dict[str, tuple[str, ...]]:
    """megatron linear (within a layer) -> the targets of ``spec`` it holds, in the linear's output order."""
    out: dict[str, list[str]] = {}
    for proj in spec.targets:
        out.setdefault(ADAPTER_SPLIT[proj][1], []).append(proj)
    return {linear: tuple(p for p in ADAPTER_SPLIT if p in projs) for linear, projs in out.items()}


class _Adapted:
    """What both adapted linear kinds share: the flags, the scale and the parameter dicts."""

    lora_A: nn.ParameterDict
    lora_B: nn.ParameterDict

    def _setup(self, spec: LoraSpec, projs: tuple[str, ...], a_shape, b_shape, split: str, dim: int) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        w = self.weight
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for proj in projs:
            for ab, shape in (("lora_A", a_shape(proj)), ("lora_B", b_shape(proj))):
                p = nn.Parameter(torch.zeros(shape, device=w.device, dtype=w.dtype))
                set_tensor_model_parallel_attributes(p, ab == split, dim if ab == split else -1, 1)
                getattr(self, ab)[proj] = p
        self.lora_projs = projs
        self.lora_split = (split, dim)
        self.lora_scale = spec.scale
        self.lora_dropout = float(spec.dropout)
        self.adapters_enabled = True

    def _adapter_state_dict(self, axes: dict[str, int], prefix, sharded_offsets, metadata):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        split, dim = self.lora_split
        axes = {**axes, **{f"{split}.{p}": dim for p in self.lora_projs}}
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                   sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])


def _column_class():
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    class LoraColumnParallelLinear(_Adapted, ColumnParallelLinear):
        """ColumnParallelLinear + adapters: A replicated, B split along the output (see the module docstring)."""

        lora_groups: int
        lora_rows: dict[str, int]

        def forward(self, input_, weight=None, runtime_gather_output=None):
            out, bias = super().forward(input_, weight, runtime_gather_output)
            if not self.adapters_enabled:
                return out, bias
            if self.gather_output or runtime_gather_output:
                raise RuntimeError("LoRA on a column-parallel linear that gathers its output is not supported")
            x = F.dropout(input_, self.lora_dropout, self.training) if self.lora_dropout else input_
            projs = self.lora_projs
            h = F.linear(x, torch.cat([self.lora_A[p] for p in projs]))
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            rank = self.lora_A[projs[0]].shape[0]
            deltas = {p: F.linear(hp, self.lora_B[p]) for p, hp in zip(projs, torch.split(h, rank, dim=-1))}
            lead = out.shape[:-1]
            parts = [deltas[p] if p in deltas else out.new_zeros(*lead, self.lora_groups * self.lora_rows[p])
                     for p in self.lora_rows]
            # megatron's row order: per query group (qkv) or one group (fc1), each projection's rows in turn
            delta = torch.cat([d.unflatten(-1, (self.lora_groups, -1)) for d in parts], dim=-1).flatten(-2)
            return out + self.lora_scale * delta, bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return self._adapter_state_dict({"weight": 0, "bias": 0}, prefix, sharded_offsets, metadata)

    return LoraColumnParallelLinear


def _row_class():
    from megatron.core.tensor_parallel import RowParallelLinear, get_cuda_rng_tracker
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    class LoraRowParallelLinear(_Adapted, RowParallelLinear):
        """RowParallelLinear + adapters: A split along the input, B replicated (see the module docstring)."""

        def forward(self, input_):
            out, bias = super().forward(input_)
            if not self.adapters_enabled:
                return out, bias
            (proj,) = self.lora_projs
            x = input_
            if self.lora_dropout:
                with get_cuda_rng_tracker().fork():  # the input is split over TP: each rank its own stream
                    x = F.dropout(input_, self.lora_dropout, self.training)
            h = reduce_from_tensor_model_parallel_region(F.linear(x, self.lora_A[proj]), group=self.tp_group)
            return out + self.lora_scale * F.linear(h, self.lora_B[proj]), bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return self._adapter_state_dict({"weight": 1}, prefix, sharded_offsets, metadata)

    return LoraRowParallelLinear


_CLASSES: dict[str, type] = {}


def _classes() -> tuple[type, type]:
    if not _CLASSES:
        _CLASSES["column"], _CLASSES["row"] = _column_class(), _row_class()
    return _CLASSES["column"], _CLASSES["row"]


def apply_megatron_lora(gpt: nn.Module, model: ModelConfig, spec: LoraSpec, tp: int) -> list[str]:
    """Adapt the target linears of every decoder layer of one megatron-core GPTModel chunk (local layer spec) in
    place, adapters zero (the engine loads their values), and freeze every other parameter. Returns the adapted
    module names."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    column_cls, row_cls = _classes()
    hd, g = model.head_dim, model.num_heads // model.num_kv_heads
    out_rows = {"q_proj": g * hd, "k_proj": hd, "v_proj": hd,
                "gate_proj": model.intermediate_size // tp, "up_proj": model.intermediate_size // tp}
    in_cols = {"o_proj": model.num_heads * hd // tp, "down_proj": model.intermediate_size // tp}
    groups = {"self_attention.linear_qkv": model.num_kv_heads // tp, "mlp.linear_fc1": 1}
    r, adapted = spec.rank, []
    for i, layer in enumerate(gpt.decoder.layers):
        for linear, projs in adapted_linears(spec).items():
            mod = layer.get_submodule(linear)
            if type(mod) is ColumnParallelLinear:
                mod.__class__ = column_cls
                n_groups = groups[linear]
                mod._setup(spec, projs, lambda p: (r, model.hidden_size),
                           lambda p: (n_groups * out_rows[p], r), "lora_B", 0)
                mod.lora_groups = n_groups
                # every projection the fused linear holds, adapted or not, in its output order
                mod.lora_rows = {p: out_rows[p] for p, split in ADAPTER_SPLIT.items() if split[1] == linear}
            elif type(mod) is RowParallelLinear:
                mod.__class__ = row_cls
                mod._setup(spec, projs, lambda p: (r, in_cols[p]), lambda p: (model.hidden_size, r), "lora_A", 1)
            else:
                raise TypeError(f"decoder.layers.{i}.{linear} is a {type(mod).__name__}; LoRA adapts megatron-core's "
                                f"local-spec ColumnParallelLinear / RowParallelLinear only")
            adapted.append(f"decoder.layers.{i}.{linear}")
    for name, p in gpt.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    return adapted
