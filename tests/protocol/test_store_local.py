"""LocalStore specifics and the batching helpers: model-based property test, memory, bounded marks, lazy imports."""
from __future__ import annotations

import gc
import re
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from tensordict import TensorDict

from protocol.store import (
    FieldOverwriteError,
    FieldShapeError,
    LateWriteError,
    LocalStore,
    StoreKeyError,
    uid_of as group_of,
    is_prompt_key,
)
from protocol.store.base import ClearedMarks, check_keys, check_select_fields, check_tags
from protocol.store.batching import (
    assemble_batch,
    assemble_field,
    normalize_tag,
    per_key_fields,
    same_value,
    single_key_fields,
    split_rows,
)

REPO = Path(__file__).resolve().parents[2]


def _jagged(parts):
    return torch.nested.as_nested_tensor(list(parts), layout=torch.jagged)


# ---- keys and groups -----------------------------------------------------------------------------------
def test_group_of_and_prompt_key():
    assert group_of("ab12_3_0") == "ab12" and group_of("ab12") == "ab12"
    assert is_prompt_key("ab12") and not is_prompt_key("ab12_0_1")


def test_check_helpers():
    assert check_keys("a", "op") == ["a"]
    with pytest.raises(TypeError, match="op: keys must be a list"):
        check_keys(3, "op")
    assert check_select_fields("x", "op") == ["x"] and check_select_fields(None, "op") is None
    with pytest.raises(ValueError, match="repeat"):
        check_select_fields(["x", "x"], "op")
    with pytest.raises(TypeError, match="list of dicts"):
        check_tags({"a": 1}, ["a"], "op")
    assert check_tags(None, ["a"], "op") is None


# ---- batching helpers ------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=6), trailing=st.sampled_from([(), (2,), (2, 3)]))
def test_split_then_assemble_roundtrip(lengths, trailing):
    """Per-key split of a jagged batch and re-assembly give the same rows; dense iff all lengths are equal."""
    rows = [torch.arange(L * int(np.prod(trailing, dtype=int))).reshape(L, *trailing).float() for L in lengths]
    cols = per_key_fields({"x": _jagged(rows)}, len(rows))
    assert all(torch.equal(a, b) for a, b in zip(cols["x"], rows))
    out = assemble_field("x", cols["x"])
    assert out.is_nested == (len(set(lengths)) > 1)
    assert all(torch.equal(a, b) for a, b in zip(out.unbind(0), rows))
    forced = assemble_field("x", cols["x"], jagged=True)
    assert forced.is_nested and [t.shape[0] for t in forced.unbind()] == lengths


def test_split_rows_owns_memory():
    big = torch.arange(1000.0).reshape(10, 100)
    rows = split_rows("x", big, 10)
    assert all(r.untyped_storage().nbytes() == 100 * 4 for r in rows)
    jag = _jagged([torch.arange(5), torch.arange(7)])
    parts = split_rows("y", jag, 2)
    assert [p.untyped_storage().nbytes() for p in parts] == [5 * 8, 7 * 8]


def test_split_rows_errors():
    with pytest.raises(FieldShapeError, match="0-d"):
        split_rows("x", torch.tensor(1.0), 1)
    with pytest.raises(FieldShapeError, match="3 entries, expected 2"):
        split_rows("x", [torch.ones(1)] * 3, 2)
    with pytest.raises(TypeError, match="positions"):
        split_rows("x", [torch.ones(1), 3], 2)
    with pytest.raises(TypeError, match="field 'x'"):
        split_rows("x", np.ones(2), 2)


def test_per_key_fields_errors():
    nested = TensorDict({"a": TensorDict({"b": torch.ones(2)}, [2])}, [2])
    with pytest.raises(TypeError, match="nested TensorDict under 'a'"):
        per_key_fields(nested, 2)
    with pytest.raises(TypeError, match="non-empty str"):
        per_key_fields({3: torch.ones(2)}, 2)
    assert per_key_fields(None, 3) == {}


