"""Store keys, tags and the prompt-group status machine: how a prompt group and its trajectories are named.

Vocabulary:

* **prompt key** ``{uid}`` – one dataset prompt (a GRPO group). Its tag: ``is_prompt=True``, ``status``,
  ``global_steps`` (the trainer step at which the prompt was taken from the dataset). Its fields: what the group
  shares, stored once (a vision-language prompt's images, ``protocol.fields.PROMPT_IMAGE_FIELDS``); usually none.
* **trajectory key** ``{uid}_{session_id}_{index}`` – output ``index`` of rollout session ``session_id``
  (``0 <= session_id < rollout.n``) of prompt ``uid``. Its tag: ``prompt_len``, ``response_len``, ``seq_len``,
  ``global_steps``, ``min_global_steps``, ``max_global_steps``, ``is_padding``; a vision-language trajectory's also
  ``vision_spans`` (its prompt's images' attention spans, in patches, which the dispatch's workload counts).

A uid never contains ``_``; that is what makes a trajectory key parse back unambiguously.

Example::

    >>> key = trajectory_key("ab12", 3, 0)
    >>> key, parse_trajectory_key(key), group_of(key)
    ('ab12_3_0', ('ab12', 3, 0), 'ab12')
"""
from __future__ import annotations

import enum
import functools
import re
import uuid
from collections.abc import Mapping
from typing import Any

__all__ = [
    "KeyFormatError",
    "IllegalTransitionError",
    "TagError",
    "PromptStatus",
    "TERMINAL_STATUSES",
    "new_uid",
    "check_uid",
    "trajectory_key",
    "parse_trajectory_key",
    "is_trajectory_key",
    "group_of",
    "uid_of",
    "is_prompt_key",
    "transition",
    "prompt_tag",
    "trajectory_tag",
    "check_trajectory_tag",
]


class KeyFormatError(ValueError):
    """A uid or store key that does not follow ``{uid}`` / ``{uid}_{session_id}_{index}``."""


class IllegalTransitionError(ValueError):
    """A prompt status change outside pending -> running -> finished | failure."""


class TagError(ValueError):
    """A tag whose fields are missing, of the wrong type, or inconsistent (e.g. seq_len != prompt_len + response_len)."""


class PromptStatus(str, enum.Enum):
    """Status of a prompt group; stored in tags as the plain string value."""

    PENDING = "pending"
    RUNNING = "running"
    FINISHED = "finished"
    FAILURE = "failure"

    def __str__(self) -> str:  # plain value in messages and f-strings
        return self.value


TERMINAL_STATUSES: frozenset[PromptStatus] = frozenset({PromptStatus.FINISHED, PromptStatus.FAILURE})

_ALLOWED: dict[PromptStatus | None, frozenset[PromptStatus]] = {
    None: frozenset({PromptStatus.PENDING}),
    PromptStatus.PENDING: frozenset({PromptStatus.RUNNING}),
    PromptStatus.RUNNING: frozenset({PromptStatus.FINISHED, PromptStatus.FAILURE}),
    PromptStatus.FINISHED: frozenset(),
    PromptStatus.FAILURE: frozenset(),
}


def new_uid() -> str:
    """A fresh prompt-group id: uuid4 hex (32 lowercase hex characters, never ``_``)."""
    return uuid.uuid4().hex


def check_uid(uid: Any) -> str:
    """Return ``uid`` if it is a non-empty string without ``_``; raise :class:`KeyFormatError` otherwise."""
    if type(uid) is str and uid and "_" not in uid:
        return uid
    if not isinstance(uid, str):
        raise KeyFormatError(f"uid must be a str, got {type(uid).__name__} {uid!r}")
    if not uid:
        raise KeyFormatError("uid must be a non-empty string, got ''")
    if "_" in uid:
        raise KeyFormatError(f"uid must not contain '_' (it separates the parts of a trajectory key), got {uid!r}")
    return uid


