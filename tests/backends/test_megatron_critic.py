"""The megatron critic under torchrun (gloo, CPU): values and SGD updates equal the FSDP critic's, TP 2 and PP 2."""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EXPECTED = [
    "OK fsdp critic values == ValueModel",
    "OK megatron critic tp=2 pp=1 == fsdp critic",
    "OK megatron critic tp=1 pp=2 == fsdp critic",
    "OK critic joins the actor's parallel state; other degrees refused",
    "OK critic checkpoint dp=2 dist_opt adamw: resume after 2 steps == uninterrupted",
]


def test_megatron_critic_equals_fsdp_critic_tp2_pp2(torchrun):
    """Same weights, same batch (with a padding sample carrying a full mask and far-off returns): the megatron
    critic's values, value-loss metrics and two SGD steps equal the FSDP critic's; it joins an actor's state; its
    checkpoint resumes exactly."""
    out = torchrun("megatron_critic_worker.py", 2, timeout=300)
    lines = [line for line in out.splitlines() if line.startswith("OK")]
    for want in EXPECTED:
        assert any(line.startswith(want) for line in lines), f"missing {want!r} in:\n{out}"
