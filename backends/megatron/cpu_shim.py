"""Redirect megatron-core's device calls to the CPU when CUDA is absent, so TP/PP/DP run over gloo in tests.

megatron-core 0.16.1 assumes a GPU in a handful of places: ``torch.cuda.current_device()`` / ``synchronize()``,
the CUDA RNG tracker, tensors created with ``device="cuda"`` (pipeline schedules, p2p, optimizer, clipping) and
``Tensor.type() == "torch.cuda.FloatTensor"`` checks (gradient clipping, distributed optimizer). This module
rebinds the name ``torch`` inside megatron-core's own modules to a proxy that maps those calls to the CPU and
wraps the few type-checking functions; torch itself and every other module are left untouched.

Apply with :func:`apply_cpu_shim` (a no-op when CUDA is available); :func:`shim_applied` reports the state.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from typing import Any, Callable

import torch

__all__ = ["apply_cpu_shim", "shim_applied", "needs_cpu_shim", "patched_modules", "CPU_DEVICE"]

CPU_DEVICE = torch.device("cpu")

_FACTORIES = (
    "zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like",
)
_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
_STATE = {"applied": False, "modules": set()}
_TYPE_LOCK = threading.RLock()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _cpu_factory(fn: Callable) -> Callable:
    """``fn`` with ``device='cuda'`` (or an int device index) replaced by the CPU."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        dev = kwargs.get("device")
        if dev is not None and (_is_cuda_device(dev) or isinstance(dev, int)):
            kwargs["device"] = CPU_DEVICE
        return fn(*args, **kwargs)

    return wrapper


class _NullStream:
    """Stands in for a CUDA stream: waits and contexts do nothing on the CPU."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CpuCuda:
    """The subset of ``torch.cuda`` megatron-core calls, answered for the CPU; anything else falls through."""

    @staticmethod
    def current_device() -> torch.device:
        return CPU_DEVICE

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.default_generator.get_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device=None) -> None:
        torch.default_generator.set_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    manual_seed_all = manual_seed
    Stream = _NullStream

    @staticmethod
    def default_stream(device=None) -> _NullStream:
        return _NullStream()

    @staticmethod
    def current_stream(device=None) -> _NullStream:
        return _NullStream()

    @staticmethod
    def stream(s) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def memory_allocated(device=None) -> int:
        return 0

    max_memory_allocated = memory_allocated

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuRandom:
    """``torch.cuda.random`` for the CPU generator."""

    get_rng_state = staticmethod(_CpuCuda.get_rng_state)
    set_rng_state = staticmethod(_CpuCuda.set_rng_state)
    manual_seed = staticmethod(_CpuCuda.manual_seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda.random, name)


class _TorchProxy(types.ModuleType):
    """``torch`` as seen from inside megatron-core: factories and ``torch.cuda`` redirected to the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        cuda = _CpuCuda()
        cuda.random = _CpuRandom()  # type: ignore[attr-defined]
        self.__dict__["cuda"] = cuda
        for name in _FACTORIES:
            self.__dict__[name] = _cpu_factory(getattr(torch, name))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_PROXY = _TorchProxy()


def _cuda_type_name(self: torch.Tensor, dtype=None, non_blocking: bool = False, **kwargs):
    """``Tensor.type()`` that names CPU float tensors as their CUDA types (used only inside wrapped calls)."""
    if dtype is None and not kwargs:
        name = _ORIG_TENSOR_TYPE(self)
        return _CUDA_TYPE.get(name, name)
    return _ORIG_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


_ORIG_TENSOR_TYPE = torch.Tensor.type
_ORIG_TENSOR_CUDA = torch.Tensor.cuda


