"""DataProto: every operation keeps dense, jagged and non-tensor fields aligned; every refusal names its field."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from protocol.batch.dataproto import (
    BatchSizeMismatchError,
    DataProto,
    DataProtoError,
    DataProtoItem,
    MetaInfoConflictError,
    UnionConflictError,
    collate_fn,
    deserialize_tensordict,
    pad_dataproto_to_divisor,
    serialize_tensordict,
    _batch_from_state,
    _batch_state,
    to_object_array,
    union_meta_info,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)
from protocol.batch.nested import nested_lengths, nested_values, to_nested

SETTINGS = settings(max_examples=15, deadline=None)


def make_batch(n: int, seed: int = 0, meta: dict | None = None) -> DataProto:
    """n trajectories: jagged prompts/responses/response_mask/old_log_probs, dense reward_score, uid objects."""
    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(1, 6, (n,), generator=g).tolist()
    r_lens = torch.randint(0, 7, (n,), generator=g).tolist()  # empty responses included
    prompts = [torch.randint(0, 100, (p,), generator=g) for p in p_lens]
    responses = [torch.randint(0, 100, (r,), generator=g) for r in r_lens]
    tensors = {
        "prompts": to_nested(prompts, dtype=torch.int64),
        "responses": to_nested(responses, dtype=torch.int64),
        "response_mask": to_nested([torch.ones(r, dtype=torch.int64) for r in r_lens], dtype=torch.int64),
        "old_log_probs": to_nested([-torch.rand(r, generator=g) for r in r_lens], dtype=torch.float32),
        "reward_score": torch.randn(n, generator=g),
        "sample_id": torch.arange(n),
    }
    non_tensors = {"uid": [f"u{i}" for i in range(n)], "raw_prompt": [[{"role": "user", "content": str(i)}]
                                                                       for i in range(n)]}
    return DataProto.from_dict(tensors, non_tensors, meta_info=dict(meta or {"global_steps": 1}))


def sample_rows(data: DataProto) -> list[dict]:
    """Each sample as plain Python values (jagged fields as lists), for comparing against a loop."""
    columns = {}
    if data.batch is not None:
        for k in data.batch.keys():
            v = data.batch.get(k)
            columns[k] = [c.tolist() for c in v.unbind()] if v.is_nested else v.tolist()
    columns.update({f"nt:{k}": list(v) for k, v in data.non_tensor_batch.items()})
    return [{k: col[i] for k, col in columns.items()} for i in range(len(data))]


def assert_same(a: DataProto, b: DataProto) -> None:
    assert len(a) == len(b)
    assert sample_rows(a) == sample_rows(b)
    assert a.meta_info == b.meta_info


# ------------------------------------------------------------------------------------------- construction


def test_from_dict_and_from_single_dict():
    data = make_batch(4)
    assert len(data) == 4 and data.non_tensor_batch["uid"].dtype == object
    assert data.non_tensor_batch["raw_prompt"].shape == (4,)  # lists of equal length stay one object each
    single = DataProto.from_single_dict({"x": torch.arange(3), "uid": np.array(["a", "b", "c"], dtype=object),
                                         "tags": [1, 2, 3]}, meta_info={"k": 1})
    assert list(single.batch.keys()) == ["x"] and set(single.non_tensor_batch) == {"uid", "tags"}
    assert single.meta_info == {"k": 1}
    only_objects = DataProto.from_dict(non_tensors={"uid": ["a", "b"]})
    assert only_objects.batch is None and len(only_objects) == 2
    assert len(DataProto()) == 0


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_construction_refusals():
    with pytest.raises(BatchSizeMismatchError, match=r"tensors\['b'\] has 2 samples but tensors\['a'\] has 3"):
        DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(2)})
    with pytest.raises(BatchSizeMismatchError, match=r"non_tensor_batch\['uid'\] has length 2 but batch has 3"):
        DataProto.from_dict({"a": torch.zeros(3)}, {"uid": ["x", "y"]})
    with pytest.raises(BatchSizeMismatchError, match=r"non_tensor_batch\['b'\] has length 1 .*'a'"):
        DataProto(non_tensor_batch={"a": np.array([1, 2]), "b": np.array([1])})
    with pytest.raises(BatchSizeMismatchError, match=r"tensors\['a'\].*scalar"):
        DataProto.from_dict({"a": torch.tensor(1.0)})
    with pytest.raises(TypeError, match=r"tensors\['a'\].*torch.Tensor"):
        DataProto.from_dict({"a": [1, 2]})
    with pytest.raises(ValueError, match="num_batch_dims"):
        DataProto.from_dict({"a": torch.zeros(3, 2)}, num_batch_dims=2)
    with pytest.raises(TypeError, match="'s'.*str"):
        DataProto.from_single_dict({"s": "shared"})
    with pytest.raises(BatchSizeMismatchError, match="exactly one batch dimension"):
        DataProto(batch=TensorDict({"a": torch.zeros(2, 3)}, batch_size=[2, 3]))
    with pytest.raises(TypeError, match="batch: expected a tensordict"):
        DataProto(batch={"a": torch.zeros(2)})
    with pytest.raises(TypeError, match="meta_info"):
        DataProto(meta_info=[1])
    with pytest.raises(TypeError, match="non_tensor_batch: expected a dict"):
        DataProto(non_tensor_batch=[1])
    with pytest.raises(TypeError, match=r"non_tensor_batch\['u'\].*sequence"):
        DataProto(non_tensor_batch={"u": "abc"})
    with pytest.raises(BatchSizeMismatchError, match="0-d"):
        to_object_array(np.array(1))


def test_from_tensordict_and_back():
    td = TensorDict({"x": to_nested([torch.arange(2), torch.arange(3)]), "y": torch.ones(2, 3)}, batch_size=[2])
    td["uid"] = NonTensorStack("a", "b")
    td["temperature"] = NonTensorData(0.7)
    data = DataProto.from_tensordict(td, meta_info={"step": 2})
    assert set(data.batch.keys()) == {"x", "y"} and data.non_tensor_batch["uid"].tolist() == ["a", "b"]
    assert data.meta_info == {"step": 2, "temperature": 0.7}
    back = DataProto.from_tensordict(data.to_tensordict())
    assert_same(back, data)
    with pytest.raises(TypeError, match="TensorDict"):
        DataProto.from_tensordict({"x": torch.ones(2)})
    with pytest.raises(BatchSizeMismatchError, match="one batch dimension"):
        DataProto.from_tensordict(TensorDict({"x": torch.ones(2, 2)}, batch_size=[2, 2]))
    with pytest.raises(UnionConflictError, match="temperature"):
        DataProto.from_tensordict(td, meta_info={"temperature": 1.0})
    clash = DataProto.from_dict({"uid": torch.zeros(2)}, {"uid": ["a", "b"]})
    with pytest.raises(UnionConflictError, match="'uid'"):
        clash.to_tensordict()


# -------------------------------------------------------------------------------------------------- index


def test_getitem_kinds_and_item_view():
    data = make_batch(5)
    rows = sample_rows(data)
    item = data[3]
    assert isinstance(item, DataProtoItem) and item.non_tensor_batch["uid"] == "u3"
    assert item.batch["responses"].tolist() == rows[3]["responses"] and item.meta_info == data.meta_info
    assert data[-1].non_tensor_batch["uid"] == "u4" and data[np.int64(2)].non_tensor_batch["uid"] == "u2"
    assert data[torch.tensor(1)].non_tensor_batch["uid"] == "u1"
    assert sample_rows(data[1:4]) == rows[1:4] and sample_rows(data[::2]) == rows[::2]
    assert sample_rows(data[::-1]) == rows[::-1]
    assert sample_rows(data[[4, 0, 0]]) == [rows[4], rows[0], rows[0]]
    assert sample_rows(data[np.array([2, 1])]) == [rows[2], rows[1]]
    assert sample_rows(data[torch.tensor([3])]) == [rows[3]]
    mask = torch.tensor([True, False, True, False, True])
    assert sample_rows(data[mask]) == [rows[0], rows[2], rows[4]]
    assert sample_rows(data[mask.numpy()]) == [rows[0], rows[2], rows[4]]
    assert len(data[[]]) == 0 and nested_lengths(data[[]].batch["responses"]).tolist() == []
    assert [it.non_tensor_batch["uid"] for it in data] == [f"u{i}" for i in range(5)]


def test_index_refusals():
    data = make_batch(3)
    with pytest.raises(IndexError, match="index 3 is out of range for a batch of 3"):
        data[3]
    with pytest.raises(IndexError, match="position 5 .*entry 1"):
        data[[0, 5]]
    with pytest.raises(IndexError, match="boolean mask has length 2 but the batch has 3"):
        data[np.array([True, False])]
    with pytest.raises(TypeError, match="integer positions"):
        data[np.array([0.5])]
    with pytest.raises(IndexError, match="1-D"):
        data[np.zeros((2, 2), dtype=np.int64)]
    with pytest.raises(TypeError, match="DataProto index"):
        data["uid"]


@SETTINGS
@given(n=st.integers(1, 8), data_=st.data())
def test_select_idxs_matches_loop(n, data_):
    data = make_batch(n, seed=n)
    idx = data_.draw(st.lists(st.integers(-n, n - 1), max_size=10))
    rows = sample_rows(data)
    assert sample_rows(data.select_idxs(idx)) == [rows[i] for i in idx]


def test_select_and_pop_and_rename():
    data = make_batch(3, meta={"a": 1, "b": 2})
    sub = data.select(batch_keys=["responses"], non_tensor_batch_keys=["uid"], meta_info_keys=["a"])
    assert list(sub.batch.keys()) == ["responses"] and list(sub.non_tensor_batch) == ["uid"]
    assert sub.meta_info == {"a": 1}
    everything = data.select()
    everything.batch.pop("prompts")  # a new container: the original keeps its key
    assert "prompts" in data.batch.keys()
    deep = data.select(deepcopy=True)
    deep.batch["reward_score"].add_(1.0)
    deep.non_tensor_batch["raw_prompt"][0][0]["content"] = "changed"
    assert not torch.equal(deep.batch["reward_score"], data.batch["reward_score"])
    assert data.non_tensor_batch["raw_prompt"][0][0]["content"] == "0"

    popped = data.pop(batch_keys=["old_log_probs"], non_tensor_batch_keys=["raw_prompt"], meta_info_keys=["b"])
    assert list(popped.batch.keys()) == ["old_log_probs"] and "old_log_probs" not in data.batch.keys()
    assert list(popped.non_tensor_batch) == ["raw_prompt"] and popped.meta_info == {"b": 2}
    assert "raw_prompt" not in data.non_tensor_batch and data.meta_info == {"a": 1}

    before = data.batch["responses"]
    assert data.rename("responses", "resp") is data
    assert data.batch["resp"] is before and "responses" not in data.batch.keys()
    data.rename(["resp", "prompts"], ["prompts", "resp"])  # a swap is allowed
    assert data.batch["prompts"] is before


def test_select_pop_rename_refusals():
    data = make_batch(2)
    with pytest.raises(KeyError, match=r"batch keys \['nope'\] not found"):
        data.select(batch_keys=["nope"])
    with pytest.raises(KeyError, match=r"non_tensor_batch keys \['nope'\]"):
        data.select(non_tensor_batch_keys=["nope"])
    with pytest.raises(KeyError, match=r"meta_info keys \['nope'\]"):
        data.select(meta_info_keys=["nope"])
    with pytest.raises(KeyError, match="has no batch"):
        DataProto.from_dict(non_tensors={"u": [1]}).select(batch_keys=["x"])
    with pytest.raises(KeyError, match=r"pop: batch keys \['nope'\]"):
        data.pop(batch_keys=["nope"])
    with pytest.raises(KeyError, match=r"pop: meta_info keys \['nope'\]"):
        data.pop(meta_info_keys=["nope"])
    with pytest.raises(KeyError, match="'nope' not found"):
        data.rename("nope", "x")
    with pytest.raises(KeyError, match="'prompts' already exists"):
        data.rename("responses", "prompts")
    with pytest.raises(ValueError, match="1 old keys but 2 new"):
        data.rename(["responses"], ["a", "b"])
    with pytest.raises(ValueError, match="duplicates"):
        data.rename(["responses", "prompts"], ["a", "a"])
    with pytest.raises(KeyError, match="has no batch"):
        DataProto.from_dict(non_tensors={"u": [1]}).rename("x", "y")


# ------------------------------------------------------------------------------------------- split / merge


@SETTINGS
@given(m=st.integers(0, 4), k=st.integers(1, 4), seed=st.integers(0, 100))
def test_chunk_concat_round_trip(m, k, seed):
    data = make_batch(m * k, seed=seed) if m * k else make_batch(2, seed=seed)[[]]
    parts = data.chunk(k)
    assert len(parts) == k and all(len(p) == m for p in parts)
    back = DataProto.concat(parts)
    assert_same(back, data)
    for key in ("responses", "old_log_probs"):
        assert torch.equal(nested_lengths(back.batch[key]), nested_lengths(data.batch[key]))


@SETTINGS
@given(n=st.integers(1, 9), size=st.integers(1, 5))
def test_split_concat_round_trip(n, size):
    data = make_batch(n, seed=n)
    parts = data.split(size)
    assert [len(p) for p in parts] == [min(size, n - i) for i in range(0, n, size)]
    assert_same(DataProto.concat(parts), data)


def test_chunk_split_refusals():
    data = make_batch(5)
    with pytest.raises(BatchSizeMismatchError, match="5 samples cannot be split into 2 equal chunks"):
        data.chunk(2)
    with pytest.raises(ValueError, match="chunks: expected >= 1"):
        data.chunk(0)
    with pytest.raises(TypeError, match="chunks: expected an int"):
        data.chunk(2.0)
    with pytest.raises(ValueError, match="split_size"):
        data.split(0)


def test_concat_meta_and_metrics():
    a, b, c = make_batch(2, meta={"t": 1}), make_batch(3, seed=1, meta={"t": 1}), make_batch(1, seed=2, meta={"t": 1})
    a.meta_info["metrics"] = {"loss": 0.5, "acc": [1.0, 2.0]}
    b.meta_info["metrics"] = {"loss": 0.25}
    c.meta_info["extra"] = "only here"
    out = DataProto.concat([a, b, c])
    assert len(out) == 6 and out.meta_info == {"t": 1, "metrics": {"loss": [0.5, 0.25], "acc": [1.0, 2.0]},
                                               "extra": "only here"}
    assert out.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u0", "u1", "u2", "u0"]


def test_concat_refusals():
    a, b = make_batch(2, meta={"t": 1}), make_batch(2, meta={"t": 2})
    with pytest.raises(MetaInfoConflictError, match=r"meta_info\['t'\] differs.*1 vs 2"):
        DataProto.concat([a, b])
    with pytest.raises(ValueError, match="empty list"):
        DataProto.concat([])
    with pytest.raises(TypeError, match=r"data\[1\]"):
        DataProto.concat([a, "x"])
    c = make_batch(2, meta={"t": 1})
    c.batch.pop("prompts")
    with pytest.raises(KeyError, match=r"data\[1\] batch keys differ.*missing \['prompts'\]"):
        DataProto.concat([make_batch(2, meta={"t": 1}), c])
    d = make_batch(2, meta={"t": 1})
    d.non_tensor_batch.pop("uid")
    with pytest.raises(KeyError, match=r"non_tensor_batch keys differ.*missing \['uid'\]"):
        DataProto.concat([make_batch(2, meta={"t": 1}), d])
    with pytest.raises(DataProtoError, match=r"data\[1\] has no batch"):
        DataProto.concat([make_batch(1), DataProto.from_dict(non_tensors={"uid": ["x"]})])
    jag = DataProto.from_dict({"x": to_nested([torch.ones(2)])})
    with pytest.raises(BatchSizeMismatchError, match=r"'x' is dense float32 \[n, 2\] in data\[1\] but jagged"):
        DataProto.concat([jag, DataProto.from_dict({"x": torch.ones(1, 2)})])
    with pytest.raises(BatchSizeMismatchError, match=r"'x' is jagged int64 \[n, j\] in data\[1\]"):
        DataProto.concat([jag, DataProto.from_dict({"x": to_nested([torch.ones(2, dtype=torch.int64)])})])
    with pytest.raises(BatchSizeMismatchError, match=r"'x' is dense float32 \[n, 3\] in data\[1\] but dense "
                                                     r"float32 \[n, 2\]"):
        DataProto.concat([DataProto.from_dict({"x": torch.ones(1, 2)}), DataProto.from_dict({"x": torch.ones(1, 3)})])
    e = make_batch(1)
    e.meta_info["metrics"] = [1]
    with pytest.raises(TypeError, match="metrics"):
        DataProto.concat([e])


def test_union_adds_columns_and_refuses_conflicts():
    data = make_batch(3, meta={"t": 1})
    extra = DataProto.from_dict({"advantages": to_nested([torch.ones(2), torch.ones(0), torch.ones(1)]),
                                 "reward_score": data.batch["reward_score"].clone()},
                                {"uid": data.non_tensor_batch["uid"].copy(), "score": [1, 2, 3]},
                                meta_info={"t": 1, "u": 2})
    assert data.union(extra) is data
    assert {"advantages", "reward_score"} <= set(data.batch.keys()) and data.non_tensor_batch["score"].tolist() == [1, 2, 3]
    assert data.meta_info == {"t": 1, "u": 2}
    assert nested_lengths(data.batch["advantages"]).tolist() == [2, 0, 1]
    # NaN equals NaN for union purposes
    nan = DataProto.from_dict({"v": torch.tensor([float("nan"), 1.0, 2.0])})
    nan.union(DataProto.from_dict({"v": torch.tensor([float("nan"), 1.0, 2.0])}))
    # jagged vs jagged with different lengths or values
    bad = DataProto.from_dict({"advantages": to_nested([torch.ones(2), torch.ones(1), torch.ones(0)])})
    with pytest.raises(UnionConflictError, match="'advantages'"):
        data.union(bad)
    with pytest.raises(UnionConflictError, match="'reward_score'"):
        data.union(DataProto.from_dict({"reward_score": torch.zeros(3)}))
    with pytest.raises(UnionConflictError, match=r"non_tensor_batch\['uid'\]"):
        data.union(DataProto.from_dict(non_tensors={"uid": ["x", "y", "z"]}))
    with pytest.raises(UnionConflictError, match=r"meta_info\['t'\]"):
        data.union(DataProto(meta_info={"t": 5}))
    with pytest.raises(BatchSizeMismatchError, match="3 samples, the other 2"):
        data.union(make_batch(2))
    with pytest.raises(TypeError, match="DataProto"):
        data.union({"a": 1})
    # a DataProto without a batch takes the other's
    objs = DataProto.from_dict(non_tensors={"uid": ["a"]})
    objs.union(DataProto.from_dict({"x": torch.ones(1)}))
    assert list(objs.batch.keys()) == ["x"]


def test_union_module_functions():
    td1 = TensorDict({"a": torch.ones(2)}, batch_size=[2])
    td2 = TensorDict({"a": torch.ones(2), "b": torch.zeros(2)}, batch_size=[2])
    assert set(union_tensor_dict(td1, td2).keys()) == {"a", "b"}
    with pytest.raises(BatchSizeMismatchError, match=r"\(2,\) vs \(3,\)"):
        union_tensor_dict(td1, TensorDict({"c": torch.ones(3)}, batch_size=[3]))
    with pytest.raises(UnionConflictError, match="'a'"):
        union_tensor_dict(td1, TensorDict({"a": torch.ones(2, dtype=torch.int64)}, batch_size=[2]))
    d = union_numpy_dict({"x": to_object_array([[1], [2]])}, {"x": to_object_array([[1], [2]]), "y": np.arange(2)})
    assert set(d) == {"x", "y"}
    with pytest.raises(UnionConflictError, match="'x'"):
        union_numpy_dict({"x": np.array([1.0, np.nan])}, {"x": np.array([1.0, 2.0])})
    assert union_numpy_dict({"x": np.array([1.0, np.nan])}, {"x": np.array([1.0, np.nan])})
    assert union_meta_info({"a": {"b": [1]}}, {"a": {"b": [1]}, "c": 2}) == {"a": {"b": [1]}, "c": 2}


# ------------------------------------------------------------------------------------------------ reorder


@SETTINGS
@given(n=st.integers(1, 9), seed=st.integers(0, 1000))
def test_reorder_then_inverse_is_identity(n, seed):
    data = make_batch(n, seed=seed)
    original = sample_rows(data)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    assert data.reorder(perm) is None
    assert sample_rows(data) == [original[i] for i in perm.tolist()]
    data.reorder(torch.argsort(perm))
    assert sample_rows(data) == original


def test_reorder_refusals():
    data = make_batch(3)
    with pytest.raises(BatchSizeMismatchError, match="2 indices for a batch of 3"):
        data.reorder([0, 1])
    with pytest.raises(IndexError, match="position 3"):
        data.reorder([0, 1, 3])


# ------------------------------------------------------------------------------------------------- repeat


@SETTINGS
@given(n=st.integers(1, 6), k=st.integers(1, 4), interleave=st.booleans())
def test_repeat_grouping(n, k, interleave):
    data = make_batch(n, seed=n + k)
    rows = sample_rows(data)
    out = data.repeat(k, interleave=interleave)
    got = sample_rows(out)
    assert len(out) == n * k
    for i in range(n):
        group = got[i * k:(i + 1) * k] if interleave else got[i::n]
        assert group == [rows[i]] * k  # interleave: group i occupies rows [i*k, (i+1)*k)
    assert out.meta_info == data.meta_info and out.meta_info is not data.meta_info


@SETTINGS
@given(times=st.lists(st.integers(0, 3), min_size=1, max_size=6))
def test_sample_level_repeat(times):
    data = make_batch(len(times), seed=len(times))
    rows = sample_rows(data)
    for kind in (list, np.array, torch.tensor):
        out = data.sample_level_repeat(kind(times))
        assert sample_rows(out) == [r for r, t in zip(rows, times) for _ in range(t)]


def test_repeat_refusals():
    data = make_batch(3)
    with pytest.raises(ValueError, match="repeat_times: expected >= 1"):
        data.repeat(0)
    with pytest.raises(BatchSizeMismatchError, match="expected 3 repeat counts"):
        data.sample_level_repeat([1, 2])
    with pytest.raises(ValueError, match=r"repeat_times\[1\] = -1"):
        data.sample_level_repeat([1, -1, 2])
    with pytest.raises(TypeError, match="integer repeat counts"):
        data.sample_level_repeat([1.5, 1, 1])


# ---------------------------------------------------------------------------------------------- pad / unpad


@SETTINGS
@given(n=st.integers(1, 9), divisor=st.integers(1, 6))
def test_pad_unpad_round_trip(n, divisor):
    data = make_batch(n, seed=n)
    rows = sample_rows(data)
    padded, pad_size = pad_dataproto_to_divisor(data, divisor)
    assert len(padded) % divisor == 0 and pad_size == (-n) % divisor and len(padded) == n + pad_size
    assert sample_rows(padded)[n:] == [rows[i % n] for i in range(pad_size)]
    assert_same(unpad_dataproto(padded, pad_size), data)


def test_pad_unpad_refusals():
    empty, pad_size = pad_dataproto_to_divisor(make_batch(2)[[]], 3)  # 0 is divisible by anything
    assert len(empty) == 0 and pad_size == 0
    with pytest.raises(ValueError, match="size_divisor: expected >= 1"):
        pad_dataproto_to_divisor(make_batch(2), 0)
    with pytest.raises(TypeError, match="DataProto"):
        pad_dataproto_to_divisor([1], 2)
    with pytest.raises(BatchSizeMismatchError, match="pad_size 3 exceeds the batch's 2"):
        unpad_dataproto(make_batch(2), 3)
    with pytest.raises(ValueError, match="pad_size: expected >= 0"):
        unpad_dataproto(make_batch(2), -1)


# ------------------------------------------------------------------------------------ pickling / disk / device


def test_pickle_consolidates_and_round_trips(tmp_path):
    data = make_batch(6, meta={"t": 3, "metrics": {"a": [1]}})
    sliced = data[1:5]  # views into the full batch's buffers
    kind, _, buffer = sliced.__getstate__()["batch"]
    assert kind == "consolidated-buffer" and buffer.dtype == np.uint8  # one contiguous buffer
    payload = sum(v.values().nbytes if v.is_nested else v.nbytes for v in sliced.batch.values())
    assert payload <= buffer.nbytes < payload + 4096  # offsets and alignment only
    back = pickle.loads(pickle.dumps(sliced))
    assert_same(back, sliced)
    assert nested_lengths(back.batch["responses"]).tolist() == nested_lengths(sliced.batch["responses"]).tolist()
    assert back.batch["old_log_probs"].dtype == torch.float32
    # a slice pickles only its own samples, not the parent's buffers
    assert len(pickle.dumps(sliced)) < len(pickle.dumps(data))
    path = tmp_path / "batch.pkl"
    data.save_to_disk(path)
    assert_same(DataProto.load_from_disk(path), data)
    with open(tmp_path / "other.pkl", "wb") as f:
        pickle.dump({"x": 1}, f)
    with pytest.raises(TypeError, match="not a DataProto"):
        DataProto.load_from_disk(tmp_path / "other.pkl")
    assert_same(copy.deepcopy(data), data)
    objs = DataProto.from_dict(non_tensors={"u": [1, 2]})
    assert_same(pickle.loads(pickle.dumps(objs)), objs)


def test_pickle_state_fallback_and_edits_after_unpickling():
    data = make_batch(3)
    kind, td = _batch_state(data.batch, fast=False)
    assert kind == "consolidated-tensordict" and td.is_consolidated()
    assert_same(DataProto(batch=_batch_from_state((kind, td)), non_tensor_batch=data.non_tensor_batch,
                          meta_info=data.meta_info), data)
    assert _batch_from_state(None) is None
    with pytest.raises(DataProtoError, match="unknown pickled batch format"):
        _batch_from_state(("other", None))
    # An unpickled (consolidated) batch stays editable; edits survive the next pickle.
    back = pickle.loads(pickle.dumps(data))
    back.batch.pop("prompts")
    back.batch["new"] = torch.zeros(3)
    back.rename("responses", "resp")
    again = pickle.loads(pickle.dumps(back))
    assert set(again.batch.keys()) == {"resp", "response_mask", "old_log_probs", "reward_score", "sample_id", "new"}
    assert nested_lengths(again.batch["resp"]).tolist() == nested_lengths(data.batch["responses"]).tolist()
    empty_batch = DataProto(batch=TensorDict({}, batch_size=[2]))
    assert len(pickle.loads(pickle.dumps(empty_batch))) == 2


def test_to_device_in_place():
    data = make_batch(2)
    assert data.to("cpu") is data and data.batch.device == torch.device("cpu")
    assert nested_lengths(data.batch["responses"]).numel() == 2


@SETTINGS
@given(n=st.integers(0, 6), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.bool, torch.int64]))
def test_serialize_tensordict_round_trip(n, dtype):
    g = torch.Generator().manual_seed(n)
    lens = torch.randint(0, 5, (n,), generator=g).tolist()
    jag = to_nested([(torch.randn(k, generator=g) * 3).to(dtype) for k in lens], dtype=dtype)
    td = TensorDict({"j": jag, "d": torch.randn(n, 2, generator=g).to(dtype),
                     "sub": TensorDict({"a": torch.arange(n)}, batch_size=[n])}, batch_size=[n])
    raw = serialize_tensordict(td)
    batch_size, device, items = raw
    assert batch_size == (n,) and device is None and set(items) == {"j", "d", ("sub", "a")}
    assert all(isinstance(c[2], np.ndarray) for c in items["j"][1]) and isinstance(items["d"][2], np.ndarray)
    back = deserialize_tensordict(pickle.loads(pickle.dumps(raw)))
    assert back.batch_size == td.batch_size
    assert nested_lengths(back["j"]).tolist() == lens and back["j"].dtype == dtype
    assert torch.equal(nested_values(back["j"]), nested_values(td["j"]))
    assert torch.equal(back["d"], td["d"]) and torch.equal(back["sub", "a"], td["sub", "a"])


def test_serialize_refusals():
    with pytest.raises(TypeError, match="TensorDict"):
        serialize_tensordict({"a": 1})
    td = TensorDict({"x": torch.ones(2)}, batch_size=[2])
    td["s"] = NonTensorStack("a", "b")
    with pytest.raises(TypeError, match="'s'"):
        serialize_tensordict(td)
    with pytest.raises(ValueError, match="format"):
        deserialize_tensordict({"format": "other"})
    batch_size, device, items = serialize_tensordict(TensorDict({"x": torch.ones(2)}, batch_size=[2]))
    items["x"] = ("notatype", *items["x"][1:])
    with pytest.raises(ValueError, match="notatype"):
        deserialize_tensordict((batch_size, device, items))


# ----------------------------------------------------------------------------------------------- iterate


def test_make_iterator_reproducible_and_complete():
    data = make_batch(8)
    kw = {"shuffle": True}
    first = [b.batch["sample_id"].tolist() for b in data.make_iterator(2, epochs=3, seed=7, dataloader_kwargs=kw)]
    again = [b.batch["sample_id"].tolist() for b in data.make_iterator(2, epochs=3, seed=7, dataloader_kwargs=kw)]
    other = [b.batch["sample_id"].tolist() for b in data.make_iterator(2, epochs=3, seed=8, dataloader_kwargs=kw)]
    assert first == again and first != other and len(first) == 12
    for epoch in range(3):
        assert sorted(sum(first[epoch * 4:(epoch + 1) * 4], [])) == list(range(8))
    assert first[:4] != first[4:8]  # each epoch reshuffles
    plain = [b.batch["sample_id"].tolist() for b in data.make_iterator(4, epochs=1)]
    assert plain == [[0, 1, 2, 3], [4, 5, 6, 7]]
    mb = next(data.make_iterator(4, epochs=1))
    assert mb.meta_info == data.meta_info and mb.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u3"]


def test_make_iterator_refusals():
    data = make_batch(6)
    with pytest.raises(BatchSizeMismatchError, match="6 samples are not divisible by mini_batch_size 4"):
        data.make_iterator(4, 1)
    with pytest.raises(ValueError, match="unsupported dataloader_kwargs.*num_workers"):
        data.make_iterator(2, 1, dataloader_kwargs={"num_workers": 2})
    with pytest.raises(ValueError, match="epochs: expected >= 1"):
        data.make_iterator(2, 0)


# ------------------------------------------------------------------------------------------------- collate


def test_collate_items_and_rows():
    data = make_batch(4)
    out = collate_fn([data[i] for i in range(4)])
    assert_same(out, data)  # jagged fields come back jagged, dense ones stacked
    rows = [{"input_ids": torch.arange(3), "resp": torch.arange(i), "raw_prompt": [{"c": i}], "ds": "gsm"}
            for i in range(3)]
    batch = collate_fn(rows)
    assert batch["input_ids"].shape == (3, 3) and nested_lengths(batch["resp"]).tolist() == [0, 1, 2]
    assert batch["raw_prompt"].dtype == object and batch["raw_prompt"].shape == (3,)
    assert batch["ds"].tolist() == ["gsm"] * 3


def test_collate_refusals():
    with pytest.raises(ValueError, match="at least one"):
        collate_fn([])
    with pytest.raises(TypeError, match="all DataProtoItem or all dicts"):
        collate_fn([{"a": 1}, 3])
    with pytest.raises(KeyError, match="row 1 has keys"):
        collate_fn([{"a": 1}, {"b": 1}])
    with pytest.raises(BatchSizeMismatchError, match="'x' has shapes"):
        collate_fn([{"x": torch.ones(2, 3)}, {"x": torch.ones(2, 4)}])
    data = make_batch(2)
    other = make_batch(1)
    other.batch.pop("prompts")
    with pytest.raises(KeyError, match="item 1 has batch keys"):
        collate_fn([data[0], other[0]])


def test_docstring_examples_run():
    import doctest

    import protocol.batch.dataproto as dataproto_mod

    result = doctest.testmod(dataproto_mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batch_round_trips():
    data = make_batch(4).to("cuda")
    assert data.batch["responses"].device.type == "cuda"
    assert data.__getstate__()["batch"][0] == "consolidated-tensordict"  # accelerator buffers use torch's pickling
    back = pickle.loads(pickle.dumps(data))
    assert back.batch["responses"].device.type == "cuda"
    assert_same(back.to("cpu"), data.to("cpu"))
    assert_same(DataProto.concat(data.chunk(2)).to("cpu"), data.to("cpu"))
