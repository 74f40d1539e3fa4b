"""Partial rollout on any rollout engine: a response generated a chunk of tokens at a time, each chunk tagged with
the weight version that produced it."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from backends.rollout.engine import RolloutEngine, RolloutError, SamplingParams
from protocol.rollout.agent_loop.base import Generated

__all__ = ["VersionedGenerate"]


class VersionedGenerate:
    """The agent loop's ``generate``: a :class:`Generated` tagged with the weight versions that produced it.

    With ``chunk`` (partial rollout) a response is generated ``chunk`` tokens at a time, each chunk a new request
    that continues the prompt and the tokens so far; between chunks the session waits on the event loop, so a
    weight sync that happens meanwhile makes the next chunk use the new weights. The tokens and log-probs of
    earlier chunks are kept. Without ``chunk`` a response is one request: one version.
    """

    def __init__(self, engine: RolloutEngine, chunk: int | None = None):
        if chunk is not None and chunk < 1:
            raise RolloutError(f"partial rollout chunk must be >= 1 token, got {chunk}")
        self.engine, self.chunk = engine, chunk

    async def __call__(self, prompt_ids: Sequence[int], sampling_params: Any = None, images: Any = None
                       ) -> Generated:
        """``images``: the prompt's (pixel_values, image_grid_thw) for a vision-language policy; every chunk's
        request carries them (it continues the same prompt)."""
        params = SamplingParams.from_any(sampling_params)
        extra = {} if images is None else {"images": images}
        if self.chunk is None or self.chunk >= params.max_tokens:
            return await self.engine.agenerate(prompt_ids, params, **extra)
        prompt = list(prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids)
        toks: list[int] = []
        lps: list[float] = []
        versions: list[int] = []
        stops = self.engine.stop_token_ids
        while len(toks) < params.max_tokens:
            want = min(self.chunk, params.max_tokens - len(toks))
            part = await self.engine.agenerate(prompt + toks, dataclasses.replace(params, max_tokens=want), **extra)
            toks.extend(part[0])
            lps.extend(part[1])
            versions.extend(part.versions)
            if len(part[0]) < want or (part[0] and part[0][-1] in stops):
                break
        return Generated(toks, lps, versions)
