"""Geometry of the KV pool.

Buffer layout (one buffer holds both K and V)::

    kv[page, layer, kv, offset, head, dim]      kv: 0 = K, 1 = V
       |                                 |
       +------ one page: contiguous -----+
                                    page_bytes = layers * 2 * page_size * heads * dim * itemsize

Page-major on purpose: everything a request owns on one page (every layer,
K and V) is one contiguous run of ``page_bytes``, so offloading or loading a
whole request is one large copy per page (about 2 MiB at 32 layers, 8 KV
heads, head dim 128, fp16, page size 16), not one small copy per token per
layer. The model reads a layer as the strided view ``kv[:, layer, 0]`` of shape
``[num_pages + 1, page_size, heads, dim]``, indexed by ``(slot // page_size,
slot % page_size)``. Page 0 is the reserved padding page.

Hybrid models (some layers attend to a sliding window of the last
``sliding_window`` tokens, ``layer_types``) get two pools, as SGLang's SWA
memory pool does: ``kv`` holds only the full-attention layers and a second
buffer, ``swa_kv``, the sliding-window layers, both page-major with the same
page size and a padding page 0::

    kv     [num_pages + 1,     n_full_layers, 2, page_size, heads, dim]
    swa_kv [swa_num_pages + 1, n_swa_layers,  2, page_size, heads, dim]
    full_to_swa_page [num_pages + 1]  int32: full page -> its SWA page, 0 = none

A request's ``req_to_token`` row holds full-pool slots; an SWA layer reads
position ``p`` at ``full_to_swa_page[slot // ps] * ps + slot % ps``. A layout
without sliding layers has neither ``swa_kv`` nor the table, exactly as before.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import numpy as np

from memsvc.core.errors import InvalidArgumentError

# dtype name -> (numpy storage dtype, bytes per element). numpy has no bfloat16:
# it is stored as uint16 and viewed as torch.bfloat16 by torch users.
DTYPES: dict[str, tuple[np.dtype, int]] = {
    "float16": (np.dtype(np.float16), 2),
    "bfloat16": (np.dtype(np.uint16), 2),
    "float32": (np.dtype(np.float32), 4),
    "float64": (np.dtype(np.float64), 8),  # for exactness checks against a reference
}

# SGLang's --swa-full-tokens-ratio default: SWA-layer tokens per full-layer token
DEFAULT_SWA_FULL_TOKENS_RATIO = 0.8

# transformers' names for a layer's attention kind (config.layer_types)
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclass(frozen=True)
class PoolLayout:
    """Shape of the KV pool and of the ``req_to_token`` table."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int  # usable pages; the buffer has one more (page 0, reserved)
    dtype: str = "float16"
    max_running_requests: int = 256
    max_context_len: int = 4096
    # () = every layer full attention; else one of LAYER_TYPES per layer
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0  # W, tokens; > 0 iff a layer is sliding
    swa_num_pages: int = 0  # usable pages of the SWA pool; >= 1 iff a layer is sliding

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "num_kv_heads",
            "head_dim",
            "page_size",
            "num_pages",
            "max_running_requests",
            "max_context_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(
                    f"PoolLayout.{name} must be a positive int, got {value!r}"
                )
        if self.dtype not in DTYPES:
            raise InvalidArgumentError(f"PoolLayout.dtype must be one of {sorted(DTYPES)}")
        self._check_hybrid()

    def _check_hybrid(self) -> None:
        if isinstance(self.layer_types, str) or not isinstance(self.layer_types, (tuple, list)):
            raise InvalidArgumentError(
                f"PoolLayout.layer_types must be a sequence of layer types, "
                f"got {self.layer_types!r}"
            )
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # the wire gives lists
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise InvalidArgumentError(
                f"PoolLayout.layer_types has {len(self.layer_types)} entries for "
                f"{self.num_layers} layers"
            )
        unknown = sorted({t for t in self.layer_types if t not in LAYER_TYPES}, key=str)
        if unknown:
            raise InvalidArgumentError(
                f"PoolLayout.layer_types: unknown layer type(s) {unknown}; "
                f"each must be one of {LAYER_TYPES}"
            )
        for name in ("sliding_window", "swa_num_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(
                    f"PoolLayout.{name} must be a non-negative int, got {value!r}"
                )
        if self.is_hybrid:
            if self.sliding_window < 1 or self.swa_num_pages < 1:
                raise InvalidArgumentError(
                    "PoolLayout: sliding layers need sliding_window >= 1 and swa_num_pages >= 1, "
                    f"got {self.sliding_window} and {self.swa_num_pages}"
                )
        elif self.sliding_window or self.swa_num_pages:
            raise InvalidArgumentError(
                "PoolLayout: sliding_window and swa_num_pages must be 0 without a "
                f"sliding_attention layer, got {self.sliding_window} and {self.swa_num_pages}"
            )

    # -- layers ------------------------------------------------------------------

    @property
    def is_hybrid(self) -> bool:
        """Some layer attends to a sliding window (a pure-SWA model counts too)."""
        return SLIDING_ATTENTION in self.layer_types

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        """Model layer indices of the full-attention layers, in order (the ``kv`` buffer's)."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def swa_layer_ids(self) -> tuple[int, ...]:
        """Model layer indices of the sliding-window layers, in order (``swa_kv``'s)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING_ATTENTION)

    @property
    def num_full_layers(self) -> int:
        return len(self.full_layer_ids)

    @property
    def num_swa_layers(self) -> int:
        return len(self.swa_layer_ids)

    def layer_slot(self, layer: int) -> tuple[Literal["full", "swa"], int]:
        """Which buffer holds model layer ``layer`` and its index there."""
        if not 0 <= layer < self.num_layers:
            raise InvalidArgumentError(f"layer {layer} outside 0..{self.num_layers - 1}")
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return "swa", self.swa_layer_ids.index(layer)
        return "full", self.full_layer_ids.index(layer)

    # -- derived sizes ---------------------------------------------------------

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def storage_dtype(self) -> np.dtype:
        return DTYPES[self.dtype][0]

    @property
    def bytes_per_layer_token(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across the ``kv`` buffer's layers (every layer unless hybrid;
        the full-attention layers if hybrid)."""
        return self.num_full_layers * self.bytes_per_layer_token

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def capacity_tokens(self) -> int:
        """Usable token slots (page 0 excluded)."""
        return self.num_pages * self.page_size

    @property
    def kv_shape(self) -> tuple[int, ...]:
        return (
            self.num_pages + 1,
            self.num_full_layers,
            2,
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def kv_bytes(self) -> int:
        return (self.num_pages + 1) * self.bytes_per_page

    # -- the SWA pool (hybrid layouts only) ---------------------------------------

    @property
    def swa_capacity_tokens(self) -> int:
        """Usable token slots of the SWA pool (page 0 excluded); 0 unless hybrid."""
        return self.swa_num_pages * self.page_size

    @property
    def swa_bytes_per_token(self) -> int:
        """K and V of one token across the sliding-window layers."""
        return self.num_swa_layers * self.bytes_per_layer_token

    @property
    def swa_bytes_per_page(self) -> int:
        return self.swa_bytes_per_token * self.page_size

    @property
    def swa_kv_shape(self) -> tuple[int, ...]:
        return (
            self.swa_num_pages + 1,
            self.num_swa_layers,
            2,
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def swa_kv_bytes(self) -> int:
        return (self.swa_num_pages + 1) * self.swa_bytes_per_page if self.is_hybrid else 0

    @property
    def full_to_swa_page_shape(self) -> tuple[int]:
        return (self.num_pages + 1,)

    @property
    def full_to_swa_page_bytes(self) -> int:
        return (self.num_pages + 1) * 4 if self.is_hybrid else 0

    @property
    def req_to_token_shape(self) -> tuple[int, int]:
        return (self.max_running_requests + 1, self.max_context_len)

    @property
    def req_to_token_bytes(self) -> int:
        return (self.max_running_requests + 1) * self.max_context_len * 4

    # -- wire form -------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layer_types"] = list(self.layer_types)  # msgpack / JSON have no tuples
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolLayout:
        return cls(**data)


def split_hybrid_pages(
    num_pages: int,
    page_size: int,
    num_full_layers: int,
    num_swa_layers: int,
    swa_full_tokens_ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO,
) -> tuple[int, int]:
    """``(full pages, SWA pages)`` in the bytes of ``num_pages`` pages of every layer.

    SGLang's sizing of a hybrid pool (``--swa-full-tokens-ratio`` r): with ``T``
    tokens of every layer, find full tokens ``F`` and SWA tokens ``S`` with::

        F * num_full_layers + S * num_swa_layers = T * num_layers   (the same bytes)
        S = r * F

    so ``F = int(T * num_layers / (r * num_swa_layers + num_full_layers))`` and
    ``S = int(F * r)``, each then rounded down to whole pages.
    """
    num_layers = num_full_layers + num_swa_layers
    if num_swa_layers < 1:
        raise InvalidArgumentError("split_hybrid_pages needs a sliding-window layer")
    if not swa_full_tokens_ratio > 0:
        raise InvalidArgumentError(
            f"--swa-full-tokens-ratio must be > 0, got {swa_full_tokens_ratio}"
        )
    total_tokens = num_pages * page_size * num_layers
    denominator = swa_full_tokens_ratio * num_swa_layers + num_full_layers
    full_tokens = int(total_tokens / denominator)
    swa_tokens = int(full_tokens * swa_full_tokens_ratio)
    full_pages, swa_pages = full_tokens // page_size, swa_tokens // page_size
    if full_pages < 1 or swa_pages < 1:
        raise InvalidArgumentError(
            f"{num_pages} pages split at --swa-full-tokens-ratio {swa_full_tokens_ratio} leave "
            f"{full_pages} full and {swa_pages} SWA pages: need at least one of each"
        )
    return full_pages, swa_pages


def hybrid_layout(
    layout: PoolLayout,
    layer_types: tuple[str, ...] | list[str],
    sliding_window: int,
    swa_full_tokens_ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO,
) -> PoolLayout:
    """``layout`` (every layer full, ``num_pages`` of them: the byte budget) as a hybrid
    model's two pools in the same bytes (:func:`split_hybrid_pages`). Layer types with no
    sliding layer give ``layout`` back unchanged."""
    if layout.is_hybrid:
        raise InvalidArgumentError("hybrid_layout needs a layout sized as every layer full")
    if SLIDING_ATTENTION not in layer_types:
        if sliding_window:
            raise InvalidArgumentError(
                f"sliding_window {sliding_window} given, but no layer is sliding_attention"
            )
        return replace(layout, layer_types=tuple(layer_types))
    swa_layers = sum(1 for t in layer_types if t == SLIDING_ATTENTION)
    full_pages, swa_pages = split_hybrid_pages(
        layout.num_pages,
        layout.page_size,
        len(layer_types) - swa_layers,
        swa_layers,
        swa_full_tokens_ratio,
    )
    return replace(
        layout,
        layer_types=tuple(layer_types),
        sliding_window=sliding_window,
        num_pages=full_pages,
        swa_num_pages=swa_pages,
    )
