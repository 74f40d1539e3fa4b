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


def test_joining_what_holders_sent_follows_the_one_length_rule():
    """A field joined from one holder (its buffer as it came) or several (rows merged in the asked order) is the
    same tensor a per-key join gives; anything with a length comes back jagged, even rows of one length."""
    import torch

    from protocol.batch.nested import to_nested
    from rldispatch.dataplane import _join, _pack, _unpack

    rows = {k: torch.arange(n, dtype=torch.int64) + 10 * i for i, (k, n) in enumerate(zip("abcde", (3, 0, 2, 2, 4)))}
    cols = [_unpack("x", ks, *_pack(to_nested([rows[k] for k in ks]))) for ks in (["a", "c", "e"], ["b", "d"])]
    for order, held in ((list("acebd"), cols), (list("bdace"), cols[::-1]), (list("ace"), cols[:1])):
        got = _join("x", order, held)
        assert got.is_nested and [r.tolist() for r in got.unbind()] == [rows[k].tolist() for k in order]
    same = _unpack("y", ["a", "b"], *_pack(torch.arange(6.0).reshape(2, 3)))  # dense [2, 3]: rows of one length
    got = _join("y", ["a", "b"], [same])
    assert got.is_nested and [r.tolist() for r in got.unbind()] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    scalars = _unpack("s", ["a", "b"], *_pack(torch.tensor([1.5, 2.5])))
    assert _join("s", ["a", "b"], [scalars]).tolist() == [1.5, 2.5]
    other = _unpack("s", ["c"], *_pack(torch.tensor([0.5])))
    assert _join("s", ["c", "a", "b"], [scalars, other]).tolist() == [0.5, 1.5, 2.5]
