"""A character-level tokenizer with a chat template, shipped with the package so every run works without a download.

Vocabulary (``vocab_size = 128``, the default tiny model's vocabulary):

====== ===================================================================
id     token
====== ===================================================================
0      ``<|pad|>``   padding (never produced by encode)
1      ``<|bos|>``   start of a chat
2      ``<|eos|>``   end of a turn / end of generation
3      ``<|unk|>``   any character outside the table below (never dropped)
4-7    ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|tool|>`` role markers
8      ``\\n``
9      ``\\t``
10-104 printable ASCII ``' '`` (32) ... ``'~'`` (126), in code-point order
105+   reserved (never produced by encode; decoded as ``<|reserved_N|>``)
====== ===================================================================

Chat template: ``<|bos|>`` then, per message, ``<|role|> content <|eos|>``; with ``add_generation_prompt`` an
``<|assistant|>`` marker follows, so the model's generation is the assistant content ended by ``<|eos|>``.

Example::

    >>> tok = CharTokenizer()
    >>> tok.decode(tok.encode("hi!"))
    'hi!'
    >>> tok.apply_chat_template([{"role": "user", "content": "hi"}])
    [1, 5, 82, 83, 2, 6]
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "CharTokenizer",
    "ChatTemplateError",
    "TokenIdError",
    "ROLES",
    "load_tokenizer",
]

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")

_SPECIALS: tuple[str, ...] = ("<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>",
                              *(f"<|{r}|>" for r in ROLES))
_FIRST_CHAR_ID = len(_SPECIALS)  # 8
_CHARS: tuple[str, ...] = ("\n", "\t", *(chr(c) for c in range(32, 127)))
_VOCAB_SIZE = 128


class ChatTemplateError(ValueError):
    """A chat message list the template cannot render (wrong type, unknown role, missing content)."""


class TokenIdError(ValueError):
    """A token id outside ``[0, vocab_size)`` or not an integer."""


class CharTokenizer:
    """Character-level tokenizer: one id per character, unknown characters map to ``unk_token_id``.

    ``encode`` treats its text literally (``"<|eos|>"`` in text is seven characters, not the eos token).
    """

    name = "char"

    def __init__(self) -> None:
        self.vocab_size: int = _VOCAB_SIZE
        self.pad_token_id: int = 0
        self.bos_token_id: int = 1
        self.eos_token_id: int = 2
        self.unk_token_id: int = 3
        self.role_token_ids: dict[str, int] = {r: 4 + i for i, r in enumerate(ROLES)}
        self._char_to_id: dict[str, int] = {c: _FIRST_CHAR_ID + i for i, c in enumerate(_CHARS)}
        self._id_to_token: list[str] = [*_SPECIALS, *_CHARS,
                                        *(f"<|reserved_{i}|>" for i in range(_FIRST_CHAR_ID + len(_CHARS), _VOCAB_SIZE))]
        if len(self._id_to_token) != self.vocab_size:  # internal table consistency, not user input
            raise RuntimeError(f"char tokenizer table has {len(self._id_to_token)} entries, expected {self.vocab_size}")
        self._special_ids = frozenset(range(_FIRST_CHAR_ID)) | frozenset(
            range(_FIRST_CHAR_ID + len(_CHARS), _VOCAB_SIZE))

    # ----------------------------------------------------------------------------------------------- basic
    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer)

    def __hash__(self) -> int:
        return hash(CharTokenizer)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that are not text: pad, bos, eos, unk, role markers and the reserved tail."""
        return self._special_ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, one per character; characters outside the table become ``unk_token_id``."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        get, unk = self._char_to_id.get, self.unk_token_id
        return [get(c, unk) for c in text]

    def _check_ids(self, ids: Iterable[Any]) -> list[int]:
        if hasattr(ids, "tolist"):  # torch tensor / numpy array
            ids = ids.tolist()
        out = []
        for pos, i in enumerate(ids):
            if isinstance(i, bool) or not isinstance(i, int):
                raise TokenIdError(f"token id at position {pos} must be an int, got {type(i).__name__} {i!r}")
            if not 0 <= i < self.vocab_size:
                raise TokenIdError(f"token id {i} at position {pos} is outside [0, {self.vocab_size})")
            out.append(i)
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = True, skip_special_tokens: bool | None = None) -> str:
        """Text of ``ids``; specials are dropped when ``skip_special`` (``unk`` always decodes to U+FFFD).

        ``skip_special_tokens`` is accepted as an alias so code written for Hugging Face tokenizers works too.
        """
        if skip_special_tokens is not None:
            skip_special = bool(skip_special_tokens)
        table, specials, unk = self._id_to_token, self._special_ids, self.unk_token_id
        parts = []
        for i in self._check_ids(ids):
            if i == unk:
                parts.append("\ufffd")
            elif i in specials:
                if not skip_special:
                    parts.append(table[i])
            else:
                parts.append(table[i])
        return "".join(parts)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """The token string of each id (specials as ``<|name|>``)."""
        return [self._id_to_token[i] for i in self._check_ids(ids)]

    # ----------------------------------------------------------------------------------------------- chat
    @staticmethod
    def message_text(message: Any, position: int = 0) -> tuple[str, str]:
        """``(role, content)`` of one chat message; content may be a str or a list of ``{"type": "text"}`` parts."""
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {position} must be a dict with 'role' and 'content', "
                                    f"got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"message {position}: role {role!r} is not one of {list(ROLES)}")
        if "content" not in message:
            raise ChatTemplateError(f"message {position} ({role}) has no 'content'")
        content = message["content"]
        if content is None:
            content = ""
        if isinstance(content, (list, tuple)):
            texts = []
            for j, part in enumerate(content):
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif isinstance(part, Mapping) and part.get("type") in ("image", "video", "audio"):
                    texts.append(f"<{part['type']}>")  # placeholder; the payload travels as multi_modal_data
                else:
                    raise ChatTemplateError(f"message {position} content part {j}: expected a str or "
                                            f"{{'type': 'text', 'text': str}}, got {part!r}")
            content = "".join(texts)
        if not isinstance(content, str):
            raise ChatTemplateError(f"message {position} ({role}): content must be a str or a list of text parts, "
                                    f"got {type(content).__name__}")
        return role, content

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True) -> list[int] | str:
        """Token ids (or text when ``tokenize=False``) of ``messages`` rendered with the chat template."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
        ids = [self.bos_token_id]
        for pos, message in enumerate(messages):
            role, content = self.message_text(message, pos)
            ids.append(self.role_token_ids[role])
            ids.extend(self.encode(content))
            ids.append(self.eos_token_id)
        if add_generation_prompt:
            ids.append(self.role_token_ids["assistant"])
        if tokenize:
            return ids
        return "".join(self.convert_ids_to_tokens(ids))

    # ------------------------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """A JSON-able description sufficient for :func:`load_tokenizer` to rebuild this tokenizer."""
        return {"name": self.name, "vocab_size": self.vocab_size}


def load_tokenizer(cfg_or_path: Any = "char") -> Any:
    """The tokenizer named by ``cfg_or_path``.

    Accepts ``"char"`` / ``None`` (the built-in :class:`CharTokenizer`), a tokenizer object (returned as is), a
    mapping or config with ``name`` or ``path``, or a local directory holding a Hugging Face tokenizer (needs the
    ``transformers`` package, which this environment does not install: a clear ``ModuleNotFoundError`` then).
    """
    if cfg_or_path is None:
        return CharTokenizer()
    if hasattr(cfg_or_path, "encode") and hasattr(cfg_or_path, "apply_chat_template"):
        return cfg_or_path
    if not isinstance(cfg_or_path, (str, os.PathLike)):
        getter = cfg_or_path.get if isinstance(cfg_or_path, Mapping) or hasattr(cfg_or_path, "get") else None
        if getter is None:
            raise TypeError(f"tokenizer: expected 'char', a local path, or a mapping with 'name'/'path', "
                            f"got {type(cfg_or_path).__name__}")
        path, name = getter("path", None), getter("name", None)
        if path:
            return load_tokenizer(path)
        return load_tokenizer(name or "char")
    text = os.fspath(cfg_or_path)
    if text == "char":
        return CharTokenizer()
    if os.path.isdir(text):
        try:
            import transformers  # noqa: F401  (optional dependency)
        except ImportError:
            raise ModuleNotFoundError(
                f"tokenizer path {text!r} is a Hugging Face tokenizer directory, which needs the 'transformers' "
                f"package (not installed); install it or set tokenizer to 'char'"
            ) from None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(text)
    raise ValueError(f"tokenizer {text!r} is neither 'char' nor an existing local directory")
