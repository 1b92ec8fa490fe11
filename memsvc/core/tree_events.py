"""KV cache events: the tree tells an observer which pages each tier gains and loses.

SGLang publishes its radix tree's changes so that a KV-aware router can track
every node's cache (``--kv-events-config``; :mod:`memsvc.kv_events` is the
publisher). The trees (:class:`~memsvc.core.radix_cache.RadixCache` and the
hierarchical :class:`~memsvc.core.hicache_tree.TieredTree`) call their
``events`` observer at each change; :class:`NullTreeEvents` ignores them, and
:class:`TreeEventRecorder` turns them into SGLang 0.5.23's events, queued until
the service takes them (once per loop iteration). Pure core: no I/O.

The events, as SGLang 0.5.23 makes them (``mem_cache/events.py``):

- ``BlockStored``: a node's pages are now in a tier: one block per page,
  ``block_hashes`` in order, ``parent_block_hash`` the block before the first
  (None under the root), ``token_ids`` every token of the blocks,
  ``block_size`` the page size, ``lora_id`` None, ``medium`` the tier
  (``"GPU"``, ``"CPU_PINNED"``; the storage tier, which 0.5.23 never reports,
  is ``"DISK"``, or ``"EXTERNAL"`` for a tier shared between nodes).
- ``BlockRemoved``: those blocks left that tier.
- ``AllBlocksCleared``: everything left every tier.

Consecutive events of one kind and medium are merged as SGLang merges them (a
store continuing the previous store's chain, removals of the same medium).

Block hashes, as SGLang's: each page's SHA-256 over the previous page's digest
(none for the first page under the root) and the page's token ids as
little-endian uint32 (a page with a token past uint32: a ``0xff`` byte, then
uint64s); the event carries the digest's first 8 bytes as a big-endian signed
int64. A router hashing a prompt in pages of ``block_size`` finds the same
numbers. The default namespace's blocks hash exactly so. A non-default cache
namespace (a ``cache_salt`` / ``extra_key``) seeds its chain from its digest
instead: memsvc never sees the salt, so it cannot make SGLang's salted hashes,
and its blocks never collide with unsalted ones (a router matches them to no
unsalted prompt). The digests are kept on the node (``event_hashes``) once made,
and split with it.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from memsvc.core.radix_cache import TreeNode

# The tiers a tree reports (its own words), and SGLang's StorageMedium for each.
DEVICE, HOST, STORAGE = "device", "host", "storage"
MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_EXTERNAL = "GPU", "CPU_PINNED", "DISK", "EXTERNAL"

_UINT32_MAX = 0xFFFFFFFF
_NAMESPACE_SEED_TAG = b"kvstack-kv-event-namespace-v1\0"


class NullTreeEvents:
    """The observer a tree has when nobody listens: every call does nothing."""

    enabled = False

    def stored(self, node: TreeNode, tier: str) -> None:
        """``node``'s pages are now in ``tier`` (all of them)."""

    def removed(self, node: TreeNode, tier: str) -> None:
        """``node``'s pages left ``tier`` (the node is still linked to its parent)."""

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        """A node was cut in two: ``upper`` (new) above ``lower`` (the old node)."""

    def cleared(self) -> None:
        """Nothing is left in any tier."""


NULL_TREE_EVENTS = NullTreeEvents()


def page_digests(prev: bytes | None, key: np.ndarray, page_size: int) -> list[bytes]:
    """SGLang's page hash chain over ``key`` (whole pages) from ``prev``."""
    if key.size and int(key.max()) > _UINT32_MAX:
        return _wide_page_digests(prev, key, page_size)
    data = key.astype("<u4").tobytes()  # one conversion, then plain byte slices
    step = page_size * 4
    sha256 = hashlib.sha256
    out = []
    for start in range(0, len(data), step):
        page = data[start : start + step]
        prev = sha256(prev + page if prev is not None else page).digest()
        out.append(prev)
    return out


