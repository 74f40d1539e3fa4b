"""The embedded sampler: the project's own decoder as a :class:`~backends.rollout.engine.RolloutEngine`, batching
concurrent async requests on the caller's event loop. For tiny CPU runs and tests; an inference engine takes its
place behind the same verbs."""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from backends.model.config import ModelConfig
from backends.model.generate import generate as batched_generate
from backends.model.llama import LlamaModel
from backends.model.lora import is_adapter_name, merge_adapters
from backends.rollout.engine import (RolloutError, SamplingParams, check_fits, check_prompt, engine_stop_ids,
                                     register_rollout_engine)
from protocol.rollout.agent_loop.base import Generated

__all__ = ["EmbeddedEngine"]


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future
    images: tuple[torch.Tensor, torch.Tensor] | None = None  # (pixel_values, image_grid_thw) of the prompt


class EmbeddedEngine:
    """The embedded sampler: a local copy of the policy (the project's decoder) behind the :class:`RolloutEngine`
    verbs, for tiny CPU runs and tests. ``agenerate`` batches concurrent requests; ``generate`` / ``generate_batch``
    sample synchronously.

    Sampling draws from one per-worker generator seeded by ``(seed, rank)``, so a run is reproducible for a
    fixed request order. The model starts from ``LlamaModel.from_seed(model_cfg, init_seed)``; with
    ``model_cfg.hf_path`` set it starts uninitialised (no full random init of a large model on every rank) and
    refuses to generate before the first :meth:`load_weights`. Weights are pushed with :meth:`load_weights` after
    every actor update.

    Example::

        engine = EmbeddedEngine(ModelConfig(), CharTokenizer(), seed=0)
        ids, logprobs = engine.generate(tok.apply_chat_template(msgs), {"temperature": 1.0, "max_tokens": 8})
    """

    def __init__(self, model_cfg: Any, tokenizer: Any, device: str | torch.device = "cpu", seed: int = 0,
                 rank: int = 0, max_batch_size: int | None = None, init_seed: int = 0):
        from backends.model.vision import VLConfig, VLModel

        self.vl = model_cfg if isinstance(model_cfg, VLConfig) else None  # a vision-language policy
        if self.vl is not None:
            model_cfg = self.vl.text
        if not isinstance(model_cfg, ModelConfig):
            raise RolloutError(f"model_cfg must be a ModelConfig or a VLConfig, got {type(model_cfg).__name__}")
        self.stop_token_ids = engine_stop_ids(model_cfg, tokenizer)
        if max_batch_size is not None and max_batch_size < 1:
            raise RolloutError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.seed, self.rank = int(seed), int(rank)
        self.max_batch_size = max_batch_size
        # Deterministic placeholder weights until the first load_weights; the sampling seed does not change them.
        if self.vl is not None:  # weights only from load_weights (the folder's, then the trainer's)
            with torch.device("meta"):
                self.model = VLModel(self.vl)
            self.model = self.model.to_empty(device=self.device).eval()
        elif model_cfg.hf_path:  # the trainer pushes the engine's (checkpoint) weights before any rollout
            with torch.device("meta"):
                self.model = LlamaModel(model_cfg)
            self.model = self.model.to_empty(device=self.device).eval()
        else:
            self.model = LlamaModel.from_seed(model_cfg, seed=int(init_seed), device=self.device).eval()
        self._has_weights = not model_cfg.hf_path and self.vl is None
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.generator = torch.Generator(device=self.device)
        self.reseed(self.seed, self.rank)
        self.weights_version = 0
        self.batch_sizes: list[int] = []  # size of every batched generate call (for metrics and tests)
        self._pending: list[_Request] = []
        self._flusher: asyncio.Task | None = None
        self._paused = False
        self._resumed: asyncio.Event | None = None
        self._asleep = False
        self._base: dict[str, torch.Tensor] | None = None  # the last full weights, once adapters are loaded on them

    # ------------------------------------------------------------------------------------------------ state
    def reseed(self, seed: int, rank: int | None = None) -> None:
        """Restart the sampling stream from ``(seed, rank)``."""
        self.seed = int(seed)
        if rank is not None:
            self.rank = int(rank)
        self.generator.manual_seed((self.seed * 1_000_003 + self.rank) % (2**63))

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Copy full weights in the project's model layout into the rollout model (names and shapes must match)."""
        self._copy_in(state_dict, version)
        self._base = None  # adapters now apply on these

    def _copy_in(self, state_dict: Mapping[str, torch.Tensor], version: int | None) -> None:
        own = self.model.state_dict()
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise RolloutError(f"load_weights: state dict does not match the rollout model; missing {missing[:5]}"
                               f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                               f"{'...' if len(unexpected) > 5 else ''}")
        for name, t in state_dict.items():
            if tuple(t.shape) != tuple(own[name].shape):
                raise RolloutError(f"load_weights: {name} has shape {tuple(t.shape)}, the rollout model expects "
                                   f"{tuple(own[name].shape)}")
        with torch.no_grad():
            for name, t in state_dict.items():
                own[name].copy_(t.detach().to(device=own[name].device, dtype=own[name].dtype))
        self.weights_version = self.weights_version + 1 if version is None else int(version)
        self._has_weights = True

    def load_adapters(self, adapters: Mapping[str, torch.Tensor], scale: float, version: int | None = None) -> None:
        """LoRA adapters (``<module>.lora_A`` / ``.lora_B`` pairs) on the last full weights: every adapted weight
        becomes ``W + scale * B @ A``; loading other adapters later replaces these (they never stack)."""
        bad = sorted(n for n in adapters if not is_adapter_name(n))
        if bad:
            raise RolloutError(f"load_adapters: {bad[:5]} are not adapter names (<module>.lora_A / .lora_B)")
        if not self._has_weights:
            raise RolloutError("load_adapters: the engine has no full weights to apply adapters on; call "
                               "load_weights first")
        if self._base is None:
            self._base = self.get_weights()
        try:
            merged = merge_adapters({**self._base, **adapters}, float(scale))
        except KeyError as exc:
            raise RolloutError(f"load_adapters: {exc.args[0]}") from None
        self._copy_in(merged, version)

    def weight_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype each weight is held in (a sender casts to these)."""
        return {name: t.dtype for name, t in self.model.state_dict().items()}

    def pause(self) -> None:
        """No new batch starts until :meth:`resume`; a request waits with its tokens so far (the partial rollout
        chunks of a response are separate requests)."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        if self._resumed is not None:
            self._resumed.set()

    def sleep(self) -> None:
        """Release the accelerator memory generation holds: the weights move to the CPU until :meth:`wake` (on a
        CPU engine nothing is held besides the weights, so nothing moves). Generating while asleep is an error."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = True

    def wake(self) -> None:
        if self.device.type != "cpu":
            self.model.to(self.device)
        self._asleep = False

    def close(self) -> None:
        """Nothing to release: the model is this process's memory."""

    def get_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the rollout weights (for checks that the sync happened)."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    # ------------------------------------------------------------------------------------------- sampling
    def generate_batch(self, prompts: Sequence[Sequence[int]],
                       sampling_params: SamplingParams | Mapping[str, Any] | None = None,
                       images: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
                       ) -> list[tuple[list[int], list[float]]]:
        """Sample every prompt in one batched generation; return ``(token_ids, logprobs)`` per prompt, in order.
        ``images``: a vision-language policy's ``(pixel_values, image_grid_thw)`` per prompt (None: no image)."""
        if self._paused:
            raise RolloutError("the rollout engine is paused; resume() it before generating")
        params = SamplingParams.from_any(sampling_params)
        checked = [check_prompt(p, self.model_cfg.vocab_size, f"prompt {i}") for i, p in enumerate(prompts)]
        for i, p in enumerate(checked):
            check_fits(p, params, self.model_cfg.max_position_embeddings, f"prompt {i}")
        images = list(images) if images is not None else [None] * len(checked)
        if len(images) != len(checked):
            raise RolloutError(f"generate_batch: {len(images)} image entries for {len(checked)} prompts")
        if not checked:
            return []
        return self._run([_Request(p, params, None, self._checked_images(im))  # type: ignore[arg-type]
                          for p, im in zip(checked, images)])

    def _checked_images(self, images: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        if images is None:
            return None
        if self.vl is None:
            raise RolloutError("images given to a rollout engine whose model has no vision tower")
        return images

    def generate(self, prompt_ids: Sequence[int],
                 sampling_params: SamplingParams | Mapping[str, Any] | None = None) -> tuple[list[int], list[float]]:
        """Sample one response: ``(token_ids, logprobs)``; the eos token, when produced, ends the list."""
        return self.generate_batch([prompt_ids], sampling_params)[0]

    def __call__(self, prompt_ids: Sequence[int], sampling_params: Any = None) -> tuple[list[int], list[float]]:
        return self.generate(prompt_ids, sampling_params)

    def _run(self, requests: list[_Request]) -> list[tuple[list[int], list[float]]]:
        """Generate for requests grouped by (temperature, top_p), each group in chunks of ``max_batch_size``."""
        if self._asleep:
            raise RolloutError("the rollout engine is asleep (sleep() was called); wake() it before generating")
        if not self._has_weights:
            raise RolloutError(f"the rollout model of model.hf_path={self.model_cfg.hf_path!r} has no weights yet; "
                               f"call load_weights (the engine's weights) before generating")
        results: list[tuple[list[int], list[float]] | None] = [None] * len(requests)
        groups: dict[tuple[float, float], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((float(r.params.temperature), float(r.params.top_p)), []).append(i)
        for (temperature, top_p), idx in groups.items():
            step = self.max_batch_size or len(idx)
            for start in range(0, len(idx), step):
                chunk = idx[start:start + step]
                max_new = max(requests[i].params.max_tokens for i in chunk)
                self.batch_sizes.append(len(chunk))
                images = [requests[i].images for i in chunk] if self.vl is not None else None
                toks, lps = batched_generate(self.model, [requests[i].prompt for i in chunk], max_new_tokens=max_new,
                                             temperature=temperature, top_p=top_p,
                                             eos_token_id=self.stop_token_ids, generator=self.generator,
                                             images=images)
                for i, t, lp in zip(chunk, toks, lps):
                    m = requests[i].params.max_tokens  # a shorter budget is a prefix of the same sample
                    results[i] = (t[:m], lp[:m])
        return results  # type: ignore[return-value]

    # ---------------------------------------------------------------------------------------------- async
    async def agenerate(self, prompt_ids: Sequence[int],
                        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
                        images: tuple[torch.Tensor, torch.Tensor] | None = None) -> Generated:
        """Sample one request on the running event loop: ``(token_ids, logprobs)`` with ``versions`` = the weight
        version that generated them (read when the batch ran). ``images``: a vision-language policy's
        ``(pixel_values, image_grid_thw)`` of the prompt.

        Requests that arrive while the event loop is busy are sampled as one batch. The batch is cut once the loop
        has had a tick in which no new request arrived, so every session that is ready to generate joins it; batch
        composition (and thus the samples) is deterministic for a fixed order of requests. While the engine is
        paused no batch starts; requests wait, and run with whatever weights are loaded when it resumes.
        """
        params = SamplingParams.from_any(sampling_params)
        prompt = check_prompt(prompt_ids, self.model_cfg.vocab_size, "agenerate")
        check_fits(prompt, params, self.model_cfg.max_position_embeddings, "agenerate")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append(_Request(prompt, params, fut, self._checked_images(images)))
        if self._flusher is None or self._flusher.done() or self._flusher.get_loop() is not loop:
            self._flusher = loop.create_task(self._flush_loop())
        toks, lps, version = await fut
        return Generated(toks, lps, (version,))

    async def _flush_loop(self) -> None:
        while self._pending:
            if self._paused:  # a batch starts only while the engine runs
                self._resumed = asyncio.Event()
                await self._resumed.wait()
                continue
            seen = -1
            while seen != len(self._pending):  # let every ready coroutine submit before cutting the batch
                seen = len(self._pending)
                await asyncio.sleep(0)
            if self._paused:
                continue
            batch, self._pending = self._pending, []
            live = [r for r in batch if not r.future.done()]  # a cancelled caller drops its request
            if not live:
                continue
            try:
                results = self._run(live)
            except Exception as exc:  # every waiter of the failed batch sees the error
                for r in live:
                    if not r.future.done():
                        r.future.set_exception(exc)
                continue
            version = self.weights_version
            for r, res in zip(live, results):
                if not r.future.done():
                    r.future.set_result((*res, version))


@register_rollout_engine("embedded")
def _build(model_cfg: ModelConfig, tokenizer: Any, *, device: str | torch.device = "cpu", seed: int = 0,
           rank: int = 0, generates: bool = True, options: Any = None) -> EmbeddedEngine:
    return EmbeddedEngine(model_cfg, tokenizer, device=device, seed=seed, rank=rank)
