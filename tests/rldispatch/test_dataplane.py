"""The cross-rank data plane under torchrun (gloo): see tests/dist/rldispatch_dataplane_worker.py."""
import pytest


@pytest.mark.dist
def test_dataplane_two_ranks(torchrun):
    out = torchrun("rldispatch_dataplane_worker.py", 2)
    assert "DATAPLANE OK" in out


def test_a_transfer_packs_one_tensor_per_field():
    """What a rank sends for a field is one tensor and its offsets, whatever the number of keys (no key list: the
    receiver knows the sender's order from the replicated locations); unpacking gives every key's row back."""
    import torch

    from protocol.batch.nested import to_nested
    from rldispatch.dataplane import DataPlaneError, _pack, _unpack

    rows = [torch.arange(n, dtype=torch.float32) for n in (3, 0, 5, 1)]
    flat, offsets = _pack(to_nested(rows))
    assert isinstance(flat, torch.Tensor) and not flat.is_nested and offsets.tolist() == [0, 3, 3, 8, 9]
    col = _unpack("x", ["a", "b", "c", "d"], flat, offsets)
    assert all(torch.equal(col.row(i), r) for i, r in enumerate(rows))
    dense = torch.arange(6.0).reshape(3, 2)
    flat, offsets = _pack(dense)
    assert offsets is None and [_unpack("y", ["a", "b", "c"], flat, None).row(i).tolist() for i in range(3)] \
        == dense.tolist()
    with pytest.raises(DataPlaneError, match="'y'.*3 values for 2 keys"):
        _unpack("y", ["a", "b"], flat, None)
