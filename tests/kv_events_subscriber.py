"""A KV-aware router's view of one node, rebuilt from SGLang's KV events, and the truth.

:class:`BlockIndex` applies decoded ``KVEventBatch`` payloads as a router does
(stored minus removed, per medium; cleared). :func:`expected_blocks` reads the
same thing off memsvc's tree, hashing each node's pages the way SGLang 0.5.23
does (``mem_cache/utils.py`` + ``cpp_utils/hash_binding.cpp``), written here
from the spec and independent of :mod:`memsvc.core.tree_events`.
"""

from __future__ import annotations

import hashlib
import struct
from collections import defaultdict

import msgpack

GPU, CPU = "GPU", "CPU_PINNED"


def sglang_page_hashes(tokens: list[int], page_size: int, seed: bytes | None = None) -> list[int]:
    """SGLang's block hashes of ``tokens``' whole pages, chained from ``seed``."""
    out, prev = [], seed
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        page = tokens[start : start + page_size]
        prev = hashlib.sha256((prev or b"") + struct.pack(f"<{len(page)}I", *page)).digest()
        out.append(int.from_bytes(prev[:8], "big", signed=True))
    return out


def namespace_seed(namespace: str) -> bytes | None:
    """kvstack's seed for a non-default cache namespace (docs/kv-events.md)."""
    if not namespace:
        return None
    return hashlib.sha256(b"kvstack-kv-event-namespace-v1\0" + namespace.encode()).digest()


def path_tokens(tree, node) -> list[int]:
    keys = []
    while node is not tree.root:
        keys.append(node.key.tolist())
        node = node.parent
    return [t for key in reversed(keys) for t in key]


def expected_blocks(tree, storage_medium: str = "DISK") -> dict[str, dict[int, list[int]]]:
    """Per medium, block hash -> its tokens, of every page each tier of ``tree`` holds."""
    ps = tree.page_size
    out: dict[str, dict[int, list[int]]] = defaultdict(dict)
    for node in tree.iter_nodes():
        tokens = path_tokens(tree, node)
        hashes = sglang_page_hashes(tokens, ps, namespace_seed(node.namespace))
        first = (len(tokens) - len(node.key)) // ps
        mediums = []
        if node.value.size:
            mediums.append(GPU)
        if getattr(node, "host_pages", None) is not None:
            mediums.append(CPU)
        if getattr(node, "on_disk", False):
            mediums.append(storage_medium)
        for medium in mediums:
            for i, h in enumerate(hashes[first:]):
                page = first + i
                out[medium][h] = tokens[page * ps : (page + 1) * ps]
    return {m: blocks for m, blocks in out.items() if blocks}


class BlockIndex:
    """What a router knows of one node: per medium, the blocks stored and not removed."""

    def __init__(self) -> None:
        self.blocks: dict[str, dict[int, list[int]]] = defaultdict(dict)
        self.parents: dict[int, int | None] = {}
        self.num_batches = 0
        self.num_cleared = 0

    def apply_payload(self, payload: bytes) -> None:
        ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and dp_rank == 0
        self.num_batches += 1
        for event in events:
            self.apply(event)

    def apply(self, event: dict) -> None:
        kind = event["type"]
        if kind == "AllBlocksCleared":
            assert set(event) == {"type"}
            self.blocks.clear()
            self.num_cleared += 1
            return
        medium = event["medium"]
        hashes = event["block_hashes"]
        held = self.blocks[medium]
        if kind == "BlockRemoved":
            assert set(event) == {"type", "block_hashes", "medium"}
            for h in hashes:
                assert h in held, f"{medium} block {h} removed but never stored"
                del held[h]
            return
        assert kind == "BlockStored", kind
        assert set(event) == {
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
        }, event.keys()
        size = event["block_size"]
        assert event["lora_id"] is None
        assert len(event["token_ids"]) == size * len(hashes)
        parent = event["parent_block_hash"]
        for i, h in enumerate(hashes):
            assert h not in held, f"{medium} block {h} stored twice"
            held[h] = event["token_ids"][i * size : (i + 1) * size]
            self.parents[h] = parent
            parent = h

    def view(self) -> dict[str, dict[int, list[int]]]:
        return {m: dict(blocks) for m, blocks in self.blocks.items() if blocks}
