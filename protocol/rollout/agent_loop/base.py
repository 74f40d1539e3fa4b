"""The AgentLoop interface, the adapter that calls any sync or async ``generate``, and the agent-loop registry."""
from __future__ import annotations

import abc
import contextvars
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Awaitable, Callable, Union

import torch

from protocol.checks import FLOAT, only_types
from protocol.rollout.agent_loop.output import AgentLoopOutput, non_ints
from protocol.registry import Registry
from protocol.store.meta import copy_tag

__all__ = [
    "GenerateFn",
    "GenerateError",
    "AgentLoop",
    "call_generate",
    "register_agent_loop",
    "get_agent_loop_class",
    "known_agent_loops",
    "build_agent_loop",
    "Generated",
    "session_versions",
]

#: ``generate(prompt_ids, sampling_params) -> (token_ids, logprobs | None)``, a plain or an ``async`` function.
GenerateFn = Callable[[list, dict], Union[tuple, Awaitable[tuple]]]


#: The weight versions of every chunk generated in the current session (set per session by the group runner; a
#: ``generate`` that returns a :class:`Generated` with ``versions`` adds to it).
session_versions: contextvars.ContextVar[list | None] = contextvars.ContextVar("session_versions", default=None)


class Generated(tuple):
    """``(token_ids, logprobs)`` plus the weight ``versions`` of the chunks that produced them (partial rollout)."""

    versions: tuple[int, ...] = ()

    def __new__(cls, token_ids: Any, logprobs: Any, versions: Sequence[int] = ()) -> "Generated":
        out = super().__new__(cls, (token_ids, logprobs))
        out.versions = tuple(int(v) for v in versions)
        return out


class GenerateError(ValueError):
    """A ``generate`` callable that returned something other than ``(token_ids, logprobs | None)``."""


def _ids_list(value: Any, what: str) -> list[int]:
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise GenerateError(f"{what} must be a list of ints or a 1-D tensor, got {type(value).__name__}")
    out = list(value)
    bad = non_ints(out)
    if bad:
        raise GenerateError(f"{what} must hold ints, found {bad[:3]!r}")
    return out


async def call_generate(generate: GenerateFn, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any],
                        images: Any = None) -> tuple[list[int], list[float] | None]:
    """Call ``generate`` (sync or async) and check it returned ``(token_ids, logprobs)`` of equal lengths.

    A sync ``generate`` runs inline on the event loop (so the order of calls, hence the RNG stream, is
    deterministic); an async one is awaited, so concurrent sessions can be batched by the generator. ``images``
    (a vision-language prompt's ``(pixel_values, image_grid_thw)``) go to ``generate`` as its ``images`` keyword.
    """
    extra = {} if images is None else {"images": images}
    result = generate(list(prompt_ids), dict(sampling_params), **extra)
    if inspect.isawaitable(result):
        result = await result
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise GenerateError(f"generate must return (token_ids, logprobs), got {type(result).__name__}")
    versions, seen = getattr(result, "versions", ()), session_versions.get()
    if versions and seen is not None:
        seen.extend(versions)
    token_ids = _ids_list(result[0], "generate's token_ids")
    logprobs = result[1]
    if logprobs is not None:
        if isinstance(logprobs, torch.Tensor):
            logprobs = logprobs.reshape(-1).tolist()
        logprobs = list(logprobs)
        if not only_types(logprobs, FLOAT):
            logprobs = [float(x) for x in logprobs]
        if len(logprobs) != len(token_ids):
            raise GenerateError(f"generate returned {len(token_ids)} token ids but {len(logprobs)} log-probs")
    return token_ids, logprobs


def _is_messages(prompt: Any) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes)) and len(prompt) > 0 and \
        all(isinstance(m, Mapping) for m in prompt)


