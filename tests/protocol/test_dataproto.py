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
    DataProtoConfig,
    DataProtoError,
    DataProtoItem,
    DataProtoKeyError,
    DataProtoTypeError,
    MetaInfoConflictError,
    UnionConflictError,
    auto_padding,
    collate_fn,
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    list_of_dict_to_dict_of_list,
    pad_dataproto_to_divisor,
    serialize_single_tensor,
    serialize_tensordict,
    _batch_from_state,
    _batch_state,
    to_object_array,
    unfold_batch_dim,
    union_meta_info,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)
from protocol.batch.nested import is_strided_nested, nested_lengths, nested_values, strided_nested, to_nested

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


# ------------------------------------------------------------------------------ the reference system's semantics
# Written from the reference DataProto's documented behaviour: what its own CPU tests exercise must hold here too.


def test_refusals_are_assertion_errors_as_in_the_reference():
    """Code written against the reference catches AssertionError; every refusal it asserts is one here too."""
    obs = torch.randn(4, 2)
    with pytest.raises(AssertionError):
        union_tensor_dict(TensorDict({"obs": obs}, [4]), TensorDict({"obs": obs + 1}, [4]))
    with pytest.raises(AssertionError):
        union_numpy_dict({"a": np.arange(3)}, {"a": np.arange(3) + 1})
    with pytest.raises(AssertionError):
        DataProto.from_dict({"obs": obs}).chunk(3)
    for dims in (2, 3):
        with pytest.raises(AssertionError):
            DataProto.from_dict({"obs": obs, "act": torch.randn(4, 2, 3)}, num_batch_dims=dims)
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'config'"):
        DataProto.concat([DataProto.from_dict({"obs": obs}, meta_info={"config": "A"}),
                          DataProto.from_dict({"obs": obs}, meta_info={"config": "B"})])
    data = DataProto.from_dict({"obs": obs}, meta_info={"k": 1})
    for kwargs in ({"batch_keys": ["nope"]}, {"meta_info_keys": ["nope"]}, {"non_tensor_batch_keys": ["nope"]}):
        with pytest.raises(AssertionError):
            data.pop(**kwargs)
        with pytest.raises(KeyError):  # and still a KeyError for code that expects one
            data.pop(**kwargs)
    with pytest.raises(AssertionError):
        data.make_iterator(mini_batch_size=3, epochs=1)
    with pytest.raises(AssertionError):
        pad_dataproto_to_divisor("not a DataProto", 2)
    with pytest.raises(ValueError):  # the reference raises ValueError for an unsupported value type
        DataProto.from_single_dict({"s": 3})
    assert issubclass(DataProtoTypeError, TypeError) and issubclass(DataProtoKeyError, KeyError)


def test_union_numpy_dict_deep_equality():
    """N-d arrays, object arrays (NaN and the string 'nan'), nested object arrays and NaN positions."""
    arr_3d = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    union_numpy_dict({"x": arr_3d}, {"x": arr_3d.copy()})
    with pytest.raises(UnionConflictError, match="'x'"):
        union_numpy_dict({"x": arr_3d}, {"x": arr_3d + 1})
    nan_mix = np.array([float("nan")] * 4 + ["nan"], dtype=object)
    union_numpy_dict({"b": nan_mix}, {"b": nan_mix.copy()})
    sub1, sub2 = np.array([1, 2]), np.array([3.0, 4.0])
    obj_2d = np.array([[sub1, "text"], [sub2, None]], dtype=object)
    union_numpy_dict({"d": obj_2d}, {"d": obj_2d.copy()})
    with pytest.raises(UnionConflictError):
        union_numpy_dict({"d": obj_2d}, {"d": np.array([[sub1, "text"], [sub2, "other"]], dtype=object)})
    obj_4d = np.empty((2, 1, 1, 1), dtype=object)
    obj_4d[0, 0, 0, 0], obj_4d[1, 0, 0, 0] = sub1, sub2
    other_4d = obj_4d.copy()
    other_4d[1, 0, 0, 0] = np.array([9, 9])
    union_numpy_dict({"d": obj_4d}, {"d": obj_4d.copy()})
    with pytest.raises(UnionConflictError):
        union_numpy_dict({"d": obj_4d}, {"d": other_4d})
    nan_arr = np.array([1.0, np.nan, 3.0])
    union_numpy_dict({"n": nan_arr}, {"n": np.array([1.0, np.nan, 3.0])})
    for other in (np.array([1.0, 2.0, 3.0]), np.array([np.nan, 1.0, 3.0])):
        with pytest.raises(UnionConflictError):
            union_numpy_dict({"n": nan_arr}, {"n": other})
    nan32 = np.empty(1, dtype=object)
    nan32[0] = np.float32("nan")
    union_numpy_dict({"f": nan32}, {"f": nan32.copy()})  # NaN of a numpy scalar type is equal to itself too


