"""What a stored KV page is the KV *of*: the model, the dtype, the layout, the page size.

A storage-tier page is named by a hash chain over its prefix's token ids
(:func:`memsvc.core.hicache_tiers.page_hash_chain`). Token ids alone do not say
whose KV a page holds: the same prompt gives other bytes under another
checkpoint, dtype, head count or page size, and another tenant's KV must never
be served (SGLang's storage keys are token-only, sgl-project/sglang#37160).
So every chain starts from a *seed* that names all of it::

    seed(ns)  = blake2b-128("kvstack-kv-identity/1", model_digest, dtype, layout,
                            page_size, ns)
    key[0]    = blake2b-128(seed(ns), tokens[0:ps])
    key[i]    = blake2b-128(key[i-1], tokens[i*ps:(i+1)*ps])

and a page's record is sealed with a checksum over its key and its bytes
(:mod:`memsvc.core.storage.base`). A kept page (``--hicache-storage-keep``) is
found only through a chain from the same seed: a page of another model,
dtype, layout, page size or namespace is never even looked up.

``layout`` spells everything that gives a page's bytes their meaning besides
the dtype and page size: layers and which are sliding, KV heads, head
dimension, the sliding window, and the page's byte order (:data:`PAGE_ORDER`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from memsvc.core.errors import InvalidArgumentError
from memsvc.core.layout import PoolLayout
from memsvc.namespace import is_namespace

# The byte order of a page (memsvc.core.layout): change it when the page format changes.
PAGE_ORDER = "page[layer,kv,offset,head,dim]"
_VERSION = b"kvstack-kv-identity/1"
MODEL_DIGEST_PATTERN = r"^[0-9a-f]{64}$"  # a sha256, hex
_DIGEST_RE = re.compile(MODEL_DIGEST_PATTERN)


def is_model_digest(value: object) -> bool:
    return isinstance(value, str) and _DIGEST_RE.match(value) is not None


def layout_string(layout: PoolLayout) -> str:
    """The parts of ``layout`` a stored page's bytes depend on (not the pool's size)."""
    types = ",".join("s" if t == "sliding_attention" else "f" for t in layout.layer_types)
    return (
        f"{PAGE_ORDER};layers={layout.num_layers};kv_heads={layout.num_kv_heads};"
        f"head_dim={layout.head_dim};layer_types={types or 'all-full'};"
        f"sliding_window={layout.sliding_window}"
    )


@dataclass(frozen=True)
class KVIdentity:
    """Whose KV a page holds; :meth:`storage_seed` starts each namespace's hash chain.

    ``model_digest`` None: no checkpoint was named (``--model-digest`` unset); the
    seed still holds the dtype, layout and page size, and a kept storage tier is
    refused (:meth:`require_model`).
    """

    model_digest: str | None
    dtype: str
    layout: str
    page_size: int

    def __post_init__(self) -> None:
        if self.model_digest is not None and not is_model_digest(self.model_digest):
            raise InvalidArgumentError(
                f"model digest {self.model_digest!r} is not a sha256 (64 lowercase hex digits)"
            )
        if self.page_size < 1:
            raise InvalidArgumentError(f"page size {self.page_size} must be >= 1")

    @classmethod
    def of(cls, layout: PoolLayout, model_digest: str | None) -> KVIdentity:
        return cls(model_digest, layout.dtype, layout_string(layout), layout.page_size)

    def storage_seed(self, namespace: str) -> str:
        """The hash-chain seed of ``namespace``'s pages (32 hex digits)."""
        if not is_namespace(namespace):
            raise InvalidArgumentError(f"bad cache namespace {namespace!r}")
        digest = hashlib.blake2b(digest_size=16)
        for part in (_VERSION, self.model_digest or "", self.dtype, self.layout,
                     str(self.page_size), namespace):  # fmt: skip
            encoded = part if isinstance(part, bytes) else part.encode()
            digest.update(b"%d:" % len(encoded))  # unambiguous boundaries
            digest.update(encoded)
        return digest.hexdigest()

    def require_model(self, what: str) -> None:
        """Refuse ``what`` (a kept storage tier) without a model digest."""
        if self.model_digest is None:
            raise InvalidArgumentError(
                f"{what} needs --model-digest (the sha256 of the checkpoint's config and "
                "weights; kvstack serve / up pass it): without it a kept page could be "
                "another model's KV"
            )
