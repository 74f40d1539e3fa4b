"""The cross-rank data plane under torchrun (gloo): see tests/dist/rldispatch_dataplane_worker.py."""
import pytest
from hypothesis import given, settings, strategies as st


@pytest.mark.dist
def test_dataplane_two_ranks(torchrun):
    out = torchrun("rldispatch_dataplane_worker.py", 2)
    assert "DATAPLANE OK" in out


def test_a_transfer_packs_one_tensor_per_field():
    """What a rank sends for a field is one tensor and its offsets, whatever the number of keys (no key list: the
    receiver knows the sender's order from the replicated locations); a wrong row count is refused by name."""
    import torch

    from protocol.batch.nested import field_parts, to_nested
    from rldispatch.dataplane import DataPlaneError, _join

    rows = [torch.arange(n, dtype=torch.float32) for n in (3, 0, 5, 1)]
    flat, offsets = field_parts(to_nested(rows))
    assert isinstance(flat, torch.Tensor) and not flat.is_nested and offsets.tolist() == [0, 3, 3, 8, 9]
    got = _join("x", list("abcd"), [(list("abcd"), flat, offsets)])
    assert [r.tolist() for r in got.unbind()] == [r.tolist() for r in rows]
    dense = torch.arange(6.0).reshape(3, 2)
    flat, offsets = field_parts(dense)
    assert offsets is None and flat is dense
    with pytest.raises(DataPlaneError, match="'y'.*3 values for 2 keys"):
        _join("y", ["a", "b"], [(["a", "b"], flat, None)])


def test_a_message_carries_every_dtype_and_shape_bit_exact():
    """The wire format (JSON header + raw bytes, no pickle) gives back each field's values and offsets exactly,
    bf16 / bool / complex / empty / non-contiguous values included; an unknown dtype in a header is refused."""
    import json

    import torch

    from rldispatch.dataplane import DataPlaneError, _decode, _encode

    payload = {"bf16": (torch.randn(5, 3).to(torch.bfloat16), torch.tensor([0, 2, 5])),
               "bool": (torch.tensor([True, False, True]), None),
               "empty": (torch.zeros(0, 4, dtype=torch.float64), torch.tensor([0, 0])),
               "int8": (torch.arange(7, dtype=torch.int8), None),
               "complex": (torch.randn(3, dtype=torch.complex64), None),
               "strided": (torch.randn(4, 2)[:, 0], torch.tensor([0, 1, 4]))}
    msg = _encode(payload)
    assert msg.dtype == torch.uint8 and msg.dim() == 1
    got = _decode(msg.clone())
    assert list(got) == list(payload)
    for name, (values, offsets) in payload.items():
        v, o, digest = got[name]
        assert digest is None, name
        assert v.dtype == values.dtype and v.shape == values.shape and torch.equal(v, values), name
        assert (o is None) == (offsets is None) and (o is None or torch.equal(o, offsets)), name
    n = int(msg[:8].view(torch.int64)[0])
    header = json.loads(bytes(msg[8:8 + n].numpy()))
    header[0][1] = "nn"
    forged = json.dumps(header).encode().ljust(n)
    bad = msg.clone()
    bad[8:8 + n] = torch.frombuffer(bytearray(forged), dtype=torch.uint8)
    with pytest.raises(DataPlaneError, match="unknown dtype 'nn'"):
        _decode(bad)


def test_a_frame_is_its_byte_count_then_the_message():
    """What gloo ranks send each other: an int64 count of the whole frame, then the message (nothing: 8 bytes);
    a frame parts at any multiple of 8 and is read back from its first bytes."""
    import torch

    from rldispatch.dataplane import _decode, _encode, _frame, first_part_bytes

    payload = {"x": (torch.arange(10, dtype=torch.float32), torch.tensor([0, 4, 10])), "s": (torch.ones(2), None)}
    frame = _frame(payload)
    assert int(frame[:8].view(torch.int64)[0]) == frame.numel() and torch.equal(frame[8:], _encode(payload))
    got = _decode(frame[8:])
    assert all(torch.equal(got[k][0], v) for k, (v, _) in payload.items())
    empty = _frame(None)
    assert empty.numel() == 8 and int(empty.view(torch.int64)[0]) == 8
    assert first_part_bytes(2) == 2 << 20 and first_part_bytes(64) == 64 << 10 and first_part_bytes(3) % 8 == 0


def test_joining_what_holders_sent_follows_the_one_length_rule():
    """A field joined from one holder (its buffer as it came) or several (rows merged in the asked order) is the
    same tensor a per-key join gives; anything with a length comes back jagged, even rows of one length."""
    import torch

    from protocol.batch.nested import field_parts, to_nested
    from rldispatch.dataplane import _as_joined, _join

    rows = {k: torch.arange(n, dtype=torch.int64) + 10 * i for i, (k, n) in enumerate(zip("abcde", (3, 0, 2, 2, 4)))}
    sent = [(ks, *field_parts(to_nested([rows[k] for k in ks]))) for ks in (["a", "c", "e"], ["b", "d"])]
    for order, held in ((list("acebd"), sent), (list("bdace"), sent[::-1]), (list("ace"), sent[:1])):
        got = _join("x", order, held)
        assert got.is_nested and [r.tolist() for r in got.unbind()] == [rows[k].tolist() for k in order]
    same = (["a", "b"], *field_parts(torch.arange(6.0).reshape(2, 3)))  # dense [2, 3]: rows of one length
    for got in (_join("y", ["a", "b"], [same]), _as_joined(torch.arange(6.0).reshape(2, 3))):
        assert got.is_nested and [r.tolist() for r in got.unbind()] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    scalars = (["a", "b"], *field_parts(torch.tensor([1.5, 2.5])))
    assert _join("s", ["a", "b"], [scalars]).tolist() == [1.5, 2.5]
    assert _as_joined(torch.tensor([1.5, 2.5])).tolist() == [1.5, 2.5]
    other = (["c"], *field_parts(torch.tensor([0.5])))
    assert _join("s", ["c", "a", "b"], [scalars, other]).tolist() == [0.5, 1.5, 2.5]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 12), senders=st.integers(2, 4),
       kind=st.sampled_from(["jagged", "scalar", "rows", "mixed"]), dtype=st.sampled_from(["float32", "bfloat16", "int64"]))