def _wide_page_digests(prev: bytes | None, key: np.ndarray, page_size: int) -> list[bytes]:
    """:func:`page_digests` of a key with a token past uint32: such a page is a ``0xff``
    byte and uint64s (SGLang's wide form), the others as usual."""
    out = []
    for start in range(0, len(key), page_size):
        page = key[start : start + page_size]
        if int(page.max()) > _UINT32_MAX:
            data = b"\xff" + page.astype("<u8").tobytes()
        else:
            data = page.astype("<u4").tobytes()
        prev = hashlib.sha256(prev + data if prev is not None else data).digest()
        out.append(prev)
    return out


def block_hash(digest: bytes) -> int:
    """The event's block hash: the digest's first 8 bytes, big-endian signed."""
    return int.from_bytes(digest[:8], "big", signed=True)


def block_hashes(digests: list[bytes]) -> list[int]:
    """:func:`block_hash` of each digest (in one numpy pass)."""
    return np.frombuffer(b"".join(d[:8] for d in digests), dtype=">i8").tolist()


def namespace_seed(namespace: str) -> bytes | None:
    """The chain's seed for a cache namespace (None: the default one, as SGLang)."""
    if not namespace:
        return None
    return hashlib.sha256(_NAMESPACE_SEED_TAG + namespace.encode()).digest()


class TreeEventRecorder(NullTreeEvents):
    """Queues SGLang's KV events for one tree (the module docstring says which)."""

    enabled = True

    def __init__(self, root: TreeNode, page_size: int, *, storage_medium: str = MEDIUM_DISK):
        self.root = root
        self.page_size = page_size
        self.mediums = {DEVICE: MEDIUM_GPU, HOST: MEDIUM_CPU, STORAGE: storage_medium}
        self._queue: list[dict[str, Any]] = []

    # -- the observer ------------------------------------------------------------------

    def stored(self, node: TreeNode, tier: str) -> None:
        digests = self._digests(node)
        if not digests:
            return
        parent = node.parent
        parent_hash = None
        if parent is not None and parent is not self.root:
            parent_hash = block_hash(self._digests(parent)[-1])
        hashes = block_hashes(digests)
        medium = self.mediums[tier]
        tail = self._queue[-1] if self._queue else None
        if (
            tail is not None
            and tail["type"] == "BlockStored"
            and tail["medium"] == medium
            and tail["block_hashes"][-1] == parent_hash
        ):
            tail["block_hashes"].extend(hashes)
            tail["token_ids"].extend(node.key.tolist())
            return
        self._queue.append(
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent_hash,
                "token_ids": node.key.tolist(),
                "block_size": self.page_size,
                "lora_id": None,
                "medium": medium,
            }
        )

    def removed(self, node: TreeNode, tier: str) -> None:
        digests = self._digests(node)
        if not digests:
            return
        hashes = block_hashes(digests)
        medium = self.mediums[tier]
        tail = self._queue[-1] if self._queue else None
        if tail is not None and tail["type"] == "BlockRemoved" and tail["medium"] == medium:
            tail["block_hashes"].extend(hashes)
            return
        self._queue.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": medium})

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        digests = lower.event_hashes
        if digests is not None:
            num_pages = len(upper.key) // self.page_size
            upper.event_hashes, lower.event_hashes = digests[:num_pages], digests[num_pages:]

    def cleared(self) -> None:
        # What came before no longer matters to a consumer that applies this.
        self._queue = [{"type": "AllBlocksCleared"}]

    # -- the service's side --------------------------------------------------------------

    def take(self) -> list[dict[str, Any]]:
        """The events queued so far, oldest first; the queue is left empty."""
        events, self._queue = self._queue, []
        return events

    # -- internals -------------------------------------------------------------------------

    def _digests(self, node: TreeNode) -> list[bytes]:
        """``node``'s page digests, made (with those of the ancestors lacking them) once."""
        chain = []
        at = node
        while at is not self.root and at is not None and at.event_hashes is None:
            chain.append(at)
            at = at.parent
        if at is None:  # detached without digests: nothing to name its pages by
            return []
        prev = namespace_seed(node.namespace) if at is self.root else at.event_hashes[-1]
        for n in reversed(chain):
            n.event_hashes = page_digests(prev, n.key, self.page_size)
            if n.event_hashes:
                prev = n.event_hashes[-1]
        return node.event_hashes or []
