"""Tokenizers of the rollout: a built-in character-level tokenizer (every run works without a download) and
:class:`HFTokenizer`, a local Hugging Face tokenizer folder seen through the same interface.

The character tokenizer:

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

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from protocol.checks import INT, only_types
from protocol.config import ConfigError

__all__ = [
    "CharTokenizer",
    "HFTokenizer",
    "ChatTemplateError",
    "TokenIdError",
    "TokenizerError",
    "VocabularyError",
    "ROLES",
    "load_tokenizer",
    "resolve_tokenizer",
    "generation_stop_ids",
    "stop_token_ids",
    "check_vocab_fits",
    "decode_response",
    "TOKENIZER_FILES",
    "has_tokenizer_files",
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


class TokenizerError(ConfigError):
    """A tokenizer source that cannot be loaded (no such folder, no tokenizer files, no EOS token)."""


class VocabularyError(ConfigError):
    """The tokenizer has more tokens than the model's embedding has rows."""


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
        # what decode writes for each id, with specials kept / dropped (unk is always U+FFFD)
        shown = ["\ufffd" if i == self.unk_token_id else t for i, t in enumerate(self._id_to_token)]
        self._decode_tables = {False: shown,
                               True: ["\ufffd" if i == self.unk_token_id else ("" if i in self._special_ids else t)
                                      for i, t in enumerate(self._id_to_token)]}

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
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end a generation: ``<|eos|>``."""
        return frozenset({self.eos_token_id})

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
        ids = ids if type(ids) is list else list(ids)
        if only_types(ids, INT) and (not ids or (min(ids) >= 0 and max(ids) < self.vocab_size)):
            return ids  # the common case in one C-level pass; the loop below names the first bad id
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
        return "".join(map(self._decode_tables[bool(skip_special)].__getitem__, self._check_ids(ids)))

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

    def save_pretrained(self, out: str | os.PathLike) -> None:
        """Write this tokenizer as a Hugging Face tokenizer folder (needs ``tokenizers`` and ``transformers``).

        ``AutoTokenizer.from_pretrained(out)`` then gives the same ids for text and for chat templates, and the same
        decoding; one difference is inherent to Hugging Face tokenizers: a special token's text (``"<|eos|>"``) in
        the input is read as that token, where :meth:`encode` reads its characters.
        """
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(self._id_to_token)}, unk_token="<|unk|>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([self._id_to_token[i] for i in sorted(self._special_ids)])
        roles = ", ".join(f"'{r}'" for r in ROLES)
        template = ("{{ '<|bos|>' }}{% for m in messages %}{% if m['role'] not in [" + roles + "] %}"
                    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                    "{{ '<|' + m['role'] + '|>' + m['content'] + '<|eos|>' }}{% endfor %}"
                    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
        hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                     pad_token="<|pad|>", unk_token="<|unk|>", chat_template=template)
        hf.save_pretrained(os.fspath(out))


def generation_stop_ids(path: str | os.PathLike | None) -> frozenset[int]:
    """The ``eos_token_id`` entries (an int or a list) of ``path/generation_config.json``; empty when absent.

    Instruction-tuned checkpoints list every id that ends an assistant turn there (Qwen2.5: ``<|im_end|>`` and
    ``<|endoftext|>``), which is more than the tokenizer's single ``eos_token``.
    """
    if not path:
        return frozenset()
    file = os.path.join(os.fspath(path), "generation_config.json")
    if not os.path.isfile(file):
        return frozenset()
    with open(file) as fh:
        try:
            found = json.load(fh).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise TokenizerError(f"{file} is not a JSON object: {exc}") from exc
    if found is None:
        return frozenset()
    values = found if isinstance(found, (list, tuple)) else [found]
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise TokenizerError(f"{file}: eos_token_id must be an int or a list of ints >= 0, got {found!r}")
    return frozenset(int(v) for v in values)


class HFTokenizer:
    """A Hugging Face tokenizer behind the interface the rollout uses, identical under transformers 4 and 5.

    * ``apply_chat_template`` always returns token ids (transformers 5 returns a ``BatchEncoding`` unless asked
      for ``return_dict=False``; both versions are asked explicitly);
    * ``vocab_size`` is ``len(tokenizer)``, added tokens included (the HF attribute of that name leaves them out);
    * ``stop_token_ids`` is the EOS token plus the ``generation_config.json`` EOS ids of the tokenizer's folder;
    * ``encode`` adds no special tokens; ``decode`` accepts ``skip_special`` like :class:`CharTokenizer`.
    """

    name = "hf"

    def __init__(self, hf: Any, path: str = "", extra_stop_ids: Iterable[int] = ()) -> None:
        self.hf = hf
        self.path = os.fspath(path) if path else ""
        if hf.eos_token_id is None:
            raise TokenizerError(f"the tokenizer at {self.path or hf!r} defines no eos_token; generation could never "
                                 f"stop: set eos_token in its tokenizer_config.json")
        self.vocab_size: int = len(hf)
        self.eos_token_id: int = int(hf.eos_token_id)
        self.pad_token_id: int = int(hf.pad_token_id) if hf.pad_token_id is not None else self.eos_token_id
        self.bos_token_id: int | None = hf.bos_token_id
        stops = {self.eos_token_id, *generation_stop_ids(self.path), *(int(i) for i in extra_stop_ids)}
        outside = sorted(i for i in stops if not 0 <= i < self.vocab_size)
        if outside:
            raise TokenizerError(f"stop token ids {outside} (eos_token / generation_config.json eos_token_id) are "
                                 f"outside the tokenizer's {self.vocab_size} tokens")
        self._stop_ids = frozenset(stops)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, stop_token_ids={sorted(self._stop_ids)})"

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end a generation: the EOS token and the checkpoint's ``generation_config.json`` EOS ids."""
        return self._stop_ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without any added special token."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int], skip_special: bool = True, skip_special_tokens: bool | None = None) -> str:
        """Text of ``ids``; ``skip_special_tokens`` is an alias of ``skip_special``."""
        if skip_special_tokens is not None:
            skip_special = bool(skip_special_tokens)
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """The token string of each id."""
        return list(self.hf.convert_ids_to_tokens(list(ids.tolist() if hasattr(ids, "tolist") else ids)))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True) -> list[int] | str:
        """Token ids (or text when ``tokenize=False``) of ``messages`` rendered with the tokenizer's template."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
        if not tokenize:
            return self.hf.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                               tokenize=False)
        out = self.hf.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                          tokenize=True, return_dict=False)
        if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # a version that ignores return_dict
            out = out["input_ids"]
        if hasattr(out, "tolist"):
            out = out.tolist()
        ids = list(out)
        if ids and isinstance(ids[0], (list, tuple)):
            raise ChatTemplateError(f"apply_chat_template returned a batch of {len(ids)} rows for one conversation")
        bad = [(i, t) for i, t in enumerate(ids[:1000]) if isinstance(t, bool) or not isinstance(t, int)]
        if bad:
            raise ChatTemplateError(f"apply_chat_template returned non-integer token {bad[0][1]!r} at position "
                                    f"{bad[0][0]}; expected token ids")
        return ids

    def save_pretrained(self, out: str | os.PathLike) -> None:
        """Write the tokenizer files (tokenizer.json, tokenizer_config.json, chat template, ...) into ``out``."""
        self.hf.save_pretrained(os.fspath(out))

    def state_dict(self) -> dict[str, Any]:
        """A JSON-able description sufficient for :func:`load_tokenizer` to rebuild this tokenizer."""
        return {"name": self.name, "path": self.path}


def stop_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids that end a generation for ``tokenizer``: its ``stop_token_ids``, else ``{eos_token_id}``."""
    found = getattr(tokenizer, "stop_token_ids", None)
    if found is not None:
        return frozenset(int(i) for i in found)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise TokenizerError(f"tokenizer {type(tokenizer).__name__} has neither stop_token_ids nor eos_token_id")
    return frozenset({int(eos)})


