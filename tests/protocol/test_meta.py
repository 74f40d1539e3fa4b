"""KVBatchMeta: validation, select/reorder/chunk/split/concat, and their invariants."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from protocol.store.meta import KVBatchMeta, MetaIndexError, MetaKeyError


def _meta(n: int, pid: str = "train") -> KVBatchMeta:
    return KVBatchMeta(pid, [f"u{i}_0_0" for i in range(n)], [{"seq_len": i} for i in range(n)], {"step": 3})


def test_construction_copies_tags_and_extra_info():
    tags = [{"a": [1]}]
    extra = {"m": {"x": 1}}
    meta = KVBatchMeta("train", ["k"], tags, extra)
    tags[0]["a"].append(2)
    extra["m"]["x"] = 9
    assert meta.tags == [{"a": [1]}] and meta.extra_info == {"m": {"x": 1}}
    assert len(meta) == meta.size == 1


def test_default_tags_are_empty_dicts():
    meta = KVBatchMeta("val", ["a", "b"])
    assert meta.tags == [{}, {}] and meta.extra_info == {}


@pytest.mark.parametrize(
    "kwargs, exc, text",
    [
        (dict(partition_id="", keys=["a"], tags=[{}]), TypeError, "partition_id"),
        (dict(partition_id=3, keys=["a"], tags=[{}]), TypeError, "partition_id"),
        (dict(partition_id="t", keys="abc", tags=[{}]), TypeError, "keys must be a list"),
        (dict(partition_id="t", keys=["a", 1], tags=[{}, {}]), TypeError, "non-empty str"),
        (dict(partition_id="t", keys=["a", "b"], tags=[{}]), ValueError, "2 keys and 1 tags"),
        (dict(partition_id="t", keys=["a"], tags=[[1]]), TypeError, "must be dicts"),
        (dict(partition_id="t", keys=["a", "b", "a"], tags=[{}, {}, {}]), ValueError, "duplicated: ['a']"),
        (dict(partition_id="t", keys=["a"], tags={"a": 1}), TypeError, "list of dict"),
        (dict(partition_id="t", keys=["a"], tags=[{}], extra_info=[1]), TypeError, "extra_info"),
    ],
)
def test_construction_errors(kwargs, exc, text):
    with pytest.raises(exc, match=None) as info:
        KVBatchMeta(**kwargs)
    assert text in str(info.value)


def test_select_keys_order_and_missing():
    meta = _meta(4)
    sub = meta.select_keys(["u3_0_0", "u1_0_0"])
    assert sub.keys == ["u3_0_0", "u1_0_0"] and sub.tag_values("seq_len") == [3, 1]
    assert sub.extra_info == {"step": 3} and sub.partition_id == "train"
    with pytest.raises(MetaKeyError, match=r"2 key\(s\) not in this KVBatchMeta.*'zz'"):
        meta.select_keys(["u0_0_0", "zz", "yy"])
    with pytest.raises(ValueError, match="duplicated"):
        meta.select_keys(["u0_0_0", "u0_0_0"])


def test_select_idxs_and_reorder_errors():
    meta = _meta(3)
    assert meta.select_idxs([2, 0]).keys == ["u2_0_0", "u0_0_0"]
    with pytest.raises(MetaIndexError, match="out of range"):
        meta.select_idxs([3])
    with pytest.raises(MetaIndexError, match="repeat"):
        meta.reorder([0, 0, 1])
    with pytest.raises(MetaIndexError, match="permutation"):
        meta.reorder([1, 0])
    assert isinstance(MetaIndexError("x"), ValueError)


def test_reorder_returns_new_object():
    meta = _meta(3)
    new = meta.reorder([2, 1, 0])
    assert meta.keys == ["u0_0_0", "u1_0_0", "u2_0_0"]
    assert new.keys == ["u2_0_0", "u1_0_0", "u0_0_0"] and new.tag_values("seq_len") == [2, 1, 0]
    new.tags[0]["seq_len"] = 99
    assert meta.tags[2]["seq_len"] == 2


def test_tag_values_default():
    meta = KVBatchMeta("t", ["a", "b"], [{"x": 1}, {}])
    assert meta.tag_values("x", default=0) == [1, 0]


def test_chunk_more_chunks_than_keys_and_errors():
    meta = _meta(2)
    parts = meta.chunk(4)
    assert [len(p) for p in parts] == [1, 1, 0, 0]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="chunks must be a positive int"):
            meta.chunk(bad)


def test_split_sizes():
    meta = _meta(5)
    assert [p.keys for p in meta.split([2, 0, 3])] == [meta.keys[:2], [], meta.keys[2:]]
    with pytest.raises(ValueError, match="summing to 5"):
        meta.split([2, 2])


def test_concat_rules():
    a, b = _meta(2), KVBatchMeta("train", ["x"], [{"seq_len": 7}], {"step": 3, "other": 1})
    joined = KVBatchMeta.concat([a, b])
    assert joined.keys == a.keys + ["x"] and joined.extra_info == {"step": 3, "other": 1}
    with pytest.raises(ValueError, match="at least one"):
        KVBatchMeta.concat([])
    with pytest.raises(ValueError, match="one partition_id"):
        KVBatchMeta.concat([a, _meta(1, "val")])
    with pytest.raises(ValueError, match=r"extra_info\['step'\] disagrees"):
        KVBatchMeta.concat([a, KVBatchMeta("train", ["x"], [{}], {"step": 4})])
    with pytest.raises(ValueError, match="unique"):
        KVBatchMeta.concat([a, a])
    with pytest.raises(TypeError, match="expected KVBatchMeta"):
        KVBatchMeta.concat([a, {"keys": []}])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 40), chunks=st.integers(1, 12))
def test_chunk_concat_roundtrip_and_balance(n, chunks):
    """chunk: sizes differ by <= 1, larger first, sum n; concat of the chunks is the original batch."""
    meta = _meta(n)
    parts = meta.chunk(chunks)
    sizes = [len(p) for p in parts]
    assert len(parts) == chunks and sum(sizes) == n
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    back = KVBatchMeta.concat(parts)
    assert back.keys == meta.keys and back.tags == meta.tags and back.extra_info == meta.extra_info


@settings(max_examples=60, deadline=None)
@given(perm=st.permutations(list(range(12))))
def test_reorder_is_a_permutation_of_key_tag_pairs(perm):
    """reorder moves (key, tag) pairs together; the inverse permutation restores the batch."""
    meta = _meta(12)
    new = meta.reorder(perm)
    assert [new.keys[j] for j in range(12)] == [meta.keys[i] for i in perm]
    assert dict(zip(new.keys, map(str, new.tags))) == dict(zip(meta.keys, map(str, meta.tags)))
    inverse = [0] * 12
    for j, i in enumerate(perm):
        inverse[i] = j
    assert new.reorder(inverse).keys == meta.keys


def test_copy_tag_copies_every_container_and_keeps_atoms():
    from protocol.store.meta import copy_tag

    tag = {"status": "failure", "errors": ["a", {"why": [1, 2]}], "n": 3, "x": None, "t": (1, [2])}
    out = copy_tag(tag)
    assert out == tag
    assert out is not tag and out["errors"] is not tag["errors"] and out["errors"][1] is not tag["errors"][1]
    assert out["errors"][1]["why"] is not tag["errors"][1]["why"] and out["t"][1] is not tag["t"][1]
    out["errors"][1]["why"].append(3)
    assert tag["errors"][1]["why"] == [1, 2]


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=3),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids, max_size=3),
                     max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(tags=st.lists(st.dictionaries(st.text(max_size=4), _json, max_size=4) | _json, max_size=6))
def test_copy_tags_equals_copy_tag_of_each_and_shares_no_container(tags):
    """The batch copy gives what copy_tag gives tag by tag (atom-only dicts, nested containers, non-dict values);
    no dict or list of the result is one of the input's."""
    from protocol.store.meta import copy_tag, copy_tags

    out = copy_tags(iter(tags))
    assert out == [copy_tag(t) for t in tags]

    def containers(x):
        if isinstance(x, dict):
            yield x
            for v in x.values():
                yield from containers(v)
        elif isinstance(x, list):
            yield x
            for v in x:
                yield from containers(v)

    before = {id(c) for t in tags for c in containers(t)}
    assert not before & {id(c) for t in out for c in containers(t)}


def test_adopt_holds_what_it_is_given_and_equals_the_checked_constructor():
    keys, tags = ["u_0_0", "u_1_0"], [{"seq_len": 3}, {"seq_len": 4}]
    meta = KVBatchMeta.adopt("train", keys, tags, {"uid": "u"})
    assert meta == KVBatchMeta("train", keys, tags, {"uid": "u"})
    assert meta.keys is keys and meta.tags is tags  # handed over, not copied
    assert KVBatchMeta.adopt("train", [], []).extra_info == {}


def test_adopt_refuses_what_the_constructor_refuses():
    with pytest.raises(ValueError, match="unique"):
        KVBatchMeta.adopt("train", ["a", "a"], [{}, {}])
    with pytest.raises(TypeError, match="non-empty str"):
        KVBatchMeta.adopt("train", ["a", ""], [{}, {}])
    with pytest.raises(ValueError, match="one tag per key"):
        KVBatchMeta.adopt("train", ["a"], [{}, {}])
    with pytest.raises(TypeError, match="must be dicts"):
        KVBatchMeta.adopt("train", ["a"], [[]])
    with pytest.raises(TypeError, match="partition_id"):
        KVBatchMeta.adopt("", ["a"], [{}])
