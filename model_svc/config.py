"""The model's shape, read from a Hugging Face ``config.json`` (LlamaConfig field names).

Only what the Llama decoder needs is kept; everything else in the file is
ignored, except settings that would change the math this worker implements
(a different architecture, activation, biases or RoPE scaling kind), which are
rejected instead of being silently ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model_svc.errors import CheckpointError

CONFIG_FILE = "config.json"

_REQUIRED_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_ROPE_KINDS = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """``rope_scaling`` of the config: ``linear`` or ``llama3`` (Llama 3.1+)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in _ROPE_KINDS[1:]:
            raise CheckpointError(
                f"rope_scaling type {self.kind!r} is not supported (only {_ROPE_KINDS})"
            )
        if not self.factor > 0:
            raise CheckpointError(f"rope_scaling.factor must be > 0, got {self.factor!r}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise CheckpointError("rope_scaling needs high_freq_factor > low_freq_factor > 0")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RopeScaling | None:
        if not data:
            return None
        kind = data.get("rope_type", data.get("type", "default"))
        if kind == "default":
            return None
        try:
            if kind == "llama3":
                return cls(
                    kind,
                    float(data["factor"]),
                    float(data["low_freq_factor"]),
                    float(data["high_freq_factor"]),
                    int(data["original_max_position_embeddings"]),
                )
            return cls(kind, float(data["factor"]))
        except KeyError as exc:
            raise CheckpointError(f"rope_scaling of type {kind!r} lacks {exc.args[0]!r}") from None

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    # HF's ``eos_token_id`` may be one id or a list (Llama 3 has several).
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    rope_scaling: RopeScaling | None = field(default=None)

    def __post_init__(self) -> None:
        for name in (*_REQUIRED_INTS, "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointError(f"config {name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise CheckpointError(f"config {name} must be a positive number, got {value!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise CheckpointError("config tie_word_embeddings must be true or false")
        specials = [self.bos_token_id, self.pad_token_id, *self.eos_token_ids]
        for token_id in specials:
            if token_id is not None and not (
                isinstance(token_id, int) and 0 <= token_id < self.vocab_size
            ):
                raise CheckpointError(
                    f"special token id {token_id!r} is outside the vocabulary ({self.vocab_size})"
                )

    # -- derived sizes ---------------------------------------------------------

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    # -- HF config.json --------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from the fields of an HF ``LlamaConfig`` dict."""
        _reject_unsupported(data)
        missing = [name for name in _REQUIRED_INTS if name not in data]
        if missing:
            raise CheckpointError(f"config lacks {', '.join(missing)}")
        heads = data["num_attention_heads"]
        head_dim = data.get("head_dim")
        if head_dim is None:
            if not isinstance(heads, int) or heads < 1 or data["hidden_size"] % heads:
                raise CheckpointError(
                    f"hidden_size {data['hidden_size']} is not a multiple of "
                    f"num_attention_heads {heads} (and no head_dim is given)"
                )
            head_dim = data["hidden_size"] // heads
        eos = data.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            vocab_size=data["vocab_size"],
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_hidden_layers=data["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=data.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=data.get("rope_theta", 10000.0),
            max_position_embeddings=data.get("max_position_embeddings", 2048),
            tie_word_embeddings=data.get("tie_word_embeddings", False),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=data.get("pad_token_id"),
            rope_scaling=RopeScaling.from_dict(data.get("rope_scaling")),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (a file, or the checkpoint directory that holds one)."""
        path = Path(path)
        if path.is_dir():
            path = path / CONFIG_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: not a readable JSON file ({exc})") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{path}: expected a JSON object")
        try:
            return cls.from_dict(data)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: a field has the wrong type ({exc})") from None

    def to_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` form (what :meth:`from_dict` reads back)."""
        eos: int | list[int] | None = (
            None
            if not self.eos_token_ids
            else self.eos_token_ids[0]
            if len(self.eos_token_ids) == 1
            else list(self.eos_token_ids)
        )
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_dict() if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
        }


def _reject_unsupported(data: dict[str, Any]) -> None:
    """Settings that change the math: refuse them rather than compute something else."""
    model_type = data.get("model_type", "llama")
    if model_type != "llama":
        raise CheckpointError(f"model_type {model_type!r} is not supported (only 'llama')")
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} is not supported (only 'silu')")
    for name in ("attention_bias", "mlp_bias"):
        if data.get(name):
            raise CheckpointError(f"{name}=true is not supported")