def test_a_join_of_several_senders_is_the_per_key_join(data, n, senders, kind, dtype):
    """Rows sent by several holders, joined in any asked order (one permutation for every field sent in the same
    lists), equal the rows one by one: jagged rows, scalars, dense rows of one length, and dense and jagged parts
    mixed (anything with a length comes back jagged); bf16, which numpy lacks, included."""
    import numpy as np
    import torch

    from protocol.batch.nested import field_parts, to_nested
    from rldispatch.dataplane import _join, _positions

    dt = getattr(torch, dtype)
    keys = [f"k{i}" for i in range(n)]
    holder = data.draw(st.lists(st.integers(0, senders - 1), min_size=n, max_size=n), label="holder")
    asked = data.draw(st.permutations(keys), label="asked")
    width = data.draw(st.integers(0, 3), label="width")
    # a holder reads in the order asked (so a lone holder's buffer is the field); other orders are joined too
    senders_in_order = len(set(holder)) == 1 or data.draw(st.booleans(), label="in order")
    lengths = {k: data.draw(st.integers(0, 4), label=k) for k in keys}

    def row(k: str) -> torch.Tensor:
        i = int(k[1:])
        if kind == "scalar":
            return torch.tensor(i + 0.5).to(dt)
        size = width if kind == "rows" or (kind == "mixed" and holder[i] % 2) else lengths[k]
        return (torch.arange(size * 2).reshape(size, 2) + 10 * i).to(dt)

    sent = []
    for r in range(senders):
        ks = [k for k in (asked if senders_in_order else keys) if holder[int(k[1:])] == r]
        if not ks:
            continue
        rows = [row(k) for k in ks]
        dense = kind == "scalar" or kind == "rows" or (kind == "mixed" and r % 2)
        sent.append((ks, *field_parts(torch.stack(rows) if dense else to_nested(rows))))
    order = _positions(asked, [ks for ks, _, _ in sent])
    assert sorted(order.tolist()) == list(range(n))
    for got in (_join("x", asked, sent), _join("x", asked, sent, order)):
        if kind == "scalar":
            assert not got.is_nested and torch.equal(got, torch.stack([row(k) for k in asked]))
        else:
            assert got.is_nested and got.dtype == dt and got.shape[0] == n
            for k, r in zip(asked, got.unbind()):
                assert torch.equal(r, row(k)), k
            assert np.array_equal(got.offsets().diff().numpy(), [row(k).shape[0] for k in asked])


def test_a_join_of_parts_of_different_dtypes_takes_the_per_key_rule():
    """Parts the one-gather join cannot lay end to end (different dtypes) go through the per-key join, which
    promotes nothing silently: it names the field."""
    import torch

    from protocol.batch.nested import to_nested
    from protocol.store.errors import FieldShapeError
    from protocol.batch.nested import field_parts
    from rldispatch.dataplane import _join

    a = (["a"], *field_parts(to_nested([torch.ones(2)])))
    b = (["b"], *field_parts(to_nested([torch.ones(3, dtype=torch.int64)])))
    with pytest.raises(FieldShapeError, match="'x'.*dtypes"):
        _join("x", ["b", "a"], [a, b])


def test_a_planned_fetch_on_one_process_reads_in_place_and_checks_the_share():
    """One process: a planned fetch reads what it holds in place, like fetch; the bridge refuses a ``wants`` whose
    entry for this rank is not the share it fetches (the planned lists and the share would disagree)."""
    import torch
    from tensordict import TensorDict

    from protocol.batch.nested import to_nested
    from protocol.store import LocalStore
    from protocol.store.meta import KVBatchMeta
    from rldispatch.bridge import StoreBridge
    from rldispatch.dataplane import ShardedStore

    store = ShardedStore(LocalStore())
    keys = ["u0_0_0", "u0_1_0", "u0_2_0"]
    rows = [torch.arange(n, dtype=torch.float32) for n in (2, 0, 3)]
    store.kv_batch_put(keys, "train", TensorDict({"x": to_nested(rows), "s": torch.tensor([1.0, 2.0, 3.0])},
                                                 batch_size=[3]))
    want = ["u0_2_0", "u0_0_0"]
    got, asked = store.fetch_planned([want], "train", ["x", "s"]), store.fetch(want, "train", ["x", "s"])
    assert [r.tolist() for r in got["x"].unbind()] == [r.tolist() for r in asked["x"].unbind()] == [[0, 1, 2], [0, 1]]
    assert got["s"].tolist() == [3.0, 1.0]
    assert store.split_by_holder(keys, "train", "s") == [keys]
    with pytest.raises(ValueError, match="not its entry of wants"):
        StoreBridge(None, store).fetch_infer_inputs(KVBatchMeta("train", want), [keys])