def test_union_terminates_on_cyclic_values():
    """Self-referencing object arrays (and lists) compare structurally instead of recursing forever."""
    def cyclic():
        arr = np.array([None], dtype=object)
        arr[0] = arr
        return arr

    union_numpy_dict({"c": cyclic()}, {"c": cyclic()})
    with pytest.raises(UnionConflictError):
        union_numpy_dict({"c": cyclic()}, {"c": np.array([None], dtype=object)})
    a, b = [1], [1]
    a.append(a)
    b.append(b)
    union_meta_info({"m": a}, {"m": b})
    c = [2]
    c.append(c)
    with pytest.raises(UnionConflictError):
        union_meta_info({"m": a}, {"m": c})
    # Two cycles of different shape: [x, [x, ...]] vs a direct self-reference.
    outer, inner = np.empty(2, dtype=object), np.empty(2, dtype=object)
    outer[0], outer[1], inner[0], inner[1] = 1, inner, 1, outer
    direct = np.empty(2, dtype=object)
    direct[0], direct[1] = 1, direct
    union_numpy_dict({"c": outer}, {"c": direct})  # both unfold to the same infinite structure


def test_concat_merges_metrics_of_every_worker():
    def part(lo, meta):
        return DataProto.from_dict({"obs": torch.tensor([lo, lo + 1])}, meta_info=meta)

    workers = [part(1, {"metrics": [{"loss": 0.5, "accuracy": 0.9}], "config_flag": True}),
               part(3, {"metrics": [{"loss": 0.6, "accuracy": 0.85}], "config_flag": True}),
               part(5, {"metrics": [{"loss": 0.55, "accuracy": 0.88}], "config_flag": True})]
    out = DataProto.concat(workers)
    assert out.batch["obs"].tolist() == [1, 2, 3, 4, 5, 6]
    assert out.meta_info == {"metrics": {"loss": [0.5, 0.6, 0.55], "accuracy": [0.9, 0.85, 0.88]},
                             "config_flag": True}
    # One worker without metrics (first or not), plain dicts instead of lists, None, several dicts per worker.
    assert DataProto.concat([part(1, {"metrics": [{"loss": 0.5}], "flag": True}),
                             part(3, {"flag": True})]).meta_info == {"metrics": {"loss": [0.5]}, "flag": True}
    assert DataProto.concat([part(1, {"f": True}), part(3, {"metrics": {"loss": 0.6}, "f": True}),
                             part(5, {"metrics": {"loss": 0.55}, "f": True})]).meta_info["metrics"] == \
        {"loss": [0.6, 0.55]}
    assert DataProto.concat([part(1, {"metrics": None}), part(3, {"metrics": [{"a": 1}, {"a": 2}]})]).meta_info == \
        {"metrics": {"a": [1, 2]}}
    assert "metrics" not in DataProto.concat([part(1, {"metrics": None}), part(3, {})]).meta_info
    merged = DataProto.concat([part(1, {"config": "A", "shared": "X"}), part(3, {"extra": "B", "shared": "X"}),
                               part(5, {"another": "C", "shared": "X"})]).meta_info
    assert merged == {"config": "A", "shared": "X", "extra": "B", "another": "C"}
    with pytest.raises(DataProtoTypeError, match=r"data\[0\].meta_info\['metrics'\]\[1\] is int"):
        DataProto.concat([part(1, {"metrics": [{"a": 1}, 2]})])


def test_list_of_dict_to_dict_of_list():
    assert list_of_dict_to_dict_of_list([]) == {}
    assert list_of_dict_to_dict_of_list([{"a": 1, "b": 2}, {"a": 3}]) == {"a": [1, 3], "b": [2]}
    with pytest.raises(DataProtoTypeError, match="entry 1 is list"):
        list_of_dict_to_dict_of_list([{"a": 1}, [1]])