def test_single_key_fields():
    td1 = TensorDict({"a": torch.ones(1, 3)}, [1])
    assert single_key_fields(td1)["a"].shape == (3,)
    td0 = TensorDict({"a": torch.ones(3)}, [])
    assert single_key_fields(td0)["a"].shape == (3,)
    with pytest.raises(FieldShapeError, match=r"batch_size \[\] or \[1\]"):
        single_key_fields(TensorDict({"a": torch.ones(2, 3)}, [2]))
    with pytest.raises(TypeError, match="dict of tensors"):
        single_key_fields([torch.ones(2)])


def test_assemble_field_errors():
    with pytest.raises(FieldShapeError, match="different dtypes"):
        assemble_field("x", [torch.ones(2), torch.ones(2, dtype=torch.int64)])
    with pytest.raises(FieldShapeError, match="ndim"):
        assemble_field("x", [torch.ones(2), torch.ones(2, 2)])
    with pytest.raises(FieldShapeError, match="ndim >= 1"):
        assemble_field("x", [torch.tensor(1.0)], jagged=True)
    with pytest.raises(FieldShapeError, match="zero keys"):
        assemble_field("x", [])
    empty_rows = assemble_field("x", [torch.ones(0), torch.ones(2)])
    assert [t.shape[0] for t in empty_rows.unbind()] == [0, 2]
    td = assemble_batch(2, {"x": [torch.ones(1), torch.ones(3)], "y": [torch.ones(2), torch.ones(2)]})
    assert td["x"].is_nested and td["y"].shape == (2, 2)


def test_same_value():
    nan = torch.tensor([float("nan"), 1.0])
    assert same_value(nan, nan.clone())
    assert not same_value(torch.ones(2), torch.ones(3))
    assert not same_value(torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert not same_value(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]))
    assert same_value(torch.tensor([1, 2]), torch.tensor([1, 2]))


def test_normalize_tag():
    tag = normalize_tag({"a": np.float32(1.5), "b": (1, np.int64(2)), "c": {"d": None}}, "k")
    assert tag == {"a": 1.5, "b": [1, 2], "c": {"d": None}} and type(tag["b"][1]) is int
    with pytest.raises(TypeError, match="tag 'a' of key 'k'.*tolist"):
        normalize_tag({"a": np.ones(2)}, "k")
    with pytest.raises(TypeError, match="names must be str"):
        normalize_tag({1: 1}, "k")
    with pytest.raises(TypeError, match="nested tag keys"):
        normalize_tag({"a": {1: 2}}, "k")
    with pytest.raises(TypeError, match="must be a dict"):
        normalize_tag([1], "k")
    with pytest.raises(TypeError, match="JSON-able"):
        normalize_tag({"a": object()}, "k")


_TAG_VALUE = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=3),
                       st.lists(st.integers(), max_size=2), st.builds(np.int64, st.integers(-9, 9)),
                       st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.dictionaries(st.one_of(st.text(max_size=3), st.integers(0, 3)), _TAG_VALUE, max_size=4),
                min_size=1, max_size=6))
def test_check_tags_equals_normalizing_each_tag(tags):
    """The whole-list pass for scalar tags gives what normalizing tag by tag gives (or the same refusal), and
    shares no container with the caller's tags."""
    keys = [f"k{i}" for i in range(len(tags))]
    try:
        want = [normalize_tag(t, k) for t, k in zip(tags, keys)]
    except TypeError as exc:
        with pytest.raises(TypeError, match=re.escape(str(exc))):
            check_tags(tags, keys, "op")
        return
    got = check_tags(tags, keys, "op")
    assert got == want and [list(map(type, t.values())) for t in got] == [list(map(type, t.values())) for t in want]
    assert all(a is not b for a, b in zip(got, tags))


