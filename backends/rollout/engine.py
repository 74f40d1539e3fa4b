"""The rollout-engine interface: what the agent loops and schedules may ask of whatever generates the responses.

A handful of verbs, as an inference server's RL interface has them: token ids in, token ids and the sampled tokens'
log-probs out (multi-turn loops never re-tokenize); pause and resume of running requests (partial rollout keeps
their tokens); new weights in (full, or adapters on the last full weights); sleep and wake for colocation. The
embedded sampler (:mod:`backends.rollout.embedded`) is the first implementation; an inference engine takes its place
by implementing the same verbs and registering a builder under its ``rollout.engine`` name.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from protocol.rollout.agent_loop.base import Generated
from protocol.rollout.tokenizer import (TokenizerError, VocabularyError, check_vocab_fits, generation_stop_ids,
                                        stop_token_ids)

__all__ = ["RolloutError", "SamplingParams", "RolloutEngine", "register_rollout_engine", "ENGINES", "engine_stop_ids",
           "check_prompt", "check_fits"]


class RolloutError(ValueError):
    """Bad sampling parameters, prompts or weights given to a rollout engine; the message names the value."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled, with one meaning across engines: ``temperature`` (0 = greedy), nucleus
    ``top_p``, at most ``max_tokens`` tokens.

    Generation also stops after any of the engine's stop tokens (the tokenizer's EOS and the checkpoint's
    generation_config.json EOS ids), which is kept as the last response token.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise RolloutError(f"sampling temperature must be a number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise RolloutError(f"sampling top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RolloutError(f"sampling max_tokens must be an integer >= 1, got {self.max_tokens!r}")

    @classmethod
    def from_any(cls, params: "SamplingParams | Mapping[str, Any] | None") -> "SamplingParams":
        """Accept a SamplingParams, a mapping (``max_new_tokens`` is an alias of ``max_tokens``) or None."""
        if params is None:
            return cls()
        if isinstance(params, cls):
            return params
        if not isinstance(params, Mapping):
            raise RolloutError(f"sampling_params must be a SamplingParams or a mapping, got {type(params).__name__}")
        d = dict(params)
        if "max_new_tokens" in d:
            if "max_tokens" in d and d["max_tokens"] != d["max_new_tokens"]:
                raise RolloutError(f"sampling_params: max_tokens={d['max_tokens']!r} and max_new_tokens="
                                   f"{d['max_new_tokens']!r} disagree; give one")
            d["max_tokens"] = d.pop("max_new_tokens")
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - valid)
        if unknown:
            raise RolloutError(f"unknown sampling parameter(s) {unknown}; valid: {sorted(valid)} (+ max_new_tokens)")
        return cls(**d)


@runtime_checkable
class RolloutEngine(Protocol):
    """What generates responses for the agent loops. Every verb is called from the trainer's process; an engine
    may serve the requests in-process, from a server, or on other machines.

    * ``agenerate``: one request, token ids in; a :class:`Generated` out (token ids, the sampled tokens'
      log-probs at the request's temperature, and the weight version that produced them). Requests that arrive
      together may be batched. ``images``: a vision-language policy's ``(pixel_values, image_grid_thw)`` of the
      prompt (an engine without a vision tower refuses them).
    * ``pause`` / ``resume``: requests wait at their next token boundary while paused (a weight sync in between
      makes the rest of a response use the new weights); nothing is lost.
    * ``load_weights``: full weights in the trainer's model layout, tagged with a version (the step they serve);
      ``load_adapters``: LoRA adapters applied on the last full weights (``W + scale * B @ A``).
    * ``sleep`` / ``wake``: release the memory generation holds while the trainer works, and take it back.
    * ``reseed``: restart the sampling stream (the same requests in the same order then draw the same tokens).
    * ``close``: release what the engine holds (a server process, temporary files).
    """

    stop_token_ids: frozenset[int]
    weights_version: int

    async def agenerate(self, prompt_ids: Sequence[int],
                        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
                        images: Any = None) -> Generated: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int | None = None) -> None: ...

    def load_adapters(self, adapters: Mapping[str, torch.Tensor], scale: float, version: int | None = None
                      ) -> None: ...

    def weight_dtypes(self) -> dict[str, torch.dtype]: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def reseed(self, seed: int, rank: int | None = None) -> None: ...

    def close(self) -> None: ...


def engine_stop_ids(model_cfg: Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end a response: the tokenizer's own stop ids plus the checkpoint's generation_config.json EOS
    ids, each checked to be a row of the model's embedding."""
    if getattr(tokenizer, "vocab_size", None) is None or getattr(tokenizer, "eos_token_id", None) is None:
        raise RolloutError("tokenizer must provide vocab_size and eos_token_id")
    try:
        stops = stop_token_ids(tokenizer) | generation_stop_ids(model_cfg.hf_path)
        check_vocab_fits(tokenizer, model_cfg.vocab_size)
        outside = sorted(i for i in stops if i >= model_cfg.vocab_size)
        if outside:
            raise VocabularyError(f"stop token ids {outside} of {model_cfg.hf_path}/generation_config.json are "
                                  f"outside the model's {model_cfg.vocab_size} embedding rows")
    except (TokenizerError, VocabularyError) as exc:
        raise RolloutError(str(exc)) from exc
    return stops


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, where: str) -> list[int]:
    """``prompt_ids`` as a list of ints in ``[0, vocab_size)``; anything else is an error naming ``where``."""
    if hasattr(prompt_ids, "tolist"):
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
        raise RolloutError(f"{where}: prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}")
    ids = list(prompt_ids)
    if not ids:
        raise RolloutError(f"{where}: prompt_ids is empty; a prompt needs at least one token")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise RolloutError(f"{where}: prompt token {i} is {t!r}, expected an int in [0, {vocab_size})")
    return ids


def check_fits(prompt: Sequence[int], params: SamplingParams, limit: int, where: str) -> None:
    """The prompt and its longest response fit ``limit`` (model.max_position_embeddings) positions."""
    if len(prompt) + params.max_tokens > limit:
        raise RolloutError(f"{where}: prompt_len {len(prompt)} + max_tokens {params.max_tokens} exceeds "
                           f"model.max_position_embeddings {limit}")


#: rollout.engine name -> builder(model_cfg, tokenizer, *, device, seed, rank, generates, options) -> RolloutEngine;
#: ``generates`` is false on a rank that never generates (it only follows the weight versions); ``options`` is
#: the run's ``rollout`` config section (an engine reads its own subsection)
ENGINES: dict[str, Callable[..., RolloutEngine]] = {}


def register_rollout_engine(name: str) -> Callable[[Callable[..., RolloutEngine]], Callable[..., RolloutEngine]]:
    """Register a builder of :class:`RolloutEngine` under ``rollout.engine`` name ``name``."""
    def add(builder: Callable[..., RolloutEngine]) -> Callable[..., RolloutEngine]:
        if name in ENGINES:
            raise ValueError(f"rollout engine {name!r} is registered twice")
        ENGINES[name] = builder
        return builder
    return add
