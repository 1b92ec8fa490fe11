"""Tokenizers: byte-level by default, the checkpoint's ``tokenizer.json`` when it has one.

Byte level: UTF-8 bytes are ids 0..255, then bos 256, eos 257, pad 258 (the
tiny checkpoint's vocabulary). A ``tokenizer.json`` comes with the
``tokenizer_config.json`` beside it: whether encoding adds bos
(``add_bos_token``; without it, what the tokenizer's own post-processor does,
as in Hugging Face) and the chat template (``chat_template.jinja`` if the
folder has one, else the config's: :mod:`model_svc.chat_template`).

Decoding tolerates token sequences that end (or are cut) inside a multi-byte
character: :class:`StreamDecoder` holds the partial character back until it
completes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from model_svc.chat_template import ChatTemplate, checkpoint_template_source
from model_svc.config import ModelConfig
from model_svc.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    pad_id: int | None
    add_bos: bool  # what encode does when not told
    chat_template: ChatTemplate | None

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus three special tokens after them."""

    vocab_size = 259
    bos_id: int | None = 256
    eos_ids: tuple[int, ...] = (257,)
    pad_id: int | None = 258
    add_bos = True
    chat_template: ChatTemplate | None = None

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        ids = list(text.encode("utf-8"))
        add_bos = self.add_bos if add_bos is None else add_bos
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, token_ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Bytes to text; an invalid or incomplete sequence becomes U+FFFD, never an error."""
        data = bytearray()
        specials = []
        for token_id in token_ids:
            if 0 <= token_id < 256:
                data.append(token_id)
            elif not skip_special:
                specials.append((len(data), f"<|{token_id}|>"))
        if not specials:
            return data.decode("utf-8", errors="replace")
        parts, start = [], 0
        for at, mark in specials:
            parts += [data[start:at].decode("utf-8", errors="replace"), mark]
            start = at
        return "".join([*parts, data[start:].decode("utf-8", errors="replace")])


class HFTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` package; specials from the config."""

    def __init__(self, path: Path, config: ModelConfig) -> None:
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:
            raise CheckpointError(
                f"{path}: the checkpoint has a tokenizer.json but the 'tokenizers' package is "
                "not installed (pip install tokenizers)"
            ) from None
        try:
            self._tokenizer = RustTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            raise CheckpointError(f"{path}: not a valid tokenizer.json ({exc})") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        if self.vocab_size > config.vocab_size:
            raise CheckpointError(
                f"{path}: {self.vocab_size} tokens, more than the model's vocab_size "
                f"{config.vocab_size}"
            )
        self.bos_id = config.bos_token_id
        self.eos_ids = config.eos_token_ids
        self.pad_id = config.pad_token_id
        settings = _tokenizer_config(path.with_name(TOKENIZER_CONFIG_FILE))
        self.add_bos = self._adds_bos(settings)
        source = checkpoint_template_source(path.parent, settings)
        self.chat_template = None if source is None else ChatTemplate(source, self._specials())

    def _adds_bos(self, settings: dict[str, Any]) -> bool:
        """``add_bos_token`` if the config says, else whether the post-processor adds bos."""
        if "add_bos_token" in settings:
            return bool(settings["add_bos_token"])
        probe = self._tokenizer.encode("", add_special_tokens=True).ids
        return self.bos_id is not None and probe[:1] == [self.bos_id]

    def _specials(self) -> dict[str, str | None]:
        def token(token_id: int | None) -> str | None:
            return None if token_id is None else self._tokenizer.id_to_token(token_id)

        eos = self.eos_ids[0] if self.eos_ids else None
        return {
            "bos_token": token(self.bos_id),
            "eos_token": token(eos),
            "pad_token": token(self.pad_id),
        }

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        # Specials are added here, not by the tokenizer's post-processor, so
        # add_bos means the same thing for every tokenizer.
        # encode_batch, not encode: the same ids, but it lets go of the GIL while it works
        # (tokenizers 0.23: encode held it 31 s for a 12 MB chat message, stopping the HTTP
        # front's event loop even with the tokenizing in a worker thread)
        ids = self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        add_bos = self.add_bos if add_bos is None else add_bos
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, token_ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special)


def _tokenizer_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: must hold a JSON object")
    return data


def load_tokenizer(checkpoint: str | Path, config: ModelConfig) -> Tokenizer:
    """The checkpoint's ``tokenizer.json`` if it has one, else the byte tokenizer."""
    directory = Path(checkpoint)
    path = directory / TOKENIZER_FILE
    if path.exists():
        return HFTokenizer(path, config)
    if (directory / "tokenizer.model").exists():
        raise CheckpointError(
            f"{directory}: has only a sentencepiece tokenizer.model; add its tokenizer.json"
        )
    if config.vocab_size < ByteTokenizer.vocab_size:
        raise CheckpointError(
            f"{directory}: no tokenizer.json, and vocab_size {config.vocab_size} is too small "
            f"for the byte tokenizer ({ByteTokenizer.vocab_size})"
        )
    return ByteTokenizer()


class StreamDecoder:
    """Text of a growing token sequence, piece by piece, never splitting a character.

    Decodes a short window (``prefix`` tokens already shown, then the new
    ones) instead of the whole sequence, and holds text back while it ends in
    U+FFFD (a character whose remaining bytes or tokens are still to come).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_start = 0  # window start: tokens before it are shown and settled
        self._read_start = 0  # tokens before this are shown

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; returns the text that became final."""
        self._ids.extend(token_ids)
        shown = self._tokenizer.decode(self._ids[self._prefix_start : self._read_start])
        text = self._tokenizer.decode(self._ids[self._prefix_start :])
        if len(text) <= len(shown) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix_start, self._read_start = self._read_start, len(self._ids)
        return text[len(shown) :]

    def flush(self) -> str:
        """What is left at the end (an unfinished character comes out as U+FFFD)."""
        shown = self._tokenizer.decode(self._ids[self._prefix_start : self._read_start])
        text = self._tokenizer.decode(self._ids[self._prefix_start :])
        self._prefix_start = self._read_start = len(self._ids)
        return text[len(shown) :]
