"""Megatron engine under torchrun (gloo, CPU): log-prob, update and checkpoint parity in one 4-rank launch."""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EXPECTED = [
    "OK fsdp reference",
    "OK infer tp=2 pp=1 vpp=1 dp=2",
    "OK infer tp=1 pp=2 vpp=1 dp=2",
    "OK infer tp=2 pp=2 vpp=1 dp=1",
    "OK infer tp=1 pp=2 vpp=2 dp=2",
    "OK train tp=2 pp=2 vpp=1 dp=1 dist_opt=False sgd",
    "OK train tp=1 pp=2 vpp=2 dp=2 dist_opt=False sgd",
    "OK train tp=2 pp=1 vpp=1 dp=2 dist_opt=True adamw",
    "loss=seq-mean-token-mean+entropy+kl",
    "OK tied tp=2 pp=2",
    "non-finite grad norm skipped",
    "OK checkpoint tp=2 pp=2 dist_opt=True resume == uninterrupted",
]


def test_megatron_parity_tp_pp_vpp_dp_and_checkpoint(torchrun):
    """TP2, PP2, TP2xPP2, PP2xVPP2 log-probs == reference == FSDP; SGD/AdamW steps == reference/FSDP; resume."""
    out = torchrun("megatron_parity_worker.py", 4, timeout=400)
    lines = [line for line in out.splitlines() if line.startswith("OK")]
    for want in EXPECTED:
        assert any(line.startswith(want) or want in line for line in lines), f"missing {want!r} in:\n{out}"
