"""Synthetic sequence-length mixes for planning without a rollout: the shapes RL batches take in practice.

* ``lognormal`` – single-turn reasoning: a long right tail (median ≈ max_len/8);
* ``bimodal`` – agentic: most trajectories short, a quarter long multi-turn ones (tool observations);
* ``uniform`` – lengths spread evenly, the easy case.

Lengths are seq_len (prompt + response), clipped to ``[min_len, max_len]``.

Example::

    >>> synthetic_lengths("uniform", 4, seed=0, max_len=100).tolist()
    [70, 39, 19, 17]
"""
from __future__ import annotations

import numpy as np

__all__ = ["DISTRIBUTIONS", "synthetic_lengths"]

DISTRIBUTIONS = ("lognormal", "bimodal", "uniform")


def synthetic_lengths(kind: str, n: int, *, seed: int = 0, max_len: int = 16384, min_len: int = 16) -> np.ndarray:
    """``n`` int64 sequence lengths of the named mix (see module doc), reproducible from ``seed``."""
    if kind not in DISTRIBUTIONS:
        raise ValueError(f"length distribution must be one of {DISTRIBUTIONS}, got {kind!r}")
    if n < 0 or max_len < 2 or min_len < 1 or min_len > max_len:
        raise ValueError(f"need n >= 0 and 1 <= min_len <= max_len (max_len >= 2), got n={n}, min_len={min_len}, "
                         f"max_len={max_len}")
    rng = np.random.default_rng(seed)
    if kind == "lognormal":
        s = rng.lognormal(np.log(max_len / 8), 0.9, n)
    elif kind == "bimodal":
        short = rng.uniform(0.01, 0.08, n) * max_len
        long = rng.uniform(0.4, 0.9, n) * max_len
        s = np.where(rng.random(n) < 0.75, short, long)
    else:
        s = rng.uniform(min_len, max_len, n)
    return np.clip(np.rint(s), min_len, max_len).astype(np.int64)