def check_vocab_fits(tokenizer: Any, model_vocab_size: int, where: str = "model.vocab_size") -> None:
    """Refuse a tokenizer with more tokens than the model's embedding rows; a model padded larger is fine."""
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", None)
    if size is None:
        raise TokenizerError(f"tokenizer {type(tokenizer).__name__} reports no vocabulary size (len() or vocab_size)")
    if int(size) > int(model_vocab_size):
        raise VocabularyError(
            f"the tokenizer has {int(size)} tokens but the model's embedding has {int(model_vocab_size)} rows "
            f"({where}); ids >= {int(model_vocab_size)} would index past it: use the checkpoint's own tokenizer "
            f"(leave data.tokenizer unset with model.hf_path) or a model with a vocabulary of at least {int(size)}")
    stops = sorted(i for i in stop_token_ids(tokenizer) if i >= int(model_vocab_size))
    if stops:
        raise VocabularyError(f"stop token ids {stops} are outside the model's {int(model_vocab_size)} embedding "
                              f"rows ({where})")


def decode_response(tokenizer: Any, ids: Iterable[int], stop_ids: Iterable[int] | None = None) -> str:
    """The response text a scorer sees: the final stop token removed, every other token (specials too) kept.

    A reference system decodes with every special token skipped; that also hides filler (``<|pad|>`` ...) the
    policy may append to a right answer, so here only the token that ended the generation is dropped: a correct
    answer scores the same with or without its EOS, and padded answers still read as padded.
    """
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    ids = ids if type(ids) is list and only_types(ids, INT) else [int(i) for i in ids]
    if stop_ids is None:
        stops = stop_token_ids(tokenizer)
    elif isinstance(stop_ids, (set, frozenset)) and only_types(stop_ids, INT):
        stops = stop_ids
    else:
        stops = frozenset(int(i) for i in stop_ids)
    if ids and ids[-1] in stops:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special=False)


