"""The C-level checks agree with the per-item rules they stand in for."""
from __future__ import annotations

import enum

from hypothesis import given, strategies as st

from protocol.checks import DICT, INT, NUMBER, STR, only_types, plain_keys


class Tok(enum.IntEnum):
    A = 1


values = st.lists(st.one_of(st.integers(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=3),
                            st.just(Tok.A), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2)),
                  max_size=8)


@given(values, st.sampled_from([INT, NUMBER, STR, DICT]))
def test_only_types_is_exact_type_membership(items, allowed):
    """Exactly the listed types: a bool is not an int, an IntEnum member is not an int."""
    assert only_types(items, allowed) == all(type(v) in allowed for v in items)


@given(st.lists(st.one_of(st.text(max_size=3), st.integers(0, 3)), max_size=8))
def test_plain_keys_are_unique_nonempty_str(keys):
    assert plain_keys(keys) == (all(type(k) is str and k for k in keys) and len(set(keys)) == len(keys))
