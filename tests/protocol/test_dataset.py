"""RLHFDataset (the reference system's parquet rows, json / jsonl, datasets folders; load-time row checks),
collate_rows, and the resumable PromptSampler / PromptLoader."""
from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings, strategies as st

from protocol.algos.reward import default_compute_score, needs_ground_truth
from protocol.rollout.dataset import (DatasetError, PromptLoader, PromptSampler, RLHFDataset, collate_rows,
                                      ground_truth_of, read_rows)
from protocol.rollout.tokenizer import CharTokenizer

TOK = CharTokenizer()


def rows(n, start=0):
    return [{"raw_prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "q" * (i % 12)}],
             "data_source": "arith", "extra_info": {"ground_truth": str(i)},
             "reward_model": {"ground_truth": str(i)}} for i in range(start, start + n)]


@pytest.fixture
def files(tmp_path):
    a, b, c = tmp_path / "a.parquet", tmp_path / "b.json", tmp_path / "c.jsonl"
    pq.write_table(pa.Table.from_pylist(rows(6)), a)
    b.write_text(json.dumps(rows(5, 6)))
    c.write_text("\n".join(json.dumps(r) for r in rows(4, 11)) + "\n\n")
    return [str(a), str(b), str(c)]


def test_reads_mixed_formats_and_filters_overlong(files, caplog):
    limit = 14
    with caplog.at_level(logging.INFO, logger="protocol.rollout.dataset"):
        ds = RLHFDataset(files, TOK, max_prompt_length=limit)
    lengths = [len(TOK.apply_chat_template(r["raw_prompt"])) for r in rows(15)]
    kept = [i for i, n in enumerate(lengths) if n <= limit]
    assert len(ds) == len(kept) and ds.num_filtered == 15 - len(kept) > 0
    assert all(n <= limit for n in ds.prompt_lengths)
    assert f"filtered {ds.num_filtered} of 15" in caplog.text
    for j, i in enumerate(kept):
        row = ds[j]
        assert row["raw_prompt"][1]["content"] == "q" * (i % 12)
        assert row["data_source"] == "arith" and row["reward_model"] == {"ground_truth": str(i)}
        assert row["extra_info"]["index"] == i and row["extra_info"]["ground_truth"] == str(i)
        assert row["extra_info"]["tools_kwargs"] == {} and row["extra_info"]["interaction_kwargs"] == {}
        assert "input_ids" not in row and "multi_modal_data" not in row
    ds[0]["extra_info"]["index"] = -5  # rows are copies
    assert ds[0]["extra_info"]["index"] == kept[0]
    assert ds[-1]["extra_info"]["index"] == kept[-1]
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(TypeError):
        ds["a"]


def test_options(files, tmp_path):
    ds = RLHFDataset(files[1], TOK, max_prompt_length=100, max_samples=2)
    assert len(ds) == 2 and ds.num_filtered == 0
    with pytest.raises(DatasetError, match=r"b\.json: row \d+: prompt has \d+ tokens"):
        RLHFDataset(files, TOK, max_prompt_length=14, filter_overlong_prompts=False)
    with pytest.raises(DatasetError, match="no rows left"):
        RLHFDataset(files, TOK, max_prompt_length=2)
    p = tmp_path / "mm.jsonl"
    p.write_text(json.dumps({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                       "text": "what?"}]}],
                             "images": ["img0.png"], "extra_info": {"tools_kwargs": {"calculator": {}}}}))
    ds = RLHFDataset(str(p), TOK, 100, prompt_key="prompt", default_data_source="vision")
    row = ds[0]
    assert row["multi_modal_data"] == {"image": ["img0.png"]} and "images" not in row and "prompt" not in row
    assert row["data_source"] == "vision" and row["extra_info"]["tools_kwargs"] == {"calculator": {}}
    for bad in (dict(max_prompt_length=0), dict(max_prompt_length=5, max_samples=0)):
        with pytest.raises(DatasetError):
            RLHFDataset(files, TOK, **bad)
    with pytest.raises(TypeError, match="apply_chat_template"):
        RLHFDataset(files, object(), 10)


