"""Byte-level tokenizer, streaming decode, and the tokenizer.json path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from model_svc.errors import CheckpointError
from model_svc.tiny import BOS_ID, EOS_ID, tiny_config
from model_svc.tokenizer import ByteTokenizer, StreamDecoder, load_tokenizer

TEXT = "naïve café — 🍵 ok"


def test_byte_round_trip_and_specials() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids[0] == BOS_ID and ids[1:] == list(TEXT.encode())
    assert tok.decode([*ids, EOS_ID]) == TEXT
    assert tok.decode([BOS_ID, *b"a", EOS_ID, *b"b"], skip_special=False) == "<|256|>a<|257|>b"
    assert tok.encode("x", add_bos=False) == [ord("x")]


def test_partial_utf8_never_raises() -> None:
    tok = ByteTokenizer()
    data = "🍵".encode()
    assert tok.decode(list(data[:2])) == "\ufffd"
    assert tok.decode([0xFF, *b"a"]) == "\ufffda"


def test_stream_decoder_holds_back_partial_characters() -> None:
    stream = StreamDecoder(ByteTokenizer())
    pieces = [stream.push([byte]) for byte in TEXT.encode()]
    assert "".join(pieces) + stream.flush() == TEXT
    assert all("\ufffd" not in piece for piece in pieces)
    cut = StreamDecoder(ByteTokenizer())
    assert cut.push(list("é".encode()[:1])) == ""
    assert cut.flush() == "\ufffd"


def test_checkpoint_tokenizer_choice(tmp_path: Path, monkeypatch) -> None:
    config = tiny_config()
    assert isinstance(load_tokenizer(tmp_path, config), ByteTokenizer)
    with pytest.raises(CheckpointError, match="too small for the byte tokenizer"):
        load_tokenizer(
            tmp_path,
            tiny_config(vocab_size=100, eos_token_ids=(), bos_token_id=None, pad_token_id=None),
        )
    (tmp_path / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(CheckpointError, match="sentencepiece"):
        load_tokenizer(tmp_path, config)
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails as if not installed
    with pytest.raises(CheckpointError, match="'tokenizers' package is not installed"):
        load_tokenizer(tmp_path, config)


def test_tokenizer_json_is_used(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4, "!": 5}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    hf = tokenizers.Tokenizer(model)
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.decoder = tokenizers.decoders.WordPiece()
    hf.add_special_tokens(["<s>", "</s>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    config = tiny_config(vocab_size=8, bos_token_id=0, eos_token_ids=(1,), pad_token_id=None)
    tok = load_tokenizer(tmp_path, config)
    # No tokenizer_config.json and no post-processor adding bos: none by default, as in HF.
    assert tok.encode("hello world!") == [3, 4, 5]
    assert tok.encode("hello world!", add_bos=True) == [0, 3, 4, 5]
    assert tok.decode([0, 3, 4, 1]) == "hello world"
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(CheckpointError, match=r"not a valid tokenizer\.json"):
        load_tokenizer(tmp_path, config)
