"""SingleTurnAgentLoop: one generation, every response token a policy token."""
from __future__ import annotations

from typing import Any, Mapping

from protocol.rollout.agent_loop.base import AgentLoop, call_generate, register_agent_loop
from protocol.rollout.agent_loop.output import AgentLoopOutput

__all__ = ["SingleTurnAgentLoop"]


@register_agent_loop("single_turn")
class SingleTurnAgentLoop(AgentLoop):
    """Generate once from the prompt; ``response_mask`` is all ones.

    ``max_tokens`` passed to ``generate`` is ``min(sampling_params['max_tokens'], max_response_length)``; a
    generator that returns more tokens than that is cut to ``max_response_length`` and the cut is reported in
    ``extra_fields`` (``truncated``, ``truncated_tokens``).
    """

    async def run(self, prompt: Any, sampling_params: Mapping[str, Any] | None = None, images: Any = None,
                  **kwargs: Any) -> list[AgentLoopOutput]:
        """``images``: a vision-language prompt's ``(pixel_values, image_grid_thw)``, given to ``generate`` (the
        group stores them once, on its prompt key: :class:`~protocol.rollout.agent_loop.group.PromptInputs`)."""
        sampling_params = dict(sampling_params or {})
        prompt_ids = self.prompt_to_ids(prompt)
        sampling_params["max_tokens"] = self._max_tokens(sampling_params, self.max_response_length)
        token_ids, logprobs = await call_generate(self.generate, prompt_ids, sampling_params, images)
        extra: dict[str, Any] = {"truncated": False, "truncated_tokens": 0, "stop_reason": "generation"}
        if len(token_ids) > self.max_response_length:
            extra.update(truncated=True, truncated_tokens=len(token_ids) - self.max_response_length,
                         truncated_kind="generation", stop_reason="max_response_length")
            token_ids = token_ids[: self.max_response_length]
            logprobs = None if logprobs is None else logprobs[: self.max_response_length]
        return [AgentLoopOutput(prompt_ids=prompt_ids, response_ids=token_ids, response_mask=[1] * len(token_ids),
                                response_logprobs=logprobs, num_turns=2, extra_fields=extra)]