# ---- cleared marks -------------------------------------------------------------------------------------
def test_cleared_marks_bounded_fifo():
    store = LocalStore(max_cleared_marks=10)
    keys = [f"u{i}" for i in range(30)]
    store.kv_batch_put(keys, "train", tags=[{}] * 30)
    store.kv_clear(keys, "train")
    assert store.stats()["cleared_marks"] == 10
    store.kv_put("u0_0_0", "train", tag={})  # u0's mark was forgotten (oldest first)
    with pytest.raises(LateWriteError):
        store.kv_put("u29_0_0", "train", tag={})
    with pytest.raises(ValueError, match="max_cleared_marks"):
        ClearedMarks(-1)
    off = LocalStore(max_cleared_marks=0)
    off.kv_put("a", "t", tag={})
    off.kv_clear(["a"], "t")
    off.kv_put("a", "t", tag={})
    assert off.stats()["cleared_marks"] == 0


# ---- memory ----------------------------------------------------------------------------------------------
def test_clear_releases_stored_tensors():
    store = LocalStore()
    store.kv_batch_put(["a_0_0", "a_1_0"], "train", {"x": _jagged([torch.ones(100), torch.ones(50)])})
    refs = [weakref.ref(e.fields["x"][0].values) for e in store._parts["train"].values()]
    assert store.stats()["bytes"] == store.stats()["held_bytes"] == 150 * 4
    store.kv_clear(["a_0_0", "a_1_0"], "train")
    gc.collect()
    assert all(r() is None for r in refs)
    assert store.stats() == {"partitions": 0, "keys": 0, "fields": 0, "bytes": 0, "held_bytes": 0,
                             "cleared_marks": 2, "late_writes_refused": 0, "overwrites_refused": 0}
    assert store._parts == {}


def test_put_copies_each_field_once_and_never_shares_memory():
    """One buffer per field of a put (not one per key); neither the put's nor the get's tensors alias the store."""
    store = LocalStore()
    resp = _jagged([torch.arange(3), torch.arange(5), torch.arange(2)])
    score = torch.tensor([1.0, 2.0, 3.0])
    keys = ["a_0_0", "a_1_0", "a_2_0"]
    store.kv_batch_put(keys, "t", {"responses": resp, "score": score})
    entries = [store._parts["t"][k] for k in keys]
    assert len({id(e.fields["responses"][0]) for e in entries}) == 1
    buf = entries[0].fields["responses"][0].values
    assert buf.untyped_storage().data_ptr() != resp.values().untyped_storage().data_ptr()
    score[0] = 99.0
    resp.values()[0] = 99
    got = store.kv_batch_get(keys, "t", ["responses", "score"])
    assert got["score"].tolist() == [1.0, 2.0, 3.0] and got["responses"].values()[0] == 0
    got["responses"].values()[1] = -7
    again = store.kv_batch_get(keys[:1], "t", ["responses"], jagged=["responses"])["responses"]
    assert again.values().tolist() == [0, 1, 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.bool, torch.float16, torch.int8, torch.complex64])
def test_dtypes_numpy_lacks_or_narrows_come_back_exact(dtype):
    """Rows are joined through numpy views; bfloat16 (which numpy lacks) and the narrow dtypes come back bit-exact,
    in order and scattered."""
    rows = [(torch.arange(n * 3) % 5 - 2).reshape(n, 3).to(dtype) for n in (1, 4, 2, 3)]
    keys = [f"k{i}_0_0" for i in range(4)]
    store = LocalStore()
    store.kv_batch_put(keys[:2], "t", {"x": rows[:2], "d": torch.stack([rows[0][0], rows[1][0]])})
    store.kv_batch_put(keys[2:], "t", {"x": rows[2:], "d": torch.stack([rows[2][0], rows[3][0]])})
    for order in (keys, keys[::-1]):
        got = store.kv_batch_get(order, "t", ["x", "d"])
        want = [rows[int(k[1])] for k in order]
        assert got["x"].dtype == dtype and all(torch.equal(a, b) for a, b in zip(got["x"].unbind(), want))
        assert torch.equal(got["d"], torch.stack([w[0] for w in want]))


