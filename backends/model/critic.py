"""The critic: the project's decoder with a scalar value head in place of the output projection.

The value of response token ``t`` is read from the hidden state that predicts it (position ``prompt_len + t - 1``),
the position whose logits give the token's log-prob, as the reference system's critic does.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from backends.model.attention import check_cu_seqlens
from backends.model.config import ModelConfig
from backends.model.llama import AttentionFn, LlamaModel, init_weights

__all__ = ["ValueModel", "VALUE_HEAD", "value_head_weights"]

#: the value head's parameter names (everything else is the decoder's, in the Hugging Face layout)
VALUE_HEAD = ("value_head.weight", "value_head.bias")


def value_head_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The value head's initial weights (CPU, fp32): normal(0, init_std) from its own stream of ``seed``, bias 0.
    Drawn apart from the decoder, so a decoder loaded from a checkpoint gets the same head as a seeded one."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed) * 1_000_003 + 17)
    weight = torch.randn(1, cfg.hidden_size, generator=gen, dtype=torch.float32) * cfg.init_std
    return {"value_head.weight": weight, "value_head.bias": torch.zeros(1)}


class ValueModel(LlamaModel):
    """Decoder + ``value_head`` (Linear hidden -> 1, with bias): ``forward(ids[T], pos[T], cu[n+1]) -> values [T]``.

    An untied ``lm_head`` is not built (it would hold parameters that never get a gradient); a tied model keeps its
    embedding, which the decoder uses anyway.

    Example::

        critic = ValueModel.from_seed(ModelConfig(), seed=0)
        values = critic(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]), torch.tensor([0, 3], dtype=torch.int32))
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        if hasattr(self, "lm_head"):
            del self.lm_head
        self.value_head = nn.Linear(cfg.hidden_size, 1, bias=True)

    @classmethod
    def from_seed(cls, cfg: ModelConfig, seed: int, device: torch.device | str | None = None) -> "ValueModel":
        """The decoder's weights are the policy's for the same seed (:func:`init_weights` draws the decoder's
        parameters first, in the same order); the value head is :func:`value_head_weights`."""
        model = cls(cfg)
        init_weights(model, seed)
        with torch.no_grad():
            for name, t in value_head_weights(cfg, seed).items():
                model.get_parameter(name).copy_(t)
        return model.to(device) if device is not None else model

    def output_weight(self) -> torch.Tensor:
        raise AttributeError("a ValueModel has no output projection; its value head is value_head")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                attention: AttentionFn | None = None, logits_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Values [T] (fp32), or [len(logits_positions)] at just those packed positions."""
        if attention is None and input_ids.dim() == 1:
            check_cu_seqlens(cu_seqlens, input_ids.shape[0])
        h = self.hidden_states(input_ids, position_ids, cu_seqlens, attention)
        if logits_positions is not None:
            h = h.index_select(0, logits_positions.to(h.device))
        # a fresh tensor, not a view of [T, 1]: FSDP's pre-backward hook must not sit on a view
        return torch.addmv(self.value_head.bias.to(h.dtype), h, self.value_head.weight[0].to(h.dtype)).float()
