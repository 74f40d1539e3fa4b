"""ToolAgentLoop: multi-turn tool use; policy generations have mask 1, tool observations mask 0."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from protocol.rollout.agent_loop.base import AgentLoop, GenerateFn, call_generate, register_agent_loop
from protocol.rollout.agent_loop.output import AgentLoopOutput
from protocol.rollout.agent_loop.tools import ToolCall, ToolError, ToolRegistry, builtin_tools, parse_tool_calls
from protocol.rollout.tokenizer import stop_token_ids

__all__ = ["ToolAgentLoop", "observation_ids"]

_ANCHOR = [{"role": "system", "content": ""}]


def observation_ids(tokenizer: Any, tool_messages: list[dict]) -> list[int]:
    """Tokens that the chat template appends for ``tool_messages`` plus the next assistant generation prompt.

    Computed as the difference of two renderings, so it works for any tokenizer whose template is a
    prefix-extension (the built-in char tokenizer and common chat templates).
    """
    prefix = list(tokenizer.apply_chat_template(_ANCHOR, add_generation_prompt=False))
    full = list(tokenizer.apply_chat_template(_ANCHOR + tool_messages, add_generation_prompt=True))
    if full[: len(prefix)] != prefix:
        raise ValueError("the tokenizer's chat template does not extend a conversation by appending tokens; "
                         "ToolAgentLoop cannot compute observation tokens for it")
    return full[len(prefix):]


@register_agent_loop("tool")
class ToolAgentLoop(AgentLoop):
    """Generate, run the tool calls found in the generation, append the observation, repeat.

    Each assistant turn is generated with ``max_tokens = min(sampling_params['max_tokens'], budget left)``.
    A turn's text is searched for tool calls in the format of :mod:`protocol.rollout.agent_loop.tools`; the session
    stops when a turn has no tool call, when a turn did not end with a stop token (cut by max_tokens), after
    ``max_turns`` assistant turns, or when ``max_response_length`` is reached. Tool results (or error messages
    for unknown tools, malformed calls and failing tools) are rendered as ``tool`` messages with the chat
    template and appended with mask 0 and log-prob 0. The response is cut to ``max_response_length`` with mask
    and log-probs cut alike; ``extra_fields`` reports ``truncated``, ``truncated_tokens``, ``truncated_kind``,
    ``stop_reason``, ``tool_calls``, ``tool_errors`` and ``tool_response_truncated_chars``.
    ``tools_kwargs`` passed to :meth:`run` (``{tool_name: {kwarg: value}}``, from the dataset's extra_info)
    become fixed keyword arguments of that tool.
    """

    def __init__(self, generate: GenerateFn, tokenizer: Any = None, max_response_length: int = 1024,
                 tools: ToolRegistry | None = None, max_turns: int = 4, max_parallel_calls: int = 1,
                 max_tool_response_length: int = 256) -> None:
        super().__init__(generate, tokenizer, max_response_length)
        if tokenizer is None:
            raise ValueError("ToolAgentLoop needs a tokenizer to decode generations and encode observations")
        for name, value in (("max_turns", max_turns), ("max_parallel_calls", max_parallel_calls),
                            ("max_tool_response_length", max_tool_response_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ToolAgentLoop.{name} must be a positive int, got {value!r}")
        self.tools = builtin_tools() if tools is None else tools
        self.max_turns = max_turns
        self.max_parallel_calls = max_parallel_calls
        self.max_tool_response_length = max_tool_response_length

    async def _observe(self, calls: list[ToolCall], parse_errors: list[str], tools_kwargs: Mapping[str, Any],
                       report: dict[str, Any]) -> list[dict]:
        messages = [{"role": "tool", "content": f"Error: {e}"} for e in parse_errors]
        report["tool_errors"].extend(parse_errors)
        for j, call in enumerate(calls):
            if j >= self.max_parallel_calls:  # the loop's own message, never cut
                error = f"at most {self.max_parallel_calls} tool call(s) per turn; call {j} ({call.name}) skipped"
                report["tool_errors"].append(error)
                messages.append({"role": "tool", "content": f"Error: {error}"})
                continue
            report["tool_calls"] += 1
            try:
                text = await self.tools.call(call, tools_kwargs.get(call.name))
            except ToolError as exc:
                text = f"Error: {exc}"
                report["tool_errors"].append(str(exc))
            if len(text) > self.max_tool_response_length:
                report["tool_response_truncated_chars"] += len(text) - self.max_tool_response_length
                text = text[: self.max_tool_response_length]
            messages.append({"role": "tool", "content": text})
        return messages

    async def run(self, prompt: Any, sampling_params: Mapping[str, Any] | None = None, **kwargs: Any
                  ) -> list[AgentLoopOutput]:
        sampling_params = dict(sampling_params or {})
        tools_kwargs = kwargs.get("tools_kwargs") or {}
        if not isinstance(tools_kwargs, Mapping):
            raise TypeError(f"tools_kwargs must be a mapping tool name -> kwargs, got {type(tools_kwargs).__name__}")
        prompt_ids = self.prompt_to_ids(prompt)
        stops = stop_token_ids(self.tokenizer)
        limit = self.max_response_length
        resp: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        have_lps = True
        report: dict[str, Any] = {"truncated": False, "truncated_tokens": 0, "stop_reason": "",
                                  "tool_calls": 0, "tool_errors": [], "tool_response_truncated_chars": 0}
        assistant_turns = tool_turns = 0
        last_kind = "generation"
        while True:
            budget = limit - len(resp)
            if budget <= 0:
                report["stop_reason"] = "max_response_length"
                break
            params = {**sampling_params, "max_tokens": self._max_tokens(sampling_params, budget)}
            tokens, logprobs = await call_generate(self.generate, prompt_ids + resp, params)
            assistant_turns += 1
            last_kind = "generation"
            resp += tokens
            mask += [1] * len(tokens)
            have_lps = have_lps and logprobs is not None
            lps += logprobs if logprobs is not None else [0.0] * len(tokens)
            if len(resp) >= limit:
                report["stop_reason"] = "max_response_length"
                break
            calls, parse_errors = parse_tool_calls(self.tokenizer.decode(tokens, skip_special_tokens=True))
            if not calls and not parse_errors:
                report["stop_reason"] = "no_tool_call"
                break
            if not tokens or tokens[-1] not in stops:
                report["stop_reason"] = "unfinished_turn"
                break
            if assistant_turns >= self.max_turns:
                report["stop_reason"] = "max_turns"
                break
            messages = await self._observe(calls, parse_errors, tools_kwargs, report)
            obs = observation_ids(self.tokenizer, messages)
            tool_turns += len(messages)
            last_kind = "observation"
            resp += obs
            mask += [0] * len(obs)
            lps += [0.0] * len(obs)
        if len(resp) > limit:
            report.update(truncated=True, truncated_tokens=len(resp) - limit, truncated_kind=last_kind)
            resp, mask, lps = resp[:limit], mask[:limit], lps[:limit]
        report["assistant_turns"] = assistant_turns
        return [AgentLoopOutput(prompt_ids=prompt_ids, response_ids=resp, response_mask=mask,
                                response_logprobs=lps if have_lps else None,
                                num_turns=1 + assistant_turns + tool_turns, extra_fields=report)]