@pytest.mark.parametrize("kind", ["ragged", "dense", "dense_rows_jagged"])
def test_scattered_read_of_one_column(kind):
    """Rows of one big column read in a scattered order (one index instead of a slice per run) come back right."""
    n = 64
    gen = torch.Generator().manual_seed(0)
    if kind == "ragged":
        rows = [torch.randn(int(torch.randint(0, 5, (1,), generator=gen)), 2, generator=gen) for _ in range(n)]
        field = _jagged(rows)
    else:
        field = torch.randn(n, 3, 2, generator=gen)
        rows = list(field.unbind(0))
    keys = [f"k{i}_0_0" for i in range(n)]
    store = LocalStore()
    store.kv_batch_put(keys, "t", {"x": field})
    order = torch.randperm(n, generator=gen).tolist()
    got = store.kv_batch_get([keys[i] for i in order], "t", ["x"], jagged=["x"] if kind != "dense" else [])["x"]
    assert got.is_nested == (kind != "dense")
    assert all(torch.equal(a, rows[i]) for a, i in zip(got.unbind(), order))


def test_partial_clear_compacts_to_at_most_twice_the_live_bytes():
    """Clearing most keys of a put copies the rest into a smaller buffer; the values stay what was written."""
    store = LocalStore(max_cleared_marks=0)
    rows = [torch.full((i + 1,), float(i)) for i in range(10)]
    keys = [f"g{i}_0_0" for i in range(10)]
    store.kv_batch_put(keys, "t", {"x": _jagged(rows), "y": torch.arange(10.0)})
    old = weakref.ref(store._parts["t"]["g9_0_0"].fields["x"][0].values)
    store.kv_clear(keys[5:], "t")  # rows 5..9 hold 45 of the 55 elements of x, and half of y
    gc.collect()
    assert old() is None
    stats = store.stats()
    assert stats["bytes"] == (15 + 5) * 4 and stats["held_bytes"] == stats["bytes"]
    got = store.kv_batch_get(keys[:5], "t", ["x", "y"])
    assert all(torch.equal(a, b) for a, b in zip(got["x"].unbind(), rows[:5]))
    assert got["y"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    store.kv_batch_put(keys[:2], "t", {"x": _jagged([torch.ones(3), torch.ones(1)])}, overwrite=True)
    assert store.stats()["held_bytes"] <= 2 * store.stats()["bytes"]
    store.kv_clear(keys[:5], "t")
    assert store.stats()["bytes"] == store.stats()["held_bytes"] == 0


_row_specs = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.sampled_from([(), (2,)])),
                      min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(puts=st.lists(_row_specs, min_size=1, max_size=3), order=st.randoms(use_true_random=False),
       dense=st.booleans(), jagged=st.booleans(), dtype=st.sampled_from([torch.float32, None]))
def test_get_joins_rows_like_assemble_field(puts, order, dense, jagged, dtype):
    """Rows written by several puts (jagged, dense, or lists), read back in any order: the same tensor (or the
    same error) as ``assemble_field`` of the per-key values."""
    store = LocalStore()
    values, keys = {}, []
    for p, spec in enumerate(puts):
        rows = []
        for i, (kind, length, trail) in enumerate(spec):
            shape = (length, *trail) if kind else trail  # kind 0: a 0-d or fixed-shape row
            dt = torch.int64 if (dtype is None and (p + i) % 2) else torch.float32
            rows.append(torch.arange(int(np.prod(shape, dtype=int)), dtype=dt).reshape(shape) + 10 * p + i)
        ks = [f"p{p}r{i}_0_0" for i in range(len(rows))]
        same = all(r.shape == rows[0].shape and r.dtype == rows[0].dtype for r in rows)
        ragged = all(r.dim() >= 1 and r.dtype == rows[0].dtype and r.shape[1:] == rows[0].shape[1:] for r in rows)
        field = torch.stack(rows) if dense and same else (_jagged(rows) if ragged and not same else rows)
        store.kv_batch_put(ks, "t", {"x": field})
        values.update(zip(ks, rows))
        keys += ks
    order.shuffle(keys)
    try:
        want = assemble_field("x", [values[k] for k in keys], jagged)
    except FieldShapeError as exc:
        with pytest.raises(FieldShapeError, match=str(exc).split(":")[0]):
            store.kv_batch_get(keys, "t", ["x"], jagged=["x"] if jagged else [])
        return
    got = store.kv_batch_get(keys, "t", ["x"], jagged=["x"] if jagged else [])["x"]
    assert got.is_nested == want.is_nested and got.dtype == want.dtype
    if want.is_nested:
        assert all(torch.equal(a, b) for a, b in zip(got.unbind(), want.unbind()))
    else:
        assert torch.equal(got, want)