def test_serialize_single_tensor_round_trip_every_dtype():
    dtypes = [torch.float32, torch.float64, torch.int32, torch.int64, torch.bool, torch.bfloat16, torch.float16,
              torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2]
    for dtype in dtypes:
        t = (torch.randn(3, 4, 5) * 4).to(dtype)
        name, shape, data = serialize_single_tensor(t)
        assert name == str(dtype).removeprefix("torch.") and shape == (3, 4, 5) and data.dtype == np.uint8
        for raw in (data, data.tobytes(), memoryview(data.tobytes())):  # any byte buffer reads back
            back = deserialize_single_tensor((name, shape, raw))
            assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    with pytest.raises(ValueError, match=r"needs 8 bytes, found 4"):
        deserialize_single_tensor(("float32", (2,), np.zeros(4, dtype=np.uint8)))
    with pytest.raises(TypeError, match="dense"):
        serialize_single_tensor(to_nested([torch.ones(2)]))


def test_serialize_tensordict_tuple_keeps_batch_dims_and_device():
    td = TensorDict({"tensor1": torch.randn(5, 3, 4), "tensor2": torch.randint(0, 10, (5, 3, 2))},
                    batch_size=(5, 3), device="cpu")
    batch_size, device, items = serialize_tensordict(td)
    assert batch_size == (5, 3) and device == "cpu" and set(items) == {"tensor1", "tensor2"}
    back = deserialize_tensordict((batch_size, device, items))
    assert back.batch_size == td.batch_size and str(back.device) == "cpu"
    for key in td.keys():
        assert back[key].dtype == td[key].dtype and torch.equal(back[key], td[key])
    empty = deserialize_tensordict(serialize_tensordict(TensorDict({}, batch_size=[4])))
    assert empty.batch_size == (4,) and not list(empty.keys()) and empty.device is None


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_serialize_tensordict_nested_layouts_and_readers():
    strided = torch.nested.as_nested_tensor([torch.randn(2, 3), torch.randn(3, 4), torch.randn(1, 5)])
    jagged = to_nested([torch.arange(2), torch.arange(0), torch.arange(4)])
    td = TensorDict({"nested": strided, "jag": jagged, "regular": torch.randn(3, 4, 5)}, batch_size=(3,))
    raw = serialize_tensordict(td)
    assert raw[2]["nested"][0] == "strided" and raw[2]["jag"][0] == "jagged" and len(raw[2]["jag"][1]) == 3
    back = deserialize_tensordict(pickle.loads(pickle.dumps(raw)))
    assert back["nested"].layout == torch.strided and back["jag"].layout == torch.jagged
    for key in ("nested", "jag"):
        for a, b in zip(td[key].unbind(), back[key].unbind(), strict=True):
            assert a.shape == b.shape and torch.equal(a, b)
    # A tuple built by hand the way the reference writes it (bytes as a plain buffer) reads back the same.
    items = {"x": ("int64", (2,), torch.tensor([7, 8]).numpy().tobytes()),
             "n": ("jagged", [("float32", (1,), np.float32([1.5]).tobytes()), ("float32", (0,), b"")])}
    ref = deserialize_tensordict(((2,), None, items))
    assert ref["x"].tolist() == [7, 8] and nested_lengths(ref["n"]).tolist() == [1, 0]
    # The earlier dict format of this project still reads back.
    v1 = {"format": "rldispatch.td.v1", "batch_size": (2,), "fields": {
        ("d",): {"kind": "dense", "dtype": "int64", "shape": (2,), "data": torch.tensor([3, 4]).numpy().view(np.uint8)},
        ("j",): {"kind": "jagged", "dtype": "float32", "shape": (3,), "data": np.float32([1, 2, 3]).view(np.uint8),
                 "offsets": np.array([0, 1, 3])}}}
    old = deserialize_tensordict(v1)
    assert old["d"].tolist() == [3, 4] and [c.tolist() for c in old["j"].unbind()] == [[1.0], [2.0, 3.0]]
    with pytest.raises(AssertionError, match="expected length|parts"):
        deserialize_tensordict(((1,), None, {"x": ("int64", (1,))}))


def _strided_batch(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    comps = [torch.randn(*s, generator=g) for s in shapes]
    return DataProto.from_dict({"img": strided_nested(comps), "id": torch.arange(len(shapes))},
                               {"uid": [f"u{i}" for i in range(len(shapes))]}), comps


strided_shapes = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3)), min_size=1, max_size=6)


