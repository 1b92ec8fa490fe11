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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

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

    # -- derived sizes ---------------------------------------------------------

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def storage_dtype(self) -> np.dtype:
        return DTYPES[self.dtype][0]

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

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
            self.num_layers,
            2,
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def kv_bytes(self) -> int:
        return (self.num_pages + 1) * self.bytes_per_page

    @property
    def req_to_token_shape(self) -> tuple[int, int]:
        return (self.max_running_requests + 1, self.max_context_len)

    @property
    def req_to_token_bytes(self) -> int:
        return (self.max_running_requests + 1) * self.max_context_len * 4

    # -- wire form -------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolLayout:
        return cls(**data)