@pytest.mark.parametrize("row, fragment", [
    ({"data_source": "x"}, "missing the prompt column 'prompt'.*set data.prompt_key"),
    ({"raw_prompt": "hello", "data_source": "x"}, "non-empty list of messages"),
    ({"raw_prompt": [], "data_source": "x"}, "non-empty list"),
    ({"raw_prompt": ["hi"], "data_source": "x"}, r"raw_prompt\[0\] must be a message dict"),
    ({"raw_prompt": [{"content": "hi"}], "data_source": "x"}, "string 'role'"),
    ({"raw_prompt": [{"role": "user", "content": 3}], "data_source": "x"}, "'content'"),
    ({"raw_prompt": [{"role": "bot", "content": "hi"}], "data_source": "x"}, "chat template rejects column 'raw_prompt'"),
    ({"raw_prompt": [{"role": "user", "content": "hi"}]}, "data_source.*default_data_source"),
    ({"raw_prompt": [{"role": "user", "content": "hi"}], "data_source": 5}, "data_source"),
    ({"raw_prompt": [{"role": "user", "content": "hi"}], "data_source": "x", "extra_info": [1]},
     "column 'extra_info'"),
    ({"raw_prompt": [{"role": "user", "content": "hi"}], "data_source": "x", "reward_model": "7"},
     "column 'reward_model' must be an object"),
    ({"raw_prompt": [{"role": "user", "content": "hi"}], "data_source": "x",
      "extra_info": {"tools_kwargs": "calc"}}, "tools_kwargs"),
    ([1, 2], "must be an object"),
])
def test_malformed_rows_name_file_and_row(tmp_path, row, fragment):
    good = {"raw_prompt": [{"role": "user", "content": "ok"}], "data_source": "x"}
    p = tmp_path / "d.json"
    p.write_text(json.dumps([good, good, row]))
    with pytest.raises(DatasetError, match=fragment) as exc:
        RLHFDataset(str(p), TOK, 100)
    assert "d.json: row 2" in str(exc.value)
    q = tmp_path / "d.jsonl"
    q.write_text(json.dumps(good) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match="d.jsonl: line 3"):
        RLHFDataset(str(q), TOK, 100)


def test_file_errors(tmp_path):
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DatasetError, match="unsupported data file extension '.csv'"):
        read_rows(str(tmp_path / "x.csv"))
    with pytest.raises(DatasetError, match="not found"):
        read_rows(str(tmp_path / "missing.json"))
    with pytest.raises(DatasetError, match="empty"):
        read_rows([])
    (tmp_path / "o.json").write_text('{"raw_prompt": 1}')
    with pytest.raises(DatasetError, match="list of row objects"):
        read_rows(str(tmp_path / "o.json"))
    (tmp_path / "bad.json").write_text('[{"a": 1},')
    with pytest.raises(DatasetError, match="bad.json: not valid JSON"):
        read_rows(str(tmp_path / "bad.json"))
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n{oops\n')
    with pytest.raises(DatasetError, match="bad.jsonl: line 2"):
        read_rows(str(tmp_path / "bad.jsonl"))
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match="bad.parquet: cannot read as parquet"):
        read_rows(str(tmp_path / "bad.parquet"))


def test_collate_rows():
    batch = collate_rows([{"t": torch.tensor([1, 2]), "msgs": [{"role": "user"}], "s": "a", "l": [1, 2]},
                          {"t": torch.tensor([3, 4]), "msgs": [{"role": "tool"}], "s": "b", "l": [3, 4]}])
    assert torch.equal(batch["t"], torch.tensor([[1, 2], [3, 4]]))
    for name in ("msgs", "s", "l"):
        assert isinstance(batch[name], np.ndarray) and batch[name].dtype == object and batch[name].shape == (2,)
    assert batch["l"][1] == [3, 4] and batch["msgs"][0] == [{"role": "user"}]
    with pytest.raises(DatasetError, match=r"row 1 .*missing \['s'\]"):
        collate_rows([{"s": 1}, {"t": 2}])
    with pytest.raises(DatasetError, match="no rows"):
        collate_rows([])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), bs=st.integers(1, 40), seed=st.integers(0, 2**31), drop_last=st.booleans(),
       shuffle=st.booleans())
