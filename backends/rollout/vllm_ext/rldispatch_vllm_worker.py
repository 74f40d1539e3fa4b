"""Runs inside a vLLM worker process (the engine's own environment, which need not hold this project): the verbs the
trainer calls through vLLM's ``collective_rpc``. Imports only torch, safetensors and vLLM."""
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
        self._repack_embedding_heads()
        return time.perf_counter() - t0

    def _repack_embedding_heads(self) -> None:
        """On the CPU an output head is a GEMM over a packed copy of its weight, made when it was loaded. A head tied
        to the input embedding is never loaded itself (its weight is the embedding's), so the in-place reload leaves
        its packed copy at the start-up weights: pack every embedding-method layer again from its weight now."""
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod) and hasattr(module, "cpu_linear"):
                method.process_weights_after_loading(module)