def test_overwrite_true_keeps_byte_count_exact():
    store = LocalStore()
    store.kv_put("k", "t", {"x": torch.ones(10)})
    store.kv_put("k", "t", {"x": torch.ones(3)}, overwrite=True)
    assert store.stats()["bytes"] == 12
    with pytest.raises(FieldOverwriteError):
        store.kv_put("k", "t", {"x": torch.ones(4)})
    assert store.stats()["overwrites_refused"] == 1


# ---- concurrency stress ----------------------------------------------------------------------------------
def test_many_threads_put_get_clear():
    store = LocalStore()
    errors = []

    def work(t):
        try:
            for step in range(15):
                keys = [f"t{t}s{step}_{i}_0" for i in range(4)]
                store.kv_batch_put(keys, "train", {"x": [torch.full((i + 1,), float(t)) for i in range(4)]},
                                   tags=[{"t": t}] * 4)
                store.kv_batch_put(["shared"], "train", tags=[{f"{t}_{step}": step}])
                got = store.kv_batch_get(keys, "train", ["x"])["x"]
                assert all(bool((row == t).all()) for row in got.unbind())
                assert store.kv_clear(keys, "train") == 4
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(12)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert store.kv_list("train")["train"].keys() == {"shared"}
    assert len(store.kv_batch_get_tags(["shared"], "train")[0]) == 12 * 15
    assert store.stats()["bytes"] == 0