def test_sampler_epochs_are_permutations(n, bs, seed, drop_last, shuffle):
    if drop_last and bs > n:
        with pytest.raises(DatasetError, match="exceeds the dataset size"):
            PromptSampler(n, bs, seed, shuffle, drop_last)
        return
    s = PromptSampler(n, bs, seed, shuffle, drop_last)
    for epoch in range(2):
        batches = list(s)
        assert len(batches) == s.batches_per_epoch
        flat = [i for b in batches for i in b]
        assert all(len(b) == bs for b in (batches if drop_last else batches[:-1]))
        if drop_last:
            assert len(flat) == (n // bs) * bs and len(set(flat)) == len(flat)
        else:
            assert sorted(flat) == list(range(n))
        assert flat == s.epoch_order(epoch).tolist()[: len(flat)]
        s.next_batch()  # rolls over into the next epoch
        s.load_state_dict({**s.state_dict(), "position": 0})
    if shuffle and n > 3:
        assert PromptSampler(n, bs, seed, True, drop_last).epoch_order(0).tolist() == s.epoch_order(0).tolist()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), bs=st.integers(1, 10), seed=st.integers(0, 1000), k=st.integers(0, 25))
def test_sampler_resume_gives_the_same_order(n, bs, seed, k):
    bs = min(bs, n)
    ref = PromptSampler(n, bs, seed)
    expected = [ref.next_batch() for _ in range(k + 5)]
    a = PromptSampler(n, bs, seed)
    for _ in range(k):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # checkpoints are JSON
    b = PromptSampler(n, bs, seed)
    b.load_state_dict(state)
    assert [b.next_batch() for _ in range(5)] == expected[k:]


def test_sampler_state_errors():
    s = PromptSampler(10, 3, seed=1)
    for name, value in (("seed", 2), ("num_samples", 11), ("batch_size", 4), ("shuffle", False)):
        with pytest.raises(DatasetError, match=name):
            s.load_state_dict({**s.state_dict(), name: value})
    with pytest.raises(DatasetError, match="position"):
        s.load_state_dict({**s.state_dict(), "position": 99})
    with pytest.raises(DatasetError, match="epoch"):
        s.load_state_dict({**s.state_dict(), "epoch": -1})
    for bad in (dict(num_samples=0, batch_size=1), dict(num_samples=3, batch_size=0),
                dict(num_samples=3, batch_size=1, seed=-1)):
        with pytest.raises(DatasetError):
            PromptSampler(**bad)


def test_loader_resume(files):
    ds = RLHFDataset(files, TOK, max_prompt_length=100)
    a = PromptLoader(ds, batch_size=4, seed=7)
    first = [a.next_batch()["extra_info"] for _ in range(5)]  # crosses an epoch boundary (15 rows, 3 per epoch)
    assert len(a) == 3 and a.epoch == 1
    b = PromptLoader(ds, batch_size=4, seed=7)
    b.next_batch()
    b.next_batch()
    c = PromptLoader(ds, batch_size=4, seed=7)
    c.load_state_dict(b.state_dict())
    rest = [c.next_batch()["extra_info"] for _ in range(3)]
    assert [[e["index"] for e in x] for x in rest] == [[e["index"] for e in x] for x in first[2:]]
    batch = PromptLoader(ds, 4, seed=7).next_batch()
    assert batch["raw_prompt"].dtype == object and batch["raw_prompt"].shape == (4,)
    assert list(PromptLoader(ds, 5, shuffle=False, drop_last=False))[-1]["extra_info"][-1]["index"] == 14


# ------------------------------------------------------------------------------------- the reference system's format

