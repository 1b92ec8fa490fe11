"""The tokenizer of a GGUF file (``tokenizer.ggml.*``) as a ``tokenizers`` byte-level
BPE and its ``tokenizer_config.json`` (:mod:`model_svc.gguf_convert` writes them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model_svc.config import ModelConfig
from model_svc.gguf_reader import GGUFConvertError, GgufFile

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# tokenizer.ggml.pre -> does the pre-tokenizer split digits one by one before the
# GPT-2 byte-level regex (the StarCoder family, which SmolLM uses).
_PRE_TOKENIZERS = {
    "gpt-2": False,
    "smollm": True,
    "starcoder": True,
    "refact": True,
}


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[tuple[str, str]]
    digits_apart: bool

    def token(self, token_id: int | None) -> str | None:
        if token_id is None:
            return None
        if not 0 <= token_id < len(self.tokens):
            raise GGUFConvertError(f"special token id {token_id} is not in the token list")
        return self.tokens[token_id]


def read_vocab(src: GgufFile, config: ModelConfig) -> Vocab:
    model = src.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFConvertError(
            f"{src.path}: tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    pre = src.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFConvertError(
            f"{src.path}: pre-tokenizer {pre!r} is not supported (only {sorted(_PRE_TOKENIZERS)})"
        )
    tokens = [str(t) for t in src.require("tokenizer.ggml.tokens")]
    types = [int(t) for t in src.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))]
    if len(types) != len(tokens):
        raise GGUFConvertError(f"{src.path}: {len(types)} token types for {len(tokens)} tokens")
    if len(tokens) > config.vocab_size:
        raise GGUFConvertError(
            f"{src.path}: {len(tokens)} tokens, more than vocab_size {config.vocab_size}"
        )
    if len(set(tokens)) != len(tokens):
        raise GGUFConvertError(f"{src.path}: the token list has duplicates")
    merges = []
    for merge in src.get("tokenizer.ggml.merges", []):
        left, sep, right = str(merge).partition(" ")
        if not sep or not left or not right:
            raise GGUFConvertError(f"{src.path}: merge {merge!r} is not two tokens")
        merges.append((left, right))
    return Vocab(tokens, types, merges, _PRE_TOKENIZERS[pre])


def build_tokenizer(vocab: Vocab) -> Any:
    """A ``tokenizers.Tokenizer``: byte-level BPE, GPT-2 regex (digits one by one where
    the GGUF's pre-tokenizer says so), control tokens as special added tokens."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise GGUFConvertError(
            "writing tokenizer.json needs the 'tokenizers' package (pip install tokenizers)"
        ) from None
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(vocab.tokens)},
        merges=vocab.merges,
        fuse_unk=False,
        byte_fallback=False,
    )
    tokenizer = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if vocab.digits_apart
        else byte_level
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = [t for t, kind in zip(vocab.tokens, vocab.types, strict=True) if kind == _CONTROL]
    users = [t for t, kind in zip(vocab.tokens, vocab.types, strict=True) if kind == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in users])
    return tokenizer


def tokenizer_config(src: GgufFile, vocab: Vocab, config: ModelConfig) -> dict[str, Any]:
    unk = src.get("tokenizer.ggml.unknown_token_id")
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    data: dict[str, Any] = {
        # Loads tokenizer.json as written, whatever the model family.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(src.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(src.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(src.get("tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "bos_token": vocab.token(config.bos_token_id),
        "eos_token": vocab.token(eos),
        "pad_token": vocab.token(config.pad_token_id),
        "unk_token": vocab.token(unk),
    }
    template = src.get("tokenizer.chat_template")
    if template is not None:
        data["chat_template"] = str(template)
    return {key: value for key, value in data.items() if value is not None}