def _check_index(name: str, value: Any) -> int:
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise KeyFormatError(f"{name} must be a non-negative int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise KeyFormatError(f"{name} must be a non-negative int, got {value}")
    return int(value)


def trajectory_key(uid: str, session_id: int, index: int) -> str:
    """The store key ``{uid}_{session_id}_{index}`` of output ``index`` of session ``session_id`` of group ``uid``."""
    check_uid(uid)
    return f"{uid}_{_check_index('session_id', session_id)}_{_check_index('index', index)}"


def _parse_int_part(key: str, name: str, text: str) -> int:
    # Canonical decimal only (no sign, no leading zeros) so that parse is the exact inverse of build.
    if not text.isascii() or not text.isdigit() or (len(text) > 1 and text[0] == "0"):
        raise KeyFormatError(
            f"trajectory key {key!r}: {name} part {text!r} is not a canonical non-negative decimal integer; "
            f"expected '{{uid}}_{{session_id}}_{{index}}'"
        )
    return int(text)


def parse_trajectory_key(key: str) -> tuple[str, int, int]:
    """Split ``{uid}_{session_id}_{index}`` into ``(uid, session_id, index)``; exact inverse of :func:`trajectory_key`."""
    if not isinstance(key, str):
        raise KeyFormatError(f"trajectory key must be a str, got {type(key).__name__} {key!r}")
    return _parse(key)


#: ``{uid}_{session_id}_{index}`` with canonical ASCII decimals: what :func:`trajectory_key` builds
_CANONICAL = re.compile(r"([^_]+)_(0|[1-9][0-9]*)_(0|[1-9][0-9]*)")


@functools.lru_cache(maxsize=1 << 16)  # a step parses each of its keys in several stages; a hit is one dict lookup
def _parse(key: str) -> tuple[str, int, int]:
    match = _CANONICAL.fullmatch(key)
    if match is not None:  # the common case in one C-level pass; the checks below name what is wrong
        uid, session_text, index_text = match.groups()
        return uid, int(session_text), int(index_text)
    return _parse_checked(key)


def _parse_checked(key: str) -> tuple[str, int, int]:
    parts = key.split("_")
    if len(parts) != 3:
        raise KeyFormatError(
            f"trajectory key {key!r} has {len(parts)} '_'-separated parts; expected 3: '{{uid}}_{{session_id}}_{{index}}'"
        )
    uid, session_text, index_text = parts
    if not uid:
        raise KeyFormatError(f"trajectory key {key!r} has an empty uid; expected '{{uid}}_{{session_id}}_{{index}}'")
    return uid, _parse_int_part(key, "session_id", session_text), _parse_int_part(key, "index", index_text)


def is_trajectory_key(key: str) -> bool:
    """True when ``key`` parses as ``{uid}_{session_id}_{index}``."""
    try:
        parse_trajectory_key(key)
    except KeyFormatError:
        return False
    return True


def group_of(key: str) -> str:
    """The uid (group) of a trajectory key, or the prompt key itself when ``key`` is a bare uid."""
    if not isinstance(key, str):
        raise KeyFormatError(f"key must be a str, got {type(key).__name__} {key!r}")
    if "_" not in key:
        return check_uid(key)
    return parse_trajectory_key(key)[0]


def uid_of(key: str) -> str:
    """The uid of a prompt or trajectory key, without validation: the hot-path form of :func:`group_of`.

    >>> uid_of("ab12_3_0"), uid_of("ab12")
    ('ab12', 'ab12')
    """
    return key.partition("_")[0]


def is_prompt_key(key: str) -> bool:
    """True for a prompt key ``{uid}`` (no ``_``), False for a trajectory key ``{uid}_{session_id}_{index}``."""
    return "_" not in key


def _status(value: Any, role: str) -> PromptStatus | None:
    if value is None and role == "old":
        return None
    try:
        return PromptStatus(value)
    except ValueError:
        raise IllegalTransitionError(
            f"unknown {role} prompt status {value!r}; expected one of {[s.value for s in PromptStatus]}"
        ) from None


def transition(old: str | PromptStatus | None, new: str | PromptStatus) -> PromptStatus:
    """Check the move ``old -> new`` (``old=None``: a prompt without a tag yet) and return ``new`` as a status.

    Legal moves: None -> pending -> running -> finished | failure. Anything else raises
    :class:`IllegalTransitionError` naming both statuses.
    """
    old_s, new_s = _status(old, "old"), _status(new, "new")
    if new_s not in _ALLOWED[old_s]:
        allowed = sorted(s.value for s in _ALLOWED[old_s])
        raise IllegalTransitionError(
            f"illegal prompt status transition {old_s.value if old_s else None!r} -> {new_s.value!r}; "
            f"from {old_s.value if old_s else None!r} only {allowed} are allowed "
            f"(pending -> running -> finished | failure)"
        )
    return new_s


def _nonneg(name: str, value: Any) -> int:
    if type(value) is int and value >= 0:  # the common case, without the isinstance chain
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TagError(f"tag field {name!r} must be a non-negative int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise TagError(f"tag field {name!r} must be a non-negative int, got {value}")
    return int(value)


def prompt_tag(global_steps: int, status: str | PromptStatus = PromptStatus.PENDING) -> dict[str, Any]:
    """The tag of a prompt key: ``{is_prompt: True, status, global_steps}`` (status stored as its string value)."""
    return {
        "is_prompt": True,
        "status": _status(status, "new").value,
        "global_steps": _nonneg("global_steps", global_steps),
    }


def trajectory_tag(
    prompt_len: int,
    response_len: int,
    global_steps: int,
    min_global_steps: int | None = None,
    max_global_steps: int | None = None,
    is_padding: bool = False,
) -> dict[str, Any]:
    """The tag of a trajectory key; ``seq_len = prompt_len + response_len``; min/max versions default to global_steps.

    ``global_steps`` is the trainer step at which the trajectory was generated; ``min_global_steps`` /
    ``max_global_steps`` bound the policy versions that produced its tokens (they differ for partial rollouts).
    """
    p, r, g = _nonneg("prompt_len", prompt_len), _nonneg("response_len", response_len), _nonneg("global_steps", global_steps)
    lo = g if min_global_steps is None else _nonneg("min_global_steps", min_global_steps)
    hi = g if max_global_steps is None else _nonneg("max_global_steps", max_global_steps)
    if lo > hi:
        raise TagError(f"min_global_steps ({lo}) must be <= max_global_steps ({hi})")
    if not isinstance(is_padding, bool):
        raise TagError(f"tag field 'is_padding' must be a bool, got {type(is_padding).__name__} {is_padding!r}")
    return {
        "prompt_len": p,
        "response_len": r,
        "seq_len": p + r,
        "global_steps": g,
        "min_global_steps": lo,
        "max_global_steps": hi,
        "is_padding": is_padding,
    }


_TRAJECTORY_TAG_FIELDS = ("prompt_len", "response_len", "seq_len", "global_steps", "min_global_steps",
                          "max_global_steps")


def check_trajectory_tag(tag: Mapping[str, Any], key: str = "?") -> None:
    """Raise :class:`TagError` (naming ``key`` and the field) unless ``tag`` is a complete, consistent trajectory tag."""
    if not isinstance(tag, Mapping):
        raise TagError(f"tag of {key!r} must be a mapping, got {type(tag).__name__}")
    missing = [f for f in (*_TRAJECTORY_TAG_FIELDS, "is_padding") if f not in tag]
    if missing:
        raise TagError(f"tag of {key!r} lacks fields {missing}")
    try:
        for f in _TRAJECTORY_TAG_FIELDS:
            _nonneg(f, tag[f])
    except TagError as exc:
        raise TagError(f"tag of {key!r}: {exc}") from None
    if tag["seq_len"] != tag["prompt_len"] + tag["response_len"]:
        raise TagError(f"tag of {key!r}: seq_len {tag['seq_len']} != prompt_len {tag['prompt_len']} + "
                       f"response_len {tag['response_len']}")
    if tag["min_global_steps"] > tag["max_global_steps"]:
        raise TagError(f"tag of {key!r}: min_global_steps {tag['min_global_steps']} > max_global_steps "
                       f"{tag['max_global_steps']}")
    if not isinstance(tag["is_padding"], bool):
        raise TagError(f"tag of {key!r}: is_padding must be a bool, got {tag['is_padding']!r}")
