"""The cross-rank data plane under torchrun (gloo): see tests/dist/rldispatch_dataplane_worker.py."""
import pytest


@pytest.mark.dist
def test_dataplane_two_ranks(torchrun):
    out = torchrun("rldispatch_dataplane_worker.py", 2)
    assert "DATAPLANE OK" in out