def _gsm8k_rows(n: int, split: str = "train") -> list[dict]:
    """Rows exactly as the reference system's GSM8K preprocessing writes them."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"What is {i} + 1? Answer after ####."}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"split": split, "index": i, "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}",
                            "question": f"What is {i} + 1?"}} for i in range(n)]


def test_reads_the_reference_gsm8k_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_gsm8k_rows(5)), path)
    ds = RLHFDataset(str(path), TOK, 100, needs_ground_truth=needs_ground_truth)
    row = ds[3]
    assert row["raw_prompt"] == [{"role": "user", "content": "What is 3 + 1? Answer after ####."}]
    assert "prompt" not in row
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["reward_model"] == {"style": "rule", "ground_truth": "4"} and ground_truth_of(row) == "4"
    assert row["extra_info"] == {"split": "train", "index": 3, "answer": "3 + 1 = 4\n#### 4",
                                 "question": "What is 3 + 1?", "tools_kwargs": {}, "interaction_kwargs": {}}
    # the scorer receives what the file holds
    assert default_compute_score(row["data_source"], "#### 4", ground_truth_of(row), row["extra_info"]) == 1.0
    # another column name for the messages
    renamed = [{("question_msgs" if k == "prompt" else k): v for k, v in r.items()} for r in _gsm8k_rows(3)]
    p2 = tmp_path / "renamed.jsonl"
    p2.write_text("\n".join(json.dumps(r) for r in renamed))
    assert RLHFDataset(str(p2), TOK, 100, prompt_key="question_msgs")[1]["raw_prompt"][0]["content"].startswith(
        "What is 1")
    with pytest.raises(DatasetError, match="renamed.jsonl: line 1: missing the prompt column 'prompt'"):
        RLHFDataset(str(p2), TOK, 100)


@pytest.mark.parametrize("change, fragment", [
    (lambda r: r.update(data_source="openai/gsm8k_typo"),
     r"column 'data_source': no scorer for data_source 'openai/gsm8k_typo'; known data sources: \[.*'openai/gsm8k'"),
    (lambda r: r.pop("reward_model"),
     r"column 'reward_model.ground_truth' is missing \(no column 'reward_model'\); the scorer of data_source "
     r"'openai/gsm8k'"),
    (lambda r: r["reward_model"].pop("ground_truth"), r"'reward_model.ground_truth' is missing \(reward_model="),
    (lambda r: r["reward_model"].update(ground_truth=None), "'reward_model.ground_truth' is missing"),
    (lambda r: r.update(prompt="just a string"), "'prompt' must be a non-empty list of messages"),
])
def test_every_row_is_checked_at_load_naming_file_row_and_column(tmp_path, change, fragment):
    rows = _gsm8k_rows(40)
    change(rows[37])
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DatasetError, match=fragment) as exc:
        RLHFDataset(str(jsonl), TOK, 100, needs_ground_truth=needs_ground_truth)
    assert f"{jsonl}: line 38:" in str(exc.value)
    try:
        table = pa.Table.from_pylist(rows)
    except pa.ArrowInvalid:  # a column parquet cannot hold with mixed types (a string among message lists)
        return
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    with pytest.raises(DatasetError, match=fragment) as exc:
        RLHFDataset(str(path), TOK, 100, needs_ground_truth=needs_ground_truth)
    assert f"{path}: row 37:" in str(exc.value)


def test_rows_are_not_checked_without_a_reward_view(tmp_path):
    rows = _gsm8k_rows(3)
    rows[1]["data_source"] = "my/own_source"
    del rows[2]["reward_model"]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert len(RLHFDataset(str(path), TOK, 100)) == 3  # a custom reward function decides what it can score


def test_non_utf8_json_names_file_and_line(tmp_path):
    good = json.dumps(_gsm8k_rows(1)[0]).encode()
    bad = good.replace(b"What", b"Wh\xe4t")
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(good + b"\n" + good + b"\n\n" + bad + b"\n")
    with pytest.raises(DatasetError, match=r"latin1.jsonl: line 4 is not valid UTF-8 \(byte 0xe4 at column \d+\)"):
        read_rows(str(p))
    q = tmp_path / "latin1.json"
    q.write_bytes(b"[\n" + good + b",\n" + bad + b"\n]")
    with pytest.raises(DatasetError, match=r"latin1.json: line 3 is not valid UTF-8 \(byte 0xe4"):
        read_rows(str(q))


def test_hf_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "gsm8k_train"
    datasets.Dataset.from_list(_gsm8k_rows(4)).save_to_disk(str(folder))
    ds = RLHFDataset(str(folder), TOK, 100, needs_ground_truth=needs_ground_truth)
    assert len(ds) == 4 and ground_truth_of(ds[2]) == "3"


def test_hf_datasets_folder_without_the_package(tmp_path):
    try:
        import datasets  # noqa: F401
        pytest.skip("datasets is installed")
    except ImportError:
        pass
    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "state.json").write_text("{}")
    with pytest.raises(DatasetError, match="saved: a Hugging Face datasets folder .* needs the 'datasets' package"):
        read_rows(str(folder))
