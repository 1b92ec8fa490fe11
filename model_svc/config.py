"""The model's shape, read from a Hugging Face ``config.json`` (LlamaConfig field names).

Three transformers architectures share this worker's math: Llama, and Mistral
and Ministral, which are Llama plus a sliding window. Mistral windows every
layer (``sliding_window``; null = none); Ministral reads a per-layer
``layer_types`` list of ``sliding_attention`` / ``full_attention`` (default:
every layer sliding when ``sliding_window`` is set), so it covers hybrid
models. A sliding layer's query at position ``i`` sees keys ``j`` with
``i - sliding_window < j <= i``, as transformers' mask does. Window settings
an architecture would ignore (``sliding_window`` on Llama, ``layer_types`` on
Mistral that disagree with its one window) and Qwen2's ``use_sliding_window``
/ ``max_window_layers`` form are refused by name.

Both layouts that transformers writes are read: 4.x's (``rope_theta`` and
``rope_scaling`` at the top level, ``torch_dtype``) and 5.x's (RoPE inside
``rope_parameters``, ``dtype``, ``head_dim`` always written). A
``generation_config.json`` beside the file adds its stop ids.

Only what the Llama decoder needs is kept; everything else in the file is
ignored, except settings that would change the math this worker implements
(another architecture, activation, biases, RoPE kind, partial rotary, quantized
weights), which are refused by name instead of being silently ignored. A field
that is absent takes LlamaConfig's own default (``rope_theta`` 10000,
``rms_norm_eps`` 1e-6, ...), which is what transformers itself would use.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model_svc.errors import CheckpointError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

_REQUIRED_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_ROPE_KINDS = ("default", "linear", "llama3")
# The checkpoint's own dtype (4.x ``torch_dtype``, 5.x ``dtype``).
DTYPES = ("float32", "float16", "bfloat16")
# The classes whose math is exactly this worker's, with their model_type: no other
# transformers class is (Qwen2 adds q/k/v biases, Gemma a scaled embedding and
# GeGLU, ...), so checkpoints of those are refused even where the tensors would fit.
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",  # Llama + one sliding window on every layer
    "MinistralForCausalLM": "ministral",  # Llama + a window on the layers layer_types says
}
ARCHITECTURES = tuple(MODEL_TYPES)
_ARCHITECTURE_OF = {model_type: arch for arch, model_type in MODEL_TYPES.items()}
_DEFAULT_ROPE_THETA = 10000.0
# transformers' names for a layer's attention kind (config.layer_types); "attention"
# is an older spelling transformers still reads as full attention.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
_LEGACY_LAYER_TYPES = {"attention": FULL_ATTENTION}
# MistralConfig's and MinistralConfig's defaults for fields a config.json may omit.
_MISTRAL_DEFAULT_WINDOW = 4096
_MISTRAL_DEFAULT_MAX_POSITIONS = 4096 * 32


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling: ``linear`` or ``llama3`` (Llama 3.1+).

    4.x's ``rope_scaling``, or the scaling fields of 5.x's ``rope_parameters``.
    """

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
    def from_dict(
        cls, data: dict[str, Any] | None, source: str = "rope_scaling"
    ) -> RopeScaling | None:
        """``data`` is a ``rope_scaling`` or a ``rope_parameters`` (named by ``source``)."""
        if not data:
            return None
        if not isinstance(data, dict):
            raise CheckpointError(f"{source} must be an object, got {data!r}")
        kind = data.get("rope_type", data.get("type", "default"))
        if kind == "default":
            return None
        if kind not in _ROPE_KINDS:
            what = "rope_scaling type" if source == "rope_scaling" else f"{source} rope_type"
            raise CheckpointError(f"{what} {kind!r} is not supported (only {_ROPE_KINDS})")
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
            raise CheckpointError(f"{source} of type {kind!r} lacks {exc.args[0]!r}") from None

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
    # Given by the config (5.x always writes it; it may differ from
    # hidden_size // num_attention_heads), else derived from those two.
    head_dim: int
    rms_norm_eps: float = 1e-6
    # 4.x's top-level rope_theta or 5.x's rope_parameters["rope_theta"].
    rope_theta: float = _DEFAULT_ROPE_THETA
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    # Every stop id: config.json's ``eos_token_id`` (one id or a list: Llama 3 has
    # several), then those generation_config.json adds, without repeats.
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    rope_scaling: RopeScaling | None = field(default=None)
    # The dtype the checkpoint's weights were saved in (4.x ``torch_dtype``, 5.x
    # ``dtype``): one of DTYPES, "float32" where the config says none. Informational:
    # the loader casts to the compute dtype it is asked for.
    dtype: str = "float32"
    # One of ARCHITECTURES; what to_dict writes back.
    architecture: str = "LlamaForCausalLM"
    # W: a sliding layer's query at position i sees keys i - W < j <= i. None when no
    # layer slides (then layer_types is ()).
    sliding_window: int | None = None
    # One of LAYER_TYPES per layer; () = every layer full attention (as PoolLayout).
    layer_types: tuple[str, ...] = ()

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
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise CheckpointError(f"config {name} must be a positive number, got {value!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise CheckpointError("config tie_word_embeddings must be true or false")
        if self.dtype not in DTYPES:
            raise CheckpointError(
                f"config dtype {self.dtype!r} is not supported (only {', '.join(DTYPES)})"
            )
        self._check_window()
        specials = [self.bos_token_id, self.pad_token_id, *self.eos_token_ids]
        for token_id in specials:
            if token_id is not None and not _in_vocab(token_id, self.vocab_size):
                raise CheckpointError(
                    f"special token id {token_id!r} is outside the vocabulary ({self.vocab_size})"
                )

    def _check_window(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise CheckpointError(
                f"architecture {self.architecture!r} is not supported (only {list(ARCHITECTURES)})"
            )
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise CheckpointError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"num_hidden_layers {self.num_hidden_layers}"
            )
        unknown = sorted({t for t in self.layer_types if t not in LAYER_TYPES}, key=str)
        if unknown:
            raise CheckpointError(
                f"layer_types {unknown} are not supported (only {list(LAYER_TYPES)})"
            )
        window = self.sliding_window
        if self.sliding_layer_ids:
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise CheckpointError(
                    f"sliding_window must be a positive int for sliding_attention layers, "
                    f"got {window!r}"
                )
        elif window is not None or self.layer_types:
            raise CheckpointError(
                "sliding_window and layer_types are kept only for a model with a "
                f"sliding_attention layer (got {window!r} and {list(self.layer_types)})"
            )
        if self.architecture == "LlamaForCausalLM" and self.sliding_layer_ids:
            raise CheckpointError("LlamaForCausalLM has no sliding-window layers")
        if self.architecture == "MistralForCausalLM" and 0 < len(self.sliding_layer_ids) < (
            self.num_hidden_layers
        ):
            raise CheckpointError("MistralForCausalLM windows every layer or none")

    # -- attention kinds -------------------------------------------------------

    @property
    def sliding_layer_ids(self) -> tuple[int, ...]:
        """Indices of the sliding-window layers (empty when none slides)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == SLIDING_ATTENTION)

    def layer_window(self, layer: int) -> int | None:
        """``layer``'s window W, or None for a full-attention layer."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

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
    def from_dict(
        cls, data: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from the fields of an HF ``LlamaConfig`` dict (4.x or 5.x layout).

        ``generation`` is the ``generation_config.json`` dict, if any: its
        ``eos_token_id`` adds stop ids, its ``bos_token_id`` fills a missing one.
        """
        architecture = _reject_unsupported(data)
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
        kv_heads = data.get("num_key_value_heads")
        rope_theta, rope_scaling = _read_rope(data)
        bos_id, eos_ids = _read_special_ids(data, generation or {})
        window, layer_types = _read_window(data, architecture)
        default_positions = (
            2048 if architecture == "LlamaForCausalLM" else _MISTRAL_DEFAULT_MAX_POSITIONS
        )
        return cls(
            vocab_size=data["vocab_size"],
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_hidden_layers=data["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=heads if kv_heads is None else kv_heads,
            head_dim=head_dim,
            rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=data.get("max_position_embeddings", default_positions),
            tie_word_embeddings=data.get("tie_word_embeddings", False),
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            pad_token_id=data.get("pad_token_id"),
            rope_scaling=rope_scaling,
            dtype=_read_dtype(data),
            architecture=architecture,
            sliding_window=window,
            layer_types=layer_types,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (a file, or the checkpoint directory that holds one),
        with the ``generation_config.json`` beside it when there is one."""
        path = Path(path)
        if path.is_dir():
            path = path / CONFIG_FILE
        data = _read_json(path)
        generation_path = path.parent / GENERATION_CONFIG_FILE
        generation = _read_json(generation_path) if generation_path.exists() else None
        try:
            return cls.from_dict(data, generation)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: a field has the wrong type ({exc})") from None

    def to_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` form (what :meth:`from_dict` reads back).

        Written in the 4.x layout, which transformers 5.x reads too.
        """
        eos: int | list[int] | None = (
            None
            if not self.eos_token_ids
            else self.eos_token_ids[0]
            if len(self.eos_token_ids) == 1
            else list(self.eos_token_ids)
        )
        window: dict[str, Any] = {}
        if self.architecture != "LlamaForCausalLM":
            window["sliding_window"] = self.sliding_window
        if self.architecture == "MinistralForCausalLM":
            window["layer_types"] = list(self.layer_types) or [FULL_ATTENTION] * (
                self.num_hidden_layers
            )
        return {
            "architectures": [self.architecture],
            "model_type": MODEL_TYPES[self.architecture],
            "torch_dtype": self.dtype,
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
            **window,
        }


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _in_vocab(token_id: object, vocab_size: object) -> bool:
    return (
        isinstance(token_id, int)
        and not isinstance(token_id, bool)
        and isinstance(vocab_size, int)
        and 0 <= token_id < vocab_size
    )


def _reject_unsupported(data: dict[str, Any]) -> str:
    """Settings that change the math: refuse them rather than compute something else.

    Returns the architecture (one of ARCHITECTURES), from ``architectures`` and
    ``model_type``, which must agree; Llama where the config names neither.
    """
    architectures = data.get("architectures")
    if architectures is not None:
        if not isinstance(architectures, list) or not all(
            isinstance(name, str) for name in architectures
        ):
            raise CheckpointError(
                f"architectures must be a list of class names, got {architectures!r}"
            )
        others = [name for name in architectures if name not in ARCHITECTURES]
        if others:
            raise CheckpointError(
                f"architectures {others!r} are not supported (only {list(ARCHITECTURES)})"
            )
    model_type = data.get("model_type")
    if model_type is not None and model_type not in _ARCHITECTURE_OF:
        raise CheckpointError(
            f"model_type {model_type!r} is not supported (only {sorted(_ARCHITECTURE_OF)})"
        )
    named = set(architectures or ())
    if model_type is not None:
        named.add(_ARCHITECTURE_OF[model_type])
    if len(named) > 1:
        raise CheckpointError(
            f"model_type {model_type!r} is not supported with architectures {architectures!r} "
            "(each class has its own model_type: "
            + ", ".join(f"{a} {MODEL_TYPES[a]!r}" for a in sorted(named))
            + ")"
        )
    quantization = data.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise CheckpointError(
            "quantized weights are not supported (quantization_config with quant_method "
            f"{'unknown' if method is None else repr(method)}); this worker runs dense weights"
        )
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} is not supported (only 'silu')")
    for name in ("attention_bias", "mlp_bias"):
        if data.get(name):
            raise CheckpointError(f"{name}=true is not supported")
    return next(iter(named), "LlamaForCausalLM")


def _read_window(data: dict[str, Any], architecture: str) -> tuple[int | None, tuple[str, ...]]:
    """``(sliding_window, layer_types)`` as ``architecture``'s transformers class reads them;
    ``(None, ())`` when no layer slides. A window setting that class would ignore is refused."""
    if data.get("use_sliding_window"):
        # Qwen2's form (with max_window_layers). Without use_sliding_window those
        # fields window nothing in Qwen2 either, so they are read as no window.
        raise CheckpointError(
            f"use_sliding_window (with max_window_layers {data.get('max_window_layers')!r}) is "
            f"Qwen2's form and is not supported for {architecture}: set sliding_window, "
            "and layer_types for MinistralForCausalLM"
        )
    layers = data["num_hidden_layers"]
    raw_types = data.get("layer_types")
    types: list[str] | None = None
    if raw_types is not None:
        if not isinstance(raw_types, list) or not all(isinstance(t, str) for t in raw_types):
            raise CheckpointError(f"layer_types must be a list of names, got {raw_types!r}")
        types = [_LEGACY_LAYER_TYPES.get(t, t) for t in raw_types]
        unknown = sorted({t for t in types if t not in LAYER_TYPES})
        if unknown:
            raise CheckpointError(
                f"layer_types {unknown} are not supported (only {list(LAYER_TYPES)})"
            )
        if len(types) != layers:
            raise CheckpointError(
                f"layer_types has {len(types)} entries for num_hidden_layers {layers}"
            )
    if architecture == "LlamaForCausalLM":
        window = data.get("sliding_window")
        if window is not None:
            raise CheckpointError(
                f"sliding_window {window!r} is not supported for LlamaForCausalLM "
                "(transformers' Llama ignores it; a windowed model is MistralForCausalLM "
                "or MinistralForCausalLM)"
            )
        if types and SLIDING_ATTENTION in types:
            raise CheckpointError(
                "layer_types with sliding_attention is not supported for LlamaForCausalLM "
                "(transformers' Llama ignores it; a hybrid model is MinistralForCausalLM)"
            )
        return None, ()
    window = data.get("sliding_window", _MISTRAL_DEFAULT_WINDOW)
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 1
    ):
        raise CheckpointError(f"sliding_window must be a positive int or null, got {window!r}")
    if architecture == "MistralForCausalLM":
        kind = FULL_ATTENTION if window is None else SLIDING_ATTENTION
        if types is not None and set(types) != {kind}:
            raise CheckpointError(
                f"layer_types {raw_types!r} is not supported for MistralForCausalLM "
                f"(transformers' Mistral ignores it and uses sliding_window {window!r} on "
                "every layer; a hybrid model is MinistralForCausalLM)"
            )
        types = [kind] * layers
    elif types is None:  # MinistralConfig's default
        types = [FULL_ATTENTION if window is None else SLIDING_ATTENTION] * layers
    elif window is None and SLIDING_ATTENTION in types:
        raise CheckpointError("layer_types has sliding_attention layers but sliding_window is null")
    if SLIDING_ATTENTION not in types:
        return None, ()
    return window, tuple(types)


def _check_full_rotary(value: object, name: str) -> None:
    if value is not None and value != 1.0:
        raise CheckpointError(
            f"{name} {value!r} is not supported (RoPE over the whole head_dim only)"
        )


def _read_rope(data: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from 4.x's top-level fields or 5.x's
    ``rope_parameters``; where a config has both, they must agree."""
    _check_full_rotary(data.get("partial_rotary_factor"), "partial_rotary_factor")
    top_theta = data.get("rope_theta")
    legacy = data.get("rope_scaling")
    legacy_scaling = RopeScaling.from_dict(legacy, "rope_scaling")
    params = data.get("rope_parameters")
    if params is None:
        return (_DEFAULT_ROPE_THETA if top_theta is None else top_theta), legacy_scaling
    if not isinstance(params, dict):
        raise CheckpointError(f"rope_parameters must be an object, got {params!r}")
    if any(isinstance(value, dict) for value in params.values()):
        raise CheckpointError(
            f"one rope_parameters per layer type ({', '.join(map(str, params))}) is not "
            "supported (Llama has one RoPE for every layer)"
        )
    _check_full_rotary(params.get("partial_rotary_factor"), "rope_parameters partial_rotary_factor")
    theta = params.get("rope_theta")
    if theta is None:
        # As transformers 5.x fills it: the top-level value, else Llama's default.
        theta = _DEFAULT_ROPE_THETA if top_theta is None else top_theta
    elif top_theta is not None and top_theta != theta:
        raise CheckpointError(
            f"rope_theta {top_theta!r} (top level, the 4.x form) disagrees with "
            f"rope_parameters' rope_theta {theta!r} (the 5.x form)"
        )
    scaling = RopeScaling.from_dict(params, "rope_parameters")
    if legacy is not None and legacy_scaling != scaling:
        raise CheckpointError(
            f"rope_scaling {legacy!r} (the 4.x form) disagrees with rope_parameters "
            f"{params!r} (the 5.x form)"
        )
    return theta, scaling


def _read_dtype(data: dict[str, Any]) -> str:
    found = {key: data[key] for key in ("torch_dtype", "dtype") if data.get(key) is not None}
    for key, value in found.items():
        if value not in DTYPES:
            raise CheckpointError(f"{key} {value!r} is not supported (only {', '.join(DTYPES)})")
    if len(set(found.values())) > 1:
        raise CheckpointError(
            f"torch_dtype {found['torch_dtype']!r} and dtype {found['dtype']!r} disagree"
        )
    return next(iter(found.values()), "float32")


def _token_ids(value: object, name: str) -> tuple[int, ...]:
    """``eos_token_id``: absent, one id, or a list of ids."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{name} must be an int or a list of ints, got {value!r}")
    return tuple(ids)


def _read_special_ids(
    data: dict[str, Any], generation: dict[str, Any]
) -> tuple[int | None, tuple[int, ...]]:
    """``(bos_token_id, eos_token_ids)``: config.json's, merged with generation_config.json's."""
    bos = data.get("bos_token_id")
    eos = _token_ids(data.get("eos_token_id"), "eos_token_id")
    if not generation:
        return bos, eos
    where = GENERATION_CONFIG_FILE
    extra_eos = _token_ids(generation.get("eos_token_id"), f"{where} eos_token_id")
    extra_bos = generation.get("bos_token_id")
    vocab = data["vocab_size"]
    for token_id in (*extra_eos, extra_bos):
        if token_id is not None and isinstance(vocab, int) and not _in_vocab(token_id, vocab):
            raise CheckpointError(
                f"{where}: special token id {token_id!r} is outside the vocabulary ({vocab})"
            )
    if extra_bos is not None:
        if bos is None:
            bos = extra_bos
        elif extra_bos != bos:
            raise CheckpointError(
                f"{where}: bos_token_id {extra_bos!r} disagrees with {CONFIG_FILE}'s {bos!r}"
            )
    return bos, tuple(dict.fromkeys((*eos, *extra_eos)))