@SETTINGS
@given(shapes=strided_shapes, data_=st.data())
def test_strided_nested_fields_follow_every_sample_operation(shapes, data_):
    """Ragged-in-two-dims samples move with their uid through index, slice, repeat, chunk, concat and pickling."""
    data, comps = _strided_batch(shapes)
    n = len(shapes)

    def check(out, idx):
        assert is_strided_nested(out.batch["img"]) and out.batch["img"].size(0) == len(idx)
        assert out.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in idx]
        for got, i in zip(out.batch["img"].unbind(), idx):
            assert torch.equal(got, comps[i])

    idx = data_.draw(st.lists(st.integers(0, n - 1), max_size=8))
    check(data.select_idxs(idx), idx)
    mask = data_.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    check(data[np.array(mask)], [i for i in range(n) if mask[i]])
    check(data[1::2], list(range(n))[1::2])
    check(data.repeat(2), [i for i in range(n) for _ in range(2)])
    check(data.repeat(2, interleave=False), list(range(n)) * 2)
    check(DataProto.concat(data.repeat(2).chunk(2)), [i for i in range(n) for _ in range(2)])
    check(DataProto.concat([data, data[::-1]]), list(range(n)) + list(range(n))[::-1])
    check(pickle.loads(pickle.dumps(data)), list(range(n)))
    perm = data_.draw(st.permutations(list(range(n))))
    moved = data.select_idxs(list(range(n)))
    moved.reorder(torch.tensor(perm))
    check(moved, perm)
    padded, pad = pad_dataproto_to_divisor(data, 4)
    check(unpad_dataproto(padded, pad), list(range(n)))
    assert data.select(batch_keys=["img"]).union(data) is not None  # equal strided fields union cleanly
    other, _ = _strided_batch(shapes, seed=1)
    if any(a * b for a, b in shapes):
        with pytest.raises(UnionConflictError, match="'img'"):
            data.select(batch_keys=["img"]).union(other)


def test_strided_concat_refuses_other_layouts():
    data, _ = _strided_batch([(1, 2), (2, 1)])
    dense = DataProto.from_dict({"img": torch.zeros(1, 2, 2), "id": torch.arange(1)}, {"uid": ["x"]})
    with pytest.raises(BatchSizeMismatchError, match=r"'img' is dense float32 \[n, 2, 2\] in data\[1\] but "
                                                     r"strided-nested float32 \[n, \*, \*\]"):
        DataProto.concat([data, dense])


def test_from_tensordict_and_to_tensordict_with_nested_python_values():
    raw_prompt = [[{"content": "Q1", "role": "user"}], [{"content": "Q2", "role": "user"},
                                                         {"content": "A2", "role": "assistant"}], [{"content": "Q3"}]]
    data = DataProto.from_dict(
        tensors={"obs": torch.tensor([1, 2, 3])},
        non_tensors={"labels": ["a", "b", "c"], "turn_scores": [[], [0.5, 0.8], [0.9]],
                     "reward_extra_info": [{"acc": 1.0}, {"acc": 0.0}, {"acc": 1.0}], "raw_prompt": raw_prompt,
                     "num_turns": np.array([2, 4, 1], dtype=np.int32)},
        meta_info={"global_steps": 42})
    td = data.to_tensordict()
    assert torch.equal(td["obs"], torch.tensor([1, 2, 3])) and td["global_steps"] == 42
    assert td["labels"] == ["a", "b", "c"]
    assert [list(x) for x in td["turn_scores"]] == [[], [0.5, 0.8], [0.9]]
    assert [dict(x) for x in td["reward_extra_info"]] == [{"acc": 1.0}, {"acc": 0.0}, {"acc": 1.0}]
    assert dict(td["raw_prompt"][1][1]) == {"content": "A2", "role": "assistant"}
    back = DataProto.from_tensordict(td)
    assert back.meta_info == {"global_steps": 42} and torch.equal(back.batch["obs"], data.batch["obs"])
    assert back.non_tensor_batch["labels"].tolist() == ["a", "b", "c"]
    assert [list(x) for x in back.non_tensor_batch["turn_scores"]] == [[], [0.5, 0.8], [0.9]]
    assert [list(x) for x in back.non_tensor_batch["raw_prompt"]] == raw_prompt
    assert back.non_tensor_batch["num_turns"].tolist() == [2, 4, 1]
    built = TensorDict({"obs": torch.arange(6)}, batch_size=[6])
    built["labels"] = NonTensorStack(*"abcdef")
    built.set_non_tensor("name", "abdce")
    got = DataProto.from_tensordict(built)
    assert got.non_tensor_batch["labels"].tolist() == list("abcdef") and got.meta_info["name"] == "abdce"


