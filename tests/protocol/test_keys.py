"""Keys, tags and the prompt status machine."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from protocol.store.keys import (
    TERMINAL_STATUSES, IllegalTransitionError, KeyFormatError, PromptStatus, TagError, check_trajectory_tag,
    check_uid, group_of, is_trajectory_key, new_uid, parse_trajectory_key, prompt_tag, trajectory_key,
    trajectory_tag, transition,
)

uids = st.text(alphabet=st.characters(blacklist_characters="_", blacklist_categories=("Cs",)), min_size=1,
               max_size=40)
nonneg = st.integers(min_value=0, max_value=10**12)


@settings(max_examples=300, deadline=None)
@given(uid=uids, session=nonneg, index=nonneg)
def test_build_parse_round_trip(uid, session, index):
    key = trajectory_key(uid, session, index)
    assert parse_trajectory_key(key) == (uid, session, index)
    assert group_of(key) == uid
    assert is_trajectory_key(key)
    assert group_of(uid) == uid


@settings(max_examples=300, deadline=None)
@given(key=st.text(max_size=30))
def test_parse_is_inverse_of_build_on_any_string(key):
    """Whatever parses rebuilds to the very same string (no two spellings of one key)."""
    try:
        parts = parse_trajectory_key(key)
    except KeyFormatError:
        return
    assert trajectory_key(*parts) == key


@settings(max_examples=500, deadline=None)
@given(key=st.text(alphabet="ab_019²-٣ ", max_size=12))
def test_the_one_pass_parse_agrees_with_the_checked_parse(key):
    """The regular expression that parses the common case accepts exactly the keys the part-by-part checks accept,
    with the same result (near-miss spellings: extra or missing parts, leading zeros, signs, non-ASCII digits)."""
    from protocol.store.keys import _CANONICAL, _parse_checked

    try:
        want = _parse_checked(key)
    except KeyFormatError:
        want = None
    match = _CANONICAL.fullmatch(key)
    got = None if match is None else (match[1], int(match[2]), int(match[3]))
    assert got == want


def test_new_uid_is_hex_without_underscore_and_unique():
    uids_ = {new_uid() for _ in range(200)}
    assert len(uids_) == 200
    for u in uids_:
        assert len(u) == 32 and "_" not in u and int(u, 16) >= 0
        assert check_uid(u) == u


@pytest.mark.parametrize("key, fragment", [
    ("abc", "3"), ("a_1", "3"), ("a_1_2_3", "3"), ("_1_2", "empty uid"), ("a_01_2", "session_id"),
    ("a_1_-2", "index"), ("a_x_2", "session_id"), ("a_1_", "index"), ("a_1_²", "index"),
])
def test_parse_errors_name_the_key(key, fragment):
    with pytest.raises(KeyFormatError) as exc:
        parse_trajectory_key(key)
    assert repr(key) in str(exc.value) and fragment in str(exc.value)
    assert not is_trajectory_key(key)


@pytest.mark.parametrize("uid, s, i", [("a_b", 0, 0), ("", 0, 0), (3, 0, 0), ("a", -1, 0), ("a", 0, True),
                                       ("a", 1.0, 0)])
def test_build_errors(uid, s, i):
    with pytest.raises(KeyFormatError):
        trajectory_key(uid, s, i)


def test_group_of_errors():
    with pytest.raises(KeyFormatError, match="a_b"):
        group_of("a_b")
    with pytest.raises(KeyFormatError):
        group_of(5)


ALL = [None, *PromptStatus]
LEGAL = {(None, "pending"), ("pending", "running"), ("running", "finished"), ("running", "failure")}


@pytest.mark.parametrize("old", ALL)
@pytest.mark.parametrize("new", list(PromptStatus))
def test_transition_table(old, new):
    old_v = old.value if old else None
    if (old_v, new.value) in LEGAL:
        assert transition(old_v, new.value) is new
        assert transition(old, new) is new
    else:
        with pytest.raises(IllegalTransitionError) as exc:
            transition(old_v, new.value)
        assert repr(old_v) in str(exc.value) and repr(new.value) in str(exc.value)


def test_transition_unknown_status():
    with pytest.raises(IllegalTransitionError, match="done"):
        transition("running", "done")
    with pytest.raises(IllegalTransitionError, match="nope"):
        transition("nope", "running")
    assert TERMINAL_STATUSES == {PromptStatus.FINISHED, PromptStatus.FAILURE}
    assert PromptStatus.RUNNING == "running" and f"{PromptStatus.RUNNING}" == "running"


def test_prompt_tag():
    assert prompt_tag(3) == {"is_prompt": True, "status": "pending", "global_steps": 3}
    tag = prompt_tag(0, PromptStatus.RUNNING)
    assert tag["status"] == "running" and type(tag["status"]) is str
    with pytest.raises(TagError, match="global_steps"):
        prompt_tag(-1)
    with pytest.raises(ValueError, match="weird"):
        prompt_tag(1, "weird")


@settings(max_examples=100, deadline=None)
@given(p=nonneg, r=nonneg, g=nonneg, lo=st.none() | nonneg, d=st.none() | nonneg)
def test_trajectory_tag_lengths(p, r, g, lo, d):
    hi = None if lo is None and d is None else (lo if lo is not None else g) + (d or 0)
    tag = trajectory_tag(p, r, g, lo, hi)
    assert tag["seq_len"] == tag["prompt_len"] + tag["response_len"] == p + r
    assert tag["min_global_steps"] <= tag["max_global_steps"]
    assert tag["is_padding"] is False
    check_trajectory_tag(tag, "k")


def test_trajectory_tag_errors():
    with pytest.raises(TagError, match="response_len"):
        trajectory_tag(1, -1, 0)
    with pytest.raises(TagError, match="min_global_steps"):
        trajectory_tag(1, 1, 5, 6, 4)
    with pytest.raises(TagError, match="is_padding"):
        trajectory_tag(1, 1, 0, is_padding=1)
    assert trajectory_tag(1, 1, 0, is_padding=True)["is_padding"] is True
    good = trajectory_tag(2, 3, 1)
    with pytest.raises(TagError, match="'k1'.*seq_len"):
        check_trajectory_tag({**good, "seq_len": 4}, "k1")
    with pytest.raises(TagError, match="lacks.*prompt_len"):
        check_trajectory_tag({k: v for k, v in good.items() if k != "prompt_len"}, "k1")
    with pytest.raises(TagError, match="min_global_steps"):
        check_trajectory_tag({**good, "min_global_steps": 9}, "k1")
    with pytest.raises(TagError, match="mapping"):
        check_trajectory_tag([1], "k1")
