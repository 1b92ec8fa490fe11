"""memsvc self-check: allocate a pool, run a request's KV through it, offload and load.

``python -m memsvc.selfcheck`` (what ``make demo`` runs until the full stack
exists) prints each step and exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np

from memsvc.core import KVPool, PoolLayout
from memsvc.core.backends import BACKENDS
from memsvc.core.hicache import HiCacheConfig


def _say(step: str, detail: str) -> None:
    print(f"  {step:<22} {detail}")


def run(layout: PoolLayout, backend: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    page_size = layout.page_size
    with KVPool(layout, backend=backend, host_store_bytes=layout.kv_bytes) as pool:
        print(
            f"pool: {layout.num_pages} pages x {page_size} tokens, {layout.num_layers} layers, "
            f"{layout.num_kv_heads} kv heads x {layout.head_dim}, {layout.dtype} "
            f"({layout.kv_bytes / 2**20:.1f} MiB, backend {backend})"
        )
        prompt = rng.integers(0, 256, size=5 * page_size + 3)

        pool.open_request("a")
        slots = pool.alloc_extend([("a", prompt.size)])
        kv = rng.standard_normal((slots.size, *layout.kv_shape[1:3], *layout.kv_shape[4:]))
        pool.buffers.write_slots(slots, kv.astype(layout.storage_dtype))
        _say(
            "prefill a",
            f"{prompt.size} tokens -> {slots.size} slots, available {pool.available_size()}",
        )
        for _ in range(page_size):
            decode = pool.alloc_decode(["a"])
            pool.buffers.write_slots(
                decode,
                rng.standard_normal((1, *layout.kv_shape[1:3], *layout.kv_shape[4:])).astype(
                    layout.storage_dtype
                ),
            )
        tokens = np.concatenate([prompt, rng.integers(0, 256, size=page_size)])
        _say("decode a", f"{page_size} steps, kv_len {pool.request('a').kv_len}")

        cached = pool.cache_unfinished("a", tokens)
        _say("cache_unfinished a", f"{cached} tokens now shared in the radix tree")

        pool.open_request("b")
        hit = pool.match_prefix("b", tokens[:-1])
        _say("match_prefix b", f"prefix hit {hit} tokens (protected {pool.protected_size()})")
        pool.release("b", is_insert=False)

        before = pool.buffers.read_slots(pool.slots("a"))
        nbytes = pool.offload("a")
        pool.release("a", is_insert=False)
        _say(
            "offload a",
            f"{nbytes / 2**10:.0f} KiB to the host store, "
            f"evictable {pool.evictable_size()}, available {pool.available_size()}",
        )
        pool.evict(pool.capacity)
        pool.check_integrity()

        pool.open_request("a")
        start = time.perf_counter()
        new_slots = pool.load("a")
        elapsed = time.perf_counter() - start
        after = pool.buffers.read_slots(new_slots)
        if not np.array_equal(before.view(np.uint8), after.view(np.uint8)):
            raise SystemExit("FAIL: KV after offload + load differs from before")
        _say(
            "load a",
            f"{new_slots.size} tokens into new slots in {elapsed * 1e3:.2f} ms, bytes identical",
        )

        pool.release("a", tokens, is_insert=True)
        pool.check_integrity(idle=True)
        _say(
            "release a",
            f"inserted; idle: available {pool.available_size()} + evictable "
            f"{pool.evictable_size()} == capacity {pool.capacity}",
        )
    run_hicache(layout, backend, seed)
    print("selfcheck passed")


def run_hicache(layout: PoolLayout, backend: str, seed: int) -> None:
    """The hierarchical cache: a prefix evicted to host, then to disk, loaded back each time."""
    rng = np.random.default_rng(seed + 1)
    page_size = layout.page_size
    with tempfile.TemporaryDirectory(prefix="kvstack-selfcheck-") as store:
        config = HiCacheConfig(
            ratio=1.0, write_policy="write_back", storage_backend="file", storage_dir=store
        )
        with KVPool(layout, backend=backend, hicache=config) as pool:
            tree = pool.hicache
            print(
                f"hicache: host tier {tree.host.num_pages} pages, write_back, file storage "
                f"in {store}"
            )
            num_pages = min(layout.num_pages // 2, layout.max_context_len // page_size - 1)
            tokens = rng.integers(0, 256, size=num_pages * page_size + 1)
            pool.open_request("h")
            slots = pool.alloc_extend([("h", tokens.size)])
            kv = rng.standard_normal((slots.size, *layout.kv_shape[1:3], *layout.kv_shape[4:]))
            pool.buffers.write_slots(slots, kv.astype(layout.storage_dtype))
            before = pool.buffers.read_slots(slots[:-1])
            pool.release("h", tokens)
            for tier in ("host", "storage"):
                pool.evict(pool.evictable_size())
                if tier == "storage":
                    tree.evict_host(tree.host.num_pages)
                pool.settle_copies()  # time the load alone, not the write-backs before it
                pool.open_request(tier)
                start = time.perf_counter()
                match = pool.match_prefix_tiers(tier, tokens[:-1])
                pool.wait_loaded(tier)
                elapsed = time.perf_counter() - start
                after = pool.buffers.read_slots(pool.slots(tier))
                hit = match.host_tokens if tier == "host" else match.storage_tokens
                if hit != tokens.size - 1 or not np.array_equal(
                    before.view(np.uint8), after.view(np.uint8)
                ):
                    raise SystemExit(f"FAIL: the prefix loaded from the {tier} tier differs")
                nbytes = pool.buffers.layout.bytes_per_page * hit // page_size
                _say(
                    f"load from {tier}",
                    f"{hit} tokens, {nbytes / 2**20:.1f} MiB in {elapsed * 1e3:.2f} ms "
                    f"({nbytes / max(elapsed, 1e-9) / 1e9:.2f} GB/s), bytes identical",
                )
                pool.release(tier, is_insert=False)
            pool.settle_copies()
            pool.check_integrity(idle=True)
            _say("hicache idle", "every tier accounted, storage files == the tree's index")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="shm",
        help="where the KV buffers live (default: shm, POSIX shared memory)",
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    parser.add_argument("--num-pages", type=int, default=256, help="usable pages (default 256)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)
    layout = PoolLayout(
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_running_requests=8,
        max_context_len=2048,
    )
    run(layout, args.backend, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
