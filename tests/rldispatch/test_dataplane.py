"""The cross-rank data plane under torchrun (gloo): see tests/dist/rldispatch_dataplane_worker.py."""
import pytest


@pytest.mark.dist
def test_dataplane_two_ranks(torchrun):
    out = torchrun("rldispatch_dataplane_worker.py", 2)
    assert "DATAPLANE OK" in out


def test_a_transfer_packs_one_tensor_per_field():
    """What a rank sends for a field is one tensor and its lengths, whatever the number of keys (serializing one
    tensor per key made the transfer cost grow with the batch); unpacking gives every key's value back."""
    import torch

    from protocol.batch.nested import to_nested
    from rldispatch.dataplane import DataPlaneError, _pack, _unpack

    rows = [torch.arange(n, dtype=torch.float32) for n in (3, 0, 5, 1)]
    flat, lengths = _pack(to_nested(rows))
    assert isinstance(flat, torch.Tensor) and not flat.is_nested and lengths == [3, 0, 5, 1]
    assert all(torch.equal(a, b) for a, b in zip(_unpack("x", flat, lengths, 4), rows))
    dense = torch.arange(6.0).reshape(3, 2)
    flat, lengths = _pack(dense)
    assert lengths is None and [r.tolist() for r in _unpack("y", flat, lengths, 3)] == dense.tolist()
    with pytest.raises(DataPlaneError, match="'y'.*3 values for 2 keys"):
        _unpack("y", flat, None, 2)
