"""Tokenizers: byte-level by default, the checkpoint's ``tokenizer.json`` when it has one.

Byte level: UTF-8 bytes are ids 0..255, then bos 256, eos 257, pad 258 (the
tiny checkpoint's vocabulary). Decoding tolerates token sequences that end
(or are cut) inside a multi-byte character: :class:`StreamDecoder` holds the
partial character back until it completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from model_svc.config import ModelConfig
from model_svc.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    pad_id: int | None

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus three special tokens after them."""

    vocab_size = 259
    bos_id: int | None = 256
    eos_ids: tuple[int, ...] = (257,)
    pad_id: int | None = 258

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
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

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        # Specials are added here, not by the tokenizer's post-processor, so
        # add_bos means the same thing for every tokenizer.
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, token_ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special)


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
