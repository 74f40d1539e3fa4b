"""The generative judge: a frozen causal LM in a rollout engine of its own (``rollout.engine``'s kind), on each
rank that holds trajectories, answering ``reward.judge.template`` for each of them; the parsed answers are written
as ``rm_judge_scores`` (the ``rm_scores`` contract) and combined with the other scores in the advantage stage.

The judge has its own engine and event loop rather than the policy's: in colocate_async the policy's engine is
paused while the step trains (its sessions wait for the new weights), and a policy judging itself with the weights
it is being trained on would reward its own habits. ``reward.judge.hf_path`` unset judges with a frozen copy of the
policy's starting checkpoint.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from backends.rollout import build_rollout_engine
from protocol.algos.judge import (JudgeError, judge_folder, judge_outcome, judge_tokenizer_source, prompt_text,
                                  render_judge_prompt)
from protocol.algos.reward import RewardInput
from protocol.rollout.tokenizer import load_tokenizer
from protocol.store.keys import uid_of
from rldispatch.config import RunConfig
from rldispatch.rollout import run_to_end

__all__ = ["JUDGE_FIELD", "JudgeRole", "JudgeResult"]

#: the store field of the judge's scores (beside the rule-based ``rm_scores``)
JUDGE_FIELD = "rm_judge_scores"


@dataclass
class JudgeResult:
    """Per trajectory: the score (float32; 0 for padding samples), the failure (None, ``no_score`` or
    ``out_of_range``) and the judge's answer text (None for padding samples)."""

    scores: torch.Tensor
    failures: list[str | None] = field(default_factory=list)
    answers: list[str | None] = field(default_factory=list)


class JudgeRole:
    """The judge's engine on a rank that holds trajectories; :meth:`judge` scores a list of them."""

    def __init__(self, cfg: RunConfig, decode: Callable[[list[int]], str], *, device: Any, rank: int):
        from backends.model.hf import convert_hf_state_dict, read_hf_config, read_weight_files

        self.cfg, self.jc, self.decode, self.rank = cfg, cfg.reward.judge, decode, rank
        path = judge_folder(self.jc, cfg.model.hf_path)
        self.model_cfg = read_hf_config(path)
        self.tokenizer = load_tokenizer(judge_tokenizer_source(path, cfg.data.tokenizer, cfg.model.hf_path))
        self.engine = build_rollout_engine(cfg.rollout.engine, self.model_cfg, self.tokenizer, device=device,
                                           seed=cfg.trainer.seed, rank=rank, options=cfg.rollout)
        self.engine.load_weights(convert_hf_state_dict(read_weight_files(path), self.model_cfg), version=0)
        self.loop = asyncio.new_event_loop()
        self.params = {"temperature": self.jc.temperature, "top_p": 1.0, "max_tokens": self.jc.max_tokens}

    def prompt_ids(self, item: RewardInput, raw_prompt: Any) -> list[int]:
        """The judge's prompt tokens for one trajectory (too long for the judge: an error naming the key)."""
        text = render_judge_prompt(self.jc.template, prompt_text(raw_prompt), self.decode(item.response_ids),
                                   item.ground_truth)
        # the config check made sure a chat template, when asked for, renders
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True) \
            if self.jc.chat_template else self.tokenizer.encode(text)
        limit = self.model_cfg.max_position_embeddings
        if len(ids) + self.jc.max_tokens > limit:
            raise JudgeError(f"trajectory {item.key}: the judge prompt has {len(ids)} tokens, + reward.judge."
                             f"max_tokens={self.jc.max_tokens} exceeds the judge's max_position_embeddings={limit}; "
                             "shorten reward.judge.template or data.max_response_length (nothing is cut)")
        return list(ids)

    def judge(self, items: Sequence[RewardInput], rows_by_uid: dict[str, dict], step: int) -> JudgeResult:
        """Every non-padding trajectory's answer and score; requests go to the engine together (it batches)."""
        real = [i for i, item in enumerate(items) if not item.is_padding]
        prompts = [self.prompt_ids(items[i], rows_by_uid[uid_of(items[i].key)]["raw_prompt"]) for i in real]
        # one sampling stream per step and rank: a resumed run asks the same questions with the same draws
        self.engine.reseed(self.cfg.trainer.seed * 7919 + 2 * step + 1, rank=self.rank)

        async def ask() -> list[Any]:
            return await asyncio.gather(*[self.engine.agenerate(p, self.params) for p in prompts])

        generated = run_to_end(self.loop, ask()) if prompts else []
        scores = torch.zeros(len(items))
        failures: list[str | None] = [None] * len(items)
        answers: list[str | None] = [None] * len(items)
        for i, gen in zip(real, generated):
            answers[i] = self.tokenizer.decode(list(gen[0]), skip_special=True)  # the text a reader sees
            try:
                scores[i], failures[i] = judge_outcome(answers[i], self.jc)
            except JudgeError as exc:
                raise JudgeError(f"trajectory {items[i].key}: {exc}") from None
        return JudgeResult(scores, failures, answers)

    def close(self) -> None:
        self.engine.close()
        self.loop.close()
