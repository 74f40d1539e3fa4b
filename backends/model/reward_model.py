"""A discriminative reward model: the project's decoder with transformers' sequence-classification ``score`` head.

A Hugging Face ``{Llama,Mistral,Qwen2,Qwen3}ForSequenceClassification`` folder with one label holds the decoder
under ``model.*`` and ``score.weight`` [1, hidden] (no bias, no ``lm_head``). The score of a sequence is the head
applied to the final-norm hidden state of its **last token** — the position transformers reads for an unpadded
sequence, and the last attended token the reference system's reward-model worker reads. (transformers, given a
right-padded batch, reads the last token whose id is not ``pad_token_id``; for a sequence that ends in tokens equal
to the pad id, such as an EOS that doubles as the pad token, the two differ. The project packs sequences without
pad tokens, so every token it is given is read as content.)
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from backends.model.attention import check_cu_seqlens
from backends.model.config import ModelConfig
from backends.model.hf import HFCheckpointError, check_weights, read_hf_config, read_weight_files
from backends.model.llama import AttentionFn, LlamaModel, parameter_shapes

__all__ = ["RewardModel", "RewardModelError", "SCORE_HEAD", "read_reward_config", "reward_state_dict",
           "load_reward_model", "last_token_positions", "chat_input_ids"]

#: the classification head's parameter name (in the Hugging Face folder and in the model)
SCORE_HEAD = "score.weight"
_KEY = "reward.model.hf_path"


class RewardModelError(HFCheckpointError):
    """The reward model folder cannot be used; the message names ``reward.model.hf_path`` and what was expected."""


def last_token_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Packed index of each sequence's last token (``cu[1:] - 1``); an empty sequence has none and is refused."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    if bool((lens <= 0).any()):
        raise ValueError(f"a reward model scores non-empty sequences; got lengths {lens.tolist()}")
    return (cu_seqlens[1:] - 1).long()


class RewardModel(LlamaModel):
    """Decoder + ``score`` (Linear hidden -> 1, no bias): ``forward(ids[T], pos[T], cu[n+1]) -> scores [n]`` (fp32),
    each read at its sequence's last token. No ``lm_head`` is built."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        if hasattr(self, "lm_head"):
            del self.lm_head
        self.score = nn.Linear(cfg.hidden_size, 1, bias=False)

    def output_weight(self) -> torch.Tensor:
        raise AttributeError("a RewardModel has no output projection; its head is score")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                attention: AttentionFn | None = None, logits_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Scores [n] at each sequence's last token, or at ``logits_positions`` (packed indices) when given; with
        ``attention`` (sequence parallel: this rank's slice of the tokens) the head's value at every local token."""
        if attention is None and input_ids.dim() == 1:
            check_cu_seqlens(cu_seqlens, input_ids.shape[0])
        h = self.hidden_states(input_ids, position_ids, cu_seqlens, attention)
        if attention is None or logits_positions is not None:
            idx = last_token_positions(cu_seqlens) if logits_positions is None else logits_positions
            h = h.index_select(0, idx.to(h.device))
        return torch.mv(h, self.score.weight[0].to(h.dtype)).float()


def chat_input_ids(tokenizer: Any, raw_prompt: Any, response: str) -> list[int]:
    """The reward model's own token ids of one trajectory: the prompt's chat messages (a string is one user
    message) and the decoded response as the assistant's message, rendered with ``tokenizer``'s chat template (the
    reference system's re-tokenization for a reward model whose template or vocabulary is not the policy's)."""
    if isinstance(raw_prompt, str):
        messages = [{"role": "user", "content": raw_prompt}]
    elif isinstance(raw_prompt, Sequence) and all(isinstance(m, Mapping) and "role" in m for m in raw_prompt):
        messages = [dict(m) for m in raw_prompt]
    else:
        raise RewardModelError(f"reward.model.retokenize needs each row's raw_prompt as a string or chat messages, "
                               f"got {type(raw_prompt).__name__}")
    return list(tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}],
                                              add_generation_prompt=False))


def read_reward_config(path: str) -> ModelConfig:
    """The decoder config of a sequence-classification folder; a folder that is not one is refused, naming the key."""
    if not path or not os.path.isdir(path):
        raise RewardModelError(f"{_KEY}={path!r} is not a folder (a local Hugging Face sequence-classification "
                               f"checkpoint is needed; nothing is downloaded)")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise RewardModelError(f"{_KEY}={path!r} has no config.json")
    with open(cfg_file) as fh:
        raw = json.load(fh)
    archs = raw.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise RewardModelError(f"{_KEY}={path!r} is a {archs or 'model without architectures'}, not a "
                               f"*ForSequenceClassification checkpoint (a causal LM has no score head); give a "
                               f"reward model folder")
    labels = raw.get("num_labels", len(raw.get("id2label") or {0: "LABEL_0"}))
    if int(labels) != 1:
        raise RewardModelError(f"{_KEY}={path!r} has num_labels={labels}; a reward model gives one score per "
                               f"sequence (num_labels=1)")
    try:
        return read_hf_config(path)
    except HFCheckpointError as exc:
        raise RewardModelError(f"{_KEY}={path!r}: {exc}") from exc


def reward_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face sequence-classification weight names to :class:`RewardModel`'s; a missing, unexpected or
    misshapen weight is an error naming it."""
    out = {}
    for name, t in sd.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        out[name[len("model."):] if name.startswith("model.") else name] = t
    want = {n: s for n, s in parameter_shapes(cfg).items() if n != "lm_head.weight"}
    want[SCORE_HEAD] = (1, cfg.hidden_size)
    check_weights(out, want, f"{_KEY}'s one-label {cfg.model_type} sequence classifier", RewardModelError)
    return out


def load_reward_model(path: str, dtype: torch.dtype = torch.float32) -> RewardModel:
    """A :class:`RewardModel` with the weights of the sequence-classification folder ``path`` (one process)."""
    cfg = read_reward_config(path)
    sd = reward_state_dict(read_weight_files(path), cfg)
    model = RewardModel(cfg)
    model.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()}, strict=True)
    return model.to(dtype).eval().requires_grad_(False)