def _cuda_stays_on_cpu(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``Tensor.cuda()`` that leaves a CPU tensor where it is (used only inside wrapped calls)."""
    return self


@contextlib.contextmanager
def _cuda_type_names():
    """Within the block, ``Tensor.type()`` of CPU float tensors reads as the CUDA type megatron-core checks for and
    ``Tensor.cuda()`` is the identity."""
    with _TYPE_LOCK:
        torch.Tensor.type = _cuda_type_name
        torch.Tensor.cuda = _cuda_stays_on_cpu
        try:
            yield
        finally:
            torch.Tensor.type = _ORIG_TENSOR_TYPE
            torch.Tensor.cuda = _ORIG_TENSOR_CUDA


def _with_cuda_type_names(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    wrapper.__wrapped_by_cpu_shim__ = True  # type: ignore[attr-defined]
    return wrapper


def _rng_get(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.default_generator.get_state()


def _rng_set(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.default_generator.set_state(new_state)


def needs_cpu_shim() -> bool:
    """True when CUDA is absent, i.e. megatron-core must be redirected to the CPU."""
    return not torch.cuda.is_available()


def shim_applied() -> bool:
    """Whether :func:`apply_cpu_shim` has redirected megatron-core in this process."""
    return bool(_STATE["applied"])


def _import_megatron_modules() -> None:
    import importlib

    for name in (
        "megatron.core.parallel_state",
        "megatron.core.utils",
        "megatron.core.tensor_parallel",
        "megatron.core.tensor_parallel.random",
        "megatron.core.tensor_parallel.layers",
        "megatron.core.tensor_parallel.mappings",
        "megatron.core.tensor_parallel.cross_entropy",
        "megatron.core.pipeline_parallel",
        "megatron.core.pipeline_parallel.schedules",
        "megatron.core.pipeline_parallel.p2p_communication",
        "megatron.core.distributed",
        "megatron.core.distributed.distributed_data_parallel",
        "megatron.core.distributed.param_and_grad_buffer",
        "megatron.core.distributed.finalize_model_grads",
        "megatron.core.optimizer",
        "megatron.core.optimizer.optimizer",
        "megatron.core.optimizer.distrib_optimizer",
        "megatron.core.optimizer.clip_grads",
        "megatron.core.models.gpt.gpt_model",
        "megatron.core.models.common.language_module.language_module",
        "megatron.core.models.gpt.gpt_layer_specs",
        "megatron.core.transformer.transformer_block",
        "megatron.core.transformer.transformer_layer",
        "megatron.core.transformer.attention",
        "megatron.core.transformer.dot_product_attention",
        "megatron.core.transformer.mlp",
        "megatron.core.transformer.module",
        "megatron.core.dist_checkpointing",
        "megatron.core.dist_checkpointing.serialization",
        "megatron.core.dist_checkpointing.strategies.torch",
        "megatron.core.optimizer_param_scheduler",
        "megatron.core.rerun_state_machine",
    ):
        importlib.import_module(name)


def _rebind(module_names: list[str], attr: str, new: Any, old: Any) -> None:
    for name in module_names:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, attr, None) is old:
            setattr(mod, attr, new)


def apply_cpu_shim(force: bool = False) -> bool:
    """Redirect megatron-core's device calls to the CPU (once per process); return True when applied.

    Does nothing when CUDA is available unless ``force`` (used by the test that checks the redirection).
    """
    if _STATE["applied"]:
        return True
    if not (force or needs_cpu_shim()):
        return False
    _import_megatron_modules()
    mc_names = [n for n in list(sys.modules) if n == "megatron.core" or n.startswith("megatron.core.")]
    for name in mc_names:
        mod = sys.modules.get(name)
        if mod is not None and mod.__dict__.get("torch") is torch:
            mod.torch = _PROXY
            _STATE["modules"].add(name)

    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = _rng_get
    tp_random._set_cuda_rng_state = _rng_set
    old = clip_grads.clip_grad_by_total_norm_fp32
    _rebind(mc_names, "clip_grad_by_total_norm_fp32", _with_cuda_type_names(old), old)
    dist_opt = distrib_optimizer.DistributedOptimizer
    dist_opt.__init__ = _with_cuda_type_names(dist_opt.__init__)
    build = dist_opt.__dict__["_build_model_and_main_param_groups"].__func__
    dist_opt._build_model_and_main_param_groups = classmethod(_with_cuda_type_names(build))
    f16 = optimizer.Float16OptimizerWithFloat16Params
    f16.__init__ = _with_cuda_type_names(f16.__init__)
    from megatron.core.models.common.language_module.language_module import LanguageModule

    # tied embeddings over pipeline stages move the output copy with Tensor.cuda() before syncing it
    LanguageModule.setup_embeddings_and_output_layer = _with_cuda_type_names(
        LanguageModule.setup_embeddings_and_output_layer)
    _STATE["applied"] = True
    return True


def patched_modules() -> list[str]:
    """Names of the megatron-core modules whose ``torch`` now points at the CPU proxy."""
    return sorted(_STATE["modules"])