def resolve_tokenizer(tokenizer: str | None, hf_path: str | None) -> str:
    """The tokenizer source of a run: ``data.tokenizer`` when given, else the ``model.hf_path`` folder's own
    tokenizer, else the built-in ``"char"``. This is the one place that default is decided."""
    if tokenizer:
        return os.fspath(tokenizer)
    return os.fspath(hf_path) if hf_path else "char"


#: the files a Hugging Face tokenizer folder holds (any one of them)
TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"})


def has_tokenizer_files(path: str | os.PathLike) -> bool:
    """Whether the folder ``path`` holds a Hugging Face tokenizer."""
    return os.path.isdir(path) and bool(TOKENIZER_FILES & set(os.listdir(path)))


def load_tokenizer(cfg_or_path: Any = "char") -> Any:
    """The tokenizer named by ``cfg_or_path``.

    Accepts ``"char"`` / ``None`` (the built-in :class:`CharTokenizer`), a tokenizer object (returned as is), a
    mapping or config with ``name`` or ``path``, or a local directory holding a Hugging Face tokenizer (read with
    ``transformers.AutoTokenizer``, wrapped in :class:`HFTokenizer`; nothing is downloaded).
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
            from transformers import AutoTokenizer
        except ImportError:
            raise ModuleNotFoundError(
                f"data.tokenizer={text!r} is a Hugging Face tokenizer directory, which needs the 'transformers' "
                f"package (not installed); install it or set data.tokenizer=char"
            ) from None
        if not has_tokenizer_files(text):
            raise TokenizerError(f"data.tokenizer={text!r}: the folder has no tokenizer files (tokenizer.json, "
                                 f"tokenizer_config.json, ...); point data.tokenizer at a Hugging Face tokenizer "
                                 f"folder or set it to 'char'")
        return HFTokenizer(AutoTokenizer.from_pretrained(text, local_files_only=True), path=text)
    raise TokenizerError(f"data.tokenizer={text!r} is neither 'char' nor an existing local directory")
