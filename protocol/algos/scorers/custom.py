"""A user's reward function from a Python file (``custom_reward_function.path`` / ``.name``), loaded at start-up."""
from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable, Mapping

from protocol.algos.scorers.registry import RewardError

__all__ = ["SCORE_PARAMS", "BATCH_SCORE_PARAMS", "load_reward_function"]

SCORE_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_SCORE_PARAMS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


def _accepts(fn: Callable, names: tuple[str, ...]) -> list[str]:
    """The names of ``names`` that ``fn`` cannot take as keywords."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    ok = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return [n for n in names if n not in ok]


def load_reward_function(path: str, name: str = "compute_score", *, batch: bool = False,
                         kwargs: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """The function ``name`` of the Python file ``path``, with ``kwargs`` bound; checked to take the score keywords.

    The function is called with keywords ``data_source, solution_str, ground_truth, extra_info`` (``batch=True``:
    ``data_sources, solution_strs, ground_truths, extra_infos``, lists over the batch). Errors name the config key.
    """
    if not isinstance(path, str) or not path:
        raise RewardError(f"custom_reward_function.path must name a Python file, got {path!r}")
    if not os.path.isfile(path):
        raise RewardError(f"custom_reward_function.path={path!r}: no such file")
    module_name = f"custom_reward_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardError(f"custom_reward_function.path={path!r}: not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling inside the file look their module up here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise RewardError(f"custom_reward_function.path={path!r}: importing it failed: {type(exc).__name__}: "
                          f"{exc}") from exc
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardError(f"custom_reward_function.name={name!r}: {path} defines no such function "
                          f"(its functions: {public})")
    if not callable(fn):
        raise RewardError(f"custom_reward_function.name={name!r}: {path} defines it as {type(fn).__name__}, "
                          f"not a function")
    kwargs = dict(kwargs or {})
    params = BATCH_SCORE_PARAMS if batch else SCORE_PARAMS
    missing = _accepts(fn, params + tuple(kwargs))
    if missing:
        raise RewardError(f"custom_reward_function.name={name!r} ({path}) must accept the keywords "
                          f"{list(params + tuple(kwargs))}; it does not take {missing}"
                          + (" (reward.manager=batch passes lists under plural names)" if batch else ""))
    return functools.partial(fn, **kwargs) if kwargs else fn