class AgentLoop(abc.ABC):
    """One rollout session: from a prompt (token ids or chat messages) to one or more AgentLoopOutputs.

    Subclasses implement :meth:`run`. ``generate`` is any callable ``(prompt_ids, sampling_params) ->
    (token_ids, logprobs)``, sync or async; ``tokenizer`` renders message prompts with its chat template.
    ``max_response_length`` caps ``response_len`` of every output (what is cut is reported in extra_fields).
    """

    name: str = "abstract"

    def __init__(self, generate: GenerateFn, tokenizer: Any = None, max_response_length: int = 1024) -> None:
        if not callable(generate):
            raise TypeError(f"{type(self).__name__}: generate must be callable, got {type(generate).__name__}")
        if isinstance(max_response_length, bool) or not isinstance(max_response_length, int) or \
                max_response_length < 1:
            raise ValueError(f"{type(self).__name__}: max_response_length must be a positive int, "
                             f"got {max_response_length!r}")
        self.generate = generate
        self.tokenizer = tokenizer
        self.max_response_length = max_response_length
        self._templated: tuple[list, list[int]] | None = None  # (a copy of the last messages, their ids)

    def prompt_to_ids(self, prompt: Any) -> list[int]:
        """Token ids of ``prompt``: ids are taken as they are, a message list goes through the chat template.

        The ``rollout.n`` sessions of a group share one prompt, so the last templated messages are remembered (a
        copy, compared by value: a list edited in place is templated again).
        """
        if isinstance(prompt, torch.Tensor):
            return _ids_list(prompt, "prompt")
        last = getattr(self, "_templated", None)  # subclasses may skip AgentLoop.__init__
        if last is not None and type(prompt) is list and prompt == last[0]:
            return list(last[1])
        if _is_messages(prompt):
            if self.tokenizer is None:
                raise ValueError(f"{type(self).__name__} got chat messages but has no tokenizer to template them")
            ids = list(self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True))
            if type(prompt) is list:
                self._templated = (copy_tag(prompt), list(ids))  # messages are JSON-shaped: no deepcopy memo
            return ids
        if isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes)):
            if not prompt:
                raise ValueError(f"{type(self).__name__}: prompt is empty (prompt_len must be >= 1)")
            return _ids_list(prompt, "prompt")
        raise TypeError(f"{type(self).__name__}: prompt must be token ids or a list of chat messages, "
                        f"got {type(prompt).__name__}")

    def _max_tokens(self, sampling_params: Mapping[str, Any], budget: int) -> int:
        requested = sampling_params.get("max_tokens", budget)
        if requested is None:
            requested = budget
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"sampling_params['max_tokens'] must be a positive int, got {requested!r}")
        return min(requested, budget)

    @abc.abstractmethod
    async def run(self, prompt: Any, sampling_params: Mapping[str, Any] | None = None, **kwargs: Any
                  ) -> list[AgentLoopOutput]:
        """Run one session on ``prompt``; ``kwargs`` carry the dataset row's extra info (e.g. ``tools_kwargs``)."""


_REGISTRY: Registry[type[AgentLoop]] = Registry("agent loop", key="rollout.agent_loop")


def _check_loop(cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
        raise TypeError(f"register_agent_loop expects an AgentLoop subclass, got {cls!r}")


def register_agent_loop(name: str) -> Callable[[type[AgentLoop]], type[AgentLoop]]:
    """Class decorator registering an AgentLoop subclass under ``name`` (config key ``rollout.agent_loop``)."""
    register = _REGISTRY.register(name, check=_check_loop)

    def deco(cls: type[AgentLoop]) -> type[AgentLoop]:
        register(cls)
        cls.name = name
        return cls

    return deco


def known_agent_loops() -> list[str]:
    """Names of the registered agent loops."""
    return _REGISTRY.names()


def get_agent_loop_class(name: str) -> type[AgentLoop]:
    """The AgentLoop class registered under ``name``; an unknown name lists the known ones."""
    return _REGISTRY.get(name)


def build_agent_loop(name: str, generate: GenerateFn, tokenizer: Any = None, **kwargs: Any) -> AgentLoop:
    """Instantiate the agent loop registered as ``name`` with ``generate``, ``tokenizer`` and its own options."""
    return get_agent_loop_class(name)(generate, tokenizer, **kwargs)