# ---- model-based property test -------------------------------------------------------------------------
_KEYS = ["aa", "aa_0_0", "aa_1_0", "bb", "bb_0_0", "cc_0_0"]
_key_lists = st.lists(st.sampled_from(_KEYS), min_size=1, max_size=3, unique=True)
_put = st.builds(
    lambda p, keys, name, data, tagv, ow: ("put", p, keys, name, data[: len(keys)], tagv, ow),
    st.integers(0, 1), _key_lists, st.sampled_from([None, "f", "g"]),
    st.lists(st.tuples(st.integers(1, 3), st.integers(0, 1)), min_size=3, max_size=3),
    st.integers(0, 2), st.booleans(),
)
_get = st.tuples(st.just("get"), st.integers(0, 1), _key_lists, st.sampled_from(["f", "g"]))
_clear = st.tuples(st.just("clear"), st.integers(0, 1), _key_lists)


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.one_of(_put, _put, _get, _clear), max_size=25))
def test_local_store_agrees_with_dict_model(ops):
    """Any sequence of put/get/clear gives the same results (values, tags, refusals) as a plain dict model."""
    store = LocalStore()
    data: dict = {}
    cleared: set = set()
    for op in ops:
        p = f"p{op[1]}"
        if op[0] == "put":
            _, _, keys, name, lv, tagv, ow = op
            fields = None if name is None else {name: [torch.full((L,), float(v)) for L, v in lv]}
            new = [k for k in keys if (p, k) not in data]
            if any((p, k) in cleared or (p, group_of(k)) in cleared for k in new):
                expect = LateWriteError
            elif fields and any(name in data.get((p, k), ({}, {}))[1]
                                and not torch.equal(data[(p, k)][1][name], v)
                                for k, v in zip(keys, fields[name])) and not ow:
                expect = FieldOverwriteError
            else:
                expect = None
                for i, k in enumerate(keys):
                    tag, flds = data.setdefault((p, k), ({}, {}))
                    tag["v"] = tagv
                    if fields:
                        flds[name] = fields[name][i]
            if expect is None:
                meta = store.kv_batch_put(keys, p, fields, [{"v": tagv}] * len(keys), overwrite=ow)
                assert meta.tags == [data[(p, k)][0] for k in keys]
            else:
                with pytest.raises(expect):
                    store.kv_batch_put(keys, p, fields, [{"v": tagv}] * len(keys), overwrite=ow)
        elif op[0] == "get":
            _, _, keys, name = op
            if all((p, k) in data and name in data[(p, k)][1] for k in keys):
                got = store.kv_batch_get(keys, p, [name])[name].unbind(0)
                assert all(torch.equal(a, data[(p, k)][1][name]) for a, k in zip(got, keys))
            else:
                with pytest.raises(StoreKeyError):
                    store.kv_batch_get(keys, p, [name])
        else:
            _, _, keys = op
            n = sum(1 for k in keys if data.pop((p, k), None) is not None)
            cleared.update((p, k) for k in keys)
            assert store.kv_clear(keys, p) == n
        for q in ("p0", "p1"):
            assert store.kv_list(q)[q] == {k: t for (pp, k), (t, _) in data.items() if pp == q}
        assert store.stats()["held_bytes"] <= 2 * store.stats()["bytes"]
    total = sum(v.numel() * v.element_size() for _, flds in data.values() for v in flds.values())
    assert store.stats()["bytes"] == total and store.stats()["keys"] == len(data)


# ---- imports -------------------------------------------------------------------------------------------
def test_ray_and_transfer_queue_are_imported_only_inside_functions():
    """``import protocol.store`` must not import ray: no module-level import of either in the store package."""
    import ast

    files = sorted((REPO / "protocol" / "store").glob("*.py"))
    assert len(files) >= 5
    for path in files:
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m.split(".")[0] in ("ray", "transfer_queue")], path


def test_tq_store_argument_check_before_starting_anything():
    from protocol.store import TransferQueueStore

    with pytest.raises(ValueError, match="num_storage_units"):
        TransferQueueStore(num_storage_units=0)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 6)), max_size=12))
def test_row_ranges_are_the_aranges_of_the_rows_back_to_back(rows):
    """The token positions of rows ``(start, length)``, in order, equal the per-row ``arange``s laid end to end."""
    from protocol.store.columns import row_ranges

    starts = np.array([s for s, _ in rows], dtype=np.int64)
    lengths = np.array([n for _, n in rows], dtype=np.int64)
    want = [i for s, n in rows for i in range(s, s + n)]
    assert row_ranges(starts, lengths).tolist() == want


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from([torch.int64, torch.int32, torch.float32]),
                          st.integers(1, 2)), min_size=1, max_size=6))
def test_list_column_keeps_every_row_as_given(specs):
    """``_list_column``'s rows read back equal to what was given, whether they share one column (one dtype and
    ndim: lengths from numel for 1-D rows, shape[0] else) or each go alone."""
    from protocol.store.columns import _list_column
    rows = [torch.arange(n * 3, dtype=dtype).reshape(n, 3) if ndim == 2 else torch.arange(n, dtype=dtype)
            for n, dtype, ndim in specs]
    keys = [f"k{i}" for i in range(len(rows))]
    cols, refs = _list_column("f", rows, keys)
    uniform = len({(r.dtype, r.ndim) for r in rows}) == 1
    assert len(cols) == (1 if uniform else len(rows))
    for (col, i), row in zip(refs, rows):
        got = col.row(i)
        assert got.dtype == row.dtype and torch.equal(got, row)