def test_subclasses_and_auto_padding_keywords_are_kept():
    class CustomProto(DataProto):
        pass

    assert type(CustomProto.from_single_dict({"x": torch.tensor([0])})) is CustomProto
    assert type(CustomProto.from_dict({"x": torch.tensor([0])}).repeat(2)) is CustomProto
    flagged = DataProto.from_dict({"a": torch.zeros(3)}, auto_padding=True)
    assert flagged.meta_info == {DataProtoConfig.auto_padding_key: True} and flagged.is_padding_enabled()
    assert DataProto.from_single_dict({"a": torch.zeros(3)}, auto_padding=True).is_padding_enabled()
    assert not DataProto.from_dict({"a": torch.zeros(3)}).is_padding_enabled()
    assert [len(c) for c in flagged.chunk(2)] == [2, 1]


def test_auto_padding_switch_env_and_context(monkeypatch):
    monkeypatch.delenv("VERL_AUTO_PADDING", raising=False)
    assert DataProtoConfig.auto_padding is False
    with auto_padding():
        assert DataProtoConfig.auto_padding is True
        with auto_padding(False):
            assert DataProtoConfig.auto_padding is False
        assert DataProtoConfig.auto_padding is True
    assert DataProtoConfig.auto_padding is False
    with pytest.raises(RuntimeError), auto_padding():
        raise RuntimeError("restored even on error")
    assert DataProtoConfig.auto_padding is False
    with pytest.raises(AssertionError, match="expected a bool, found 1"):
        DataProtoConfig.auto_padding = 1
    for value in ("1", "true", "TRUE"):
        monkeypatch.setenv("VERL_AUTO_PADDING", value)
        assert DataProtoConfig.auto_padding is True
    monkeypatch.setenv("VERL_AUTO_PADDING", "0")
    assert DataProtoConfig.auto_padding is False


@SETTINGS
@given(n=st.integers(1, 19), chunks=st.integers(1, 6), first=st.booleans())
def test_padding_then_chunk_gives_equal_parts(n, chunks, first):
    data = DataProto.from_dict({"a": torch.arange(n)}, {"na": np.arange(n).astype(object)})
    size = (-n) % chunks
    data.padding(size, "first" if first else "")
    assert len(data) == n + size
    pad_source = 0 if first else n - 1
    assert data.batch["a"].tolist() == list(range(n)) + [pad_source] * size
    assert data.non_tensor_batch["na"].tolist() == list(range(n)) + [pad_source] * size
    parts = data.chunk(chunks)
    assert [len(p) for p in parts] == [(n + size) // chunks] * chunks
    with auto_padding():  # an indivisible batch splits into exactly `chunks` parts, sizes within one of each other
        raw = DataProto.from_dict({"a": torch.arange(n)})
        sizes = [len(p) for p in raw.chunk(chunks)]
        assert len(sizes) == chunks and sum(sizes) == n and max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)
        assert DataProto.concat(raw.chunk(chunks)).batch["a"].tolist() == list(range(n))


def test_padding_refusals():
    data = DataProto.from_dict({"a": torch.arange(2)})
    with pytest.raises(ValueError, match="padding_candidate"):
        data.padding(1, "middle")
    with pytest.raises(ValueError, match="padding_size: expected >= 0"):
        data.padding(-1)
    with pytest.raises(BatchSizeMismatchError, match="empty"):
        DataProto.from_dict({"a": torch.arange(0)}).padding(1)
    data.padding(0)
    assert len(data) == 2


