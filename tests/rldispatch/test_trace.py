"""The field-lineage trace recorder: filtering to the sampled group, per-field lengths and checks, JSONL."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tensordict import TensorDict

from rldispatch.trace import TRACE_COLUMNS, TraceError, TraceRecorder, read_trace, uid_of_key


def jagged(lengths, dtype=torch.int64, fill=1):
    return torch.nested.nested_tensor([torch.full((n,), fill, dtype=dtype) for n in lengths], layout=torch.jagged)


def batch(uids_lens, prompt_len=4, pad_uid=None):
    """Keys, tags and a TensorDict for groups {uid: [response_len, ...]} (+ one padding sample)."""
    keys, tags, rl = [], [], []
    for uid, lens in uids_lens.items():
        for s, n in enumerate(lens):
            keys.append(f"{uid}_{s}_0")
            rl.append(n)
            tags.append({"prompt_len": prompt_len, "response_len": n, "seq_len": prompt_len + n, "global_steps": 3,
                         "min_global_steps": 2, "max_global_steps": 3, "is_padding": False})
    if pad_uid:
        keys.append(f"{pad_uid}_0_0")
        rl.append(2)
        tags.append({"prompt_len": prompt_len, "response_len": 2, "seq_len": prompt_len + 2, "global_steps": 3,
                     "min_global_steps": 3, "max_global_steps": 3, "is_padding": True})
    masks = [torch.tensor([1] * (n - 1) + [0]) for n in rl]
    td = TensorDict({
        "input_ids": jagged([prompt_len + n for n in rl]),
        "response_mask": torch.nested.nested_tensor(masks, layout=torch.jagged),
        "old_log_probs": jagged(rl, torch.float32, 0),
        "reward_score": torch.arange(len(rl), dtype=torch.float32),
    }, batch_size=[len(rl)])
    return keys, tags, td


def test_records_only_the_sampled_group(tmp_path):
    keys, tags, td = batch({"aa": [3, 5], "bb": [2]}, pad_uid="pp")
    with TraceRecorder(tmp_path / "t.jsonl", sample_uid="aa") as tr:
        rows = tr.record("old_log_prob", td, keys, tags, producer="actor.infer",
                         consumer={"old_log_probs": "actor.train", "*": "-"})
    by_field = {r["field"]: r for r in rows}
    assert set(by_field) == {"input_ids", "response_mask", "old_log_probs", "reward_score"}
    r = by_field["old_log_probs"]
    assert r["keys"] == ["aa_0_0", "aa_1_0"] and r["lengths"] == [3, 5] and r["valid_len"] == [3, 5]
    assert r["length_ok"] is True and r["dtype"] == "float32" and r["device"] == "cpu"
    assert r["shape"] == "nested[2, j3..5]" and r["mask_sum"] == [2, 4]
    assert r["producer"] == "actor.infer" and r["consumer"] == "actor.train"
    assert by_field["input_ids"]["valid_len"] == [7, 9] and by_field["input_ids"]["length_ok"] is True
    d = by_field["reward_score"]
    assert d["shape"] == [2] and d["lengths"] == [None, None] and d["valid_len"] is None and d["consumer"] == "-"
    assert r["global_steps"] == [3, 3] and r["min_global_steps"] == [2, 2] and r["is_padding"] == [False, False]
    assert r["step"] == 3
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(list(x) == list(TRACE_COLUMNS) for x in lines)
    assert read_trace(tmp_path / "t.jsonl") == lines


def test_auto_selects_first_real_uid_and_can_follow_padding(tmp_path):
    keys, tags, td = batch({"bb": [2], "aa": [3]}, pad_uid="pp")
    keys, tags = [keys[-1], *keys[:-1]], [tags[-1], *tags[:-1]]  # padding first
    td = td[torch.tensor([2, 0, 1])]
    tr = TraceRecorder(tmp_path / "t.jsonl", sample_uid=None, include_padding=True)
    rows = tr.record("dispatch", td, keys, tags, step=5)
    assert tr.sample_uid == "bb"
    assert rows[0]["keys"] == ["pp_0_0", "bb_0_0"] and rows[0]["is_padding"] == [True, False]
    assert rows[0]["step"] == 5
    tr.select("aa")
    assert tr.record("dispatch", td, keys, tags)[0]["keys"] == ["pp_0_0", "aa_0_0"]
    with pytest.raises(TraceError, match="no '_'"):
        tr.select("aa_0_0")
    tr.close()


def test_length_mismatch_is_flagged(tmp_path):
    keys, tags, td = batch({"aa": [3, 5]})
    tags[1] = dict(tags[1], response_len=4)  # the tag says 4, the value holds 5
    tr = TraceRecorder(tmp_path / "t.jsonl", sample_uid="aa")
    rows = {r["field"]: r for r in tr.record("reward", td, keys, tags)}
    assert rows["old_log_probs"]["length_ok"] is False
    padded = TensorDict({"advantages": torch.zeros(2, 6)}, batch_size=[2])
    rows = tr.record("advantage", padded, keys, tags)
    assert rows[0]["shape"] == [2, 6] and rows[0]["lengths"] == [6, 6] and rows[0]["length_ok"] is True
    short = TensorDict({"advantages": torch.zeros(2, 3)}, batch_size=[2])
    assert tr.record("advantage", short, keys, tags)[0]["length_ok"] is False


def test_tags_only_stage_and_absent_group(tmp_path):
    tr = TraceRecorder(tmp_path / "t.jsonl", sample_uid="aa")
    rows = tr.record("dataset", None, ["aa", "bb"], [{"is_prompt": True, "status": "pending", "global_steps": 1}] * 2,
                     producer="dataloader", consumer="rollout")
    assert len(rows) == 1 and rows[0]["field"] == "-" and rows[0]["keys"] == ["aa"] and rows[0]["step"] == 1
    assert tr.record("dataset", None, ["cc"], [{}]) == []
    assert tr.rows_written == 1
    tr.close()


def test_disabled_recorder_is_a_no_op(tmp_path):
    keys, tags, td = batch({"aa": [3]})
    tr = TraceRecorder(tmp_path / "sub" / "t.jsonl", enabled=False, sample_uid="aa")
    assert tr.record("reward", td, keys, tags) == []
    tr.close()
    assert not (tmp_path / "sub").exists()


def test_misaligned_inputs_raise(tmp_path):
    keys, tags, td = batch({"aa": [3, 4]})
    tr = TraceRecorder(tmp_path / "t.jsonl", sample_uid="aa")
    with pytest.raises(TraceError, match="stage 'reward': 2 keys but 1 tags"):
        tr.record("reward", td, keys, tags[:1])
    with pytest.raises(TraceError, match="field 'input_ids': 2 rows but 3 keys"):
        tr.record("reward", td, keys + ["aa_2_0"], tags + [tags[0]])
    with pytest.raises(TraceError, match="non-empty str"):
        uid_of_key("")
    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n')
    with pytest.raises(TraceError, match="'stage' and 'field'"):
        read_trace(tmp_path / "bad.jsonl")
    with pytest.raises(TraceError, match="no trace file"):
        read_trace([tmp_path / "none.jsonl"])


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 9), min_size=1, max_size=6), other=st.lists(st.integers(1, 9), max_size=6))
def test_lengths_and_mask_sums_match_the_values(tmp_path_factory, lens, other):
    keys, tags, td = batch({"aa": lens, "bb": other} if other else {"aa": lens})
    tr = TraceRecorder(tmp_path_factory.mktemp("tr") / "t.jsonl", sample_uid="aa")
    rows = {r["field"]: r for r in tr.record("s", td, keys, tags)}
    tr.close()
    assert rows["response_mask"]["lengths"] == lens
    assert rows["response_mask"]["mask_sum"] == [n - 1 for n in lens]
    assert rows["input_ids"]["lengths"] == [4 + n for n in lens]
    assert all(r["length_ok"] in (True, None) for r in rows.values())
