"""The prompt stream: prompt p is position p % B of step p // B's batch, however the prompts are taken."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from rldispatch.prompts import PromptStream, batch_indices, step_uids

ROWS = [{"raw_prompt": [{"role": "user", "content": str(i)}], "row": i} for i in range(40)]


def _stream(batch: int = 8, shuffle: bool = True) -> PromptStream:
    return PromptStream(ROWS, batch, seed=3, shuffle=shuffle)


@given(counts=st.lists(st.integers(1, 13), min_size=1, max_size=12), batch=st.sampled_from([4, 8, 16]))
def test_taking_in_any_counts_walks_the_steps_batches(counts, batch):
    stream = _stream(batch)
    rows, uids = [], []
    for c in counts:
        r, u = stream.take(c)
        rows += r
        uids += u
    total = sum(counts)
    # the reference: step s's batch is batch_indices(seed, s) of the rows and step_uids(seed, s)
    want_rows, want_uids = [], []
    for step in range((total + batch - 1) // batch):
        want_rows += [ROWS[i] for i in batch_indices(len(ROWS), batch, step, 3, True)]
        want_uids += step_uids(3, step, batch)
    assert uids == want_uids[:total] and rows == want_rows[:total]
    assert stream.cursor == total and stream.outstanding() == list(range(total))
    assert all(stream.rows[u] is r for u, r in zip(uids, rows))


def test_a_step_takes_its_batch_and_forgetting_ends_the_outstanding():
    stream = _stream()
    rows, uids = stream.take_step(2)
    assert (rows, uids) == stream.at(16, 8) and stream.cursor == 24
    assert stream.position(uids[:2]) == [16, 17]
    stream.forget(uids[:5])
    assert stream.outstanding() == [21, 22, 23] and set(stream.rows) == set(uids[5:])


def test_numbers_take_exactly_those_prompts():
    """A resumed async run submits its outstanding prompts again by stream position."""
    stream = _stream()
    rows, uids = stream.take(3, numbers=[5, 6, 13])
    assert uids == stream.at(5, 2)[1] + stream.at(13, 1)[1] and stream.cursor == 0
    assert stream.outstanding() == [5, 6, 13]


def test_too_small_a_training_set_is_named():
    with pytest.raises(ValueError, match="fewer than data.train_batch_size=64"):
        _stream(64).take(1)


def test_rows_with_images_are_refused_by_a_text_only_trainer(tmp_path, one_rank_group):
    """A verl-format parquet with an ``images`` column: the trainer stops at load naming the file key and the row,
    instead of training on prompts whose images it would drop."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from protocol.rollout.tokenizer import CharTokenizer
    from rldispatch.config import ConfigError, load_config
    from rldispatch.prompts import load_datasets

    rows = [{"prompt": [{"role": "user", "content": f"repeat: a{i}"}], "data_source": "repeat",
             "reward_model": {"style": "rule", "ground_truth": f"aa{i}{i}"}} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    rows = [{**r, "images": None} for r in rows]  # the column in every row: a parquet schema is the first row's
    rows[2]["images"] = [{"bytes": b"\x89PNG", "path": None}]
    rows[2]["prompt"] = [{"role": "user", "content": "<image> repeat: a2"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "val.parquet")
    cfg = load_config("grpo_tiny", [f"data.train_files=[{tmp_path}/train.parquet]", "data.train_batch_size=4",
                                    "actor.ppo_mini_batch_size=4", f"data.val_files=[{tmp_path}/val.parquet]"])
    with pytest.raises(ConfigError, match=r"data.val_files: row 2 carries \['image'\] \(multi_modal_data\)"):
        load_datasets(cfg, CharTokenizer(), is_main=True)