def test_fold_and_unfold_batch_dim():
    data = DataProto.from_dict({"obs": torch.tensor([[1, 2], [3, 4], [5, 6]])}, {"labels": ["a", "b", "c"]},
                               meta_info={"info": "x"}).repeat(2)
    folded = fold_batch_dim(data, new_batch_size=3)
    assert folded.batch.batch_size == (3,) and folded.batch["obs"].tolist() == [[[1, 2], [1, 2]], [[3, 4], [3, 4]],
                                                                                [[5, 6], [5, 6]]]
    assert folded.non_tensor_batch["labels"].tolist() == [["a", "a"], ["b", "b"], ["c", "c"]]
    assert data.non_tensor_batch["labels"].shape == (6,)  # the input is left as it was
    folded.reorder(torch.tensor([1, 2, 0]))
    back = unfold_batch_dim(folded, batch_dims=2)
    assert back.batch["obs"].tolist() == [[3, 4], [3, 4], [5, 6], [5, 6], [1, 2], [1, 2]]
    assert back.non_tensor_batch["labels"].tolist() == ["b", "b", "c", "c", "a", "a"]
    assert back.meta_info == {"info": "x"}
    with pytest.raises(BatchSizeMismatchError, match="6 samples cannot fold into 4"):
        fold_batch_dim(data, 4)
    with pytest.raises(DataProtoTypeError, match="'j' is not a dense"):
        fold_batch_dim(DataProto.from_dict({"j": to_nested([torch.ones(1), torch.ones(2)])}), 1)
    with pytest.raises(BatchSizeMismatchError, match="fewer than batch_dims=2"):
        unfold_batch_dim(DataProto.from_dict({"a": torch.arange(3)}), 2)


def test_unfold_column_chunks():
    obs1 = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    obs2 = torch.tensor([[1, 2], [5, 6], [9, 10]])
    data = DataProto.from_dict({"obs1": obs1, "obs2": obs2, "r": to_nested([torch.ones(1), torch.ones(2),
                                                                             torch.ones(0)])},
                               {"labels": ["a", "b", "c"], "pairs": [["a1", "a2"], ["b1", "b2"], ["c1", "c2"]],
                                "grid": np.arange(12).reshape(3, 4)}, meta_info={"name": "abc"})
    out = data.unfold_column_chunks(2, split_keys=["obs1", "pairs", "grid"])
    assert out.batch["obs1"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]]
    assert out.batch["obs2"].tolist() == [[1, 2], [1, 2], [5, 6], [5, 6], [9, 10], [9, 10]]
    assert nested_lengths(out.batch["r"]).tolist() == [1, 1, 2, 2, 0, 0]
    assert out.non_tensor_batch["labels"].tolist() == ["a", "a", "b", "b", "c", "c"]
    assert out.non_tensor_batch["pairs"].tolist() == [["a1"], ["a2"], ["b1"], ["b2"], ["c1"], ["c2"]]
    assert out.non_tensor_batch["grid"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert out.meta_info == {"name": "abc"}
    three_d = DataProto.from_dict({"o": torch.arange(24).reshape(3, 4, 2)}).unfold_column_chunks(2, ["o"])
    assert three_d.batch["o"].shape == (6, 2, 2) and torch.equal(three_d.batch["o"][1], torch.tensor([[4, 5], [6, 7]]))
    everything = data.unfold_column_chunks(2)  # no split keys: every field is repeated
    assert torch.equal(everything.batch["obs1"], torch.repeat_interleave(obs1, 2, dim=0))
    with pytest.raises(KeyError, match=r"\['nope'\]"):
        data.unfold_column_chunks(2, ["nope"])
    with pytest.raises(BatchSizeMismatchError, match="'r' is jagged"):
        data.unfold_column_chunks(2, ["r"])
    with pytest.raises(BatchSizeMismatchError, match="not divisible by 3"):
        data.unfold_column_chunks(3, ["grid"])
    with pytest.raises(BatchSizeMismatchError, match=r"\['labels'\]\[0\] is length 1"):
        data.unfold_column_chunks(2, ["labels"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_serialize_keeps_an_accelerator_device():
    td = TensorDict({"x": torch.arange(3), "j": to_nested([torch.ones(2), torch.ones(1), torch.ones(0)])},
                    batch_size=[3], device="cuda")
    batch_size, device, items = serialize_tensordict(td)
    assert device.startswith("cuda") and isinstance(items["x"][2], np.ndarray)
    back = deserialize_tensordict((batch_size, device, items))
    assert str(back.device) == str(td.device) and back["j"].device.type == "cuda"
    assert nested_lengths(back["j"]).tolist() == [2, 1, 0] and back["x"].tolist() == [0, 1, 2]
