"""Runs inside a vLLM worker process (the engine's own environment, which need not hold this project): the verbs the
trainer calls through vLLM's ``collective_rpc``. Imports only torch and safetensors."""
from __future__ import annotations

import time


class WeightSync:
    """vLLM worker extension (``--worker-extension-cls rldispatch_vllm_worker.WeightSync``): new weights from a
    safetensors file the trainer wrote (in shared memory), through vLLM's in-place ``reload_weights`` (which repacks
    the CPU backend's linear weights, where ``load_weights`` alone cannot)."""

    def rldispatch_load(self, path: str) -> float:
        """Load every tensor of the safetensors file ``path`` (Hugging Face names); the seconds it took."""
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        weights = load_file(path)  # reload_weights moves them to the engine's device
        self.reload_weights(weights_iterator=iter(weights.items()))
        return time.perf_counter() - t0
