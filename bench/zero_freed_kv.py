"""What ``--zero-freed-kv`` costs (issue 30, item 3): the same churn of requests on one
in-process pool with the flag off and on.

Each request opens in a namespace (``--salted`` of them salted), matches its prompt
(prompts share a system prefix per namespace, so the tree fills and evicts), writes
its prompt's KV as a forward pass would, decodes ``--decode`` tokens (one KV write
each) and is released into the tree. Allocation evicts the tree's LRU leaves, so
salted pages come back to other requests and are zeroed then. The pool is
SmolLM2-135M's geometry by default (30 layers, 3 KV heads, head dim 64, fp16,
page 16): a page is 360 KiB, as on a real stack. ``--backend cuda`` runs on the
GPU (the zeroing is a ``cudaMemsetAsync`` there; the KV writes are host -> device).

Prints one JSON object on its last line: seconds per run (best of ``--repeat``),
``ratio`` = on / off, the pages and bytes zeroed, the time spent in the zeroing
calls themselves (``zeroing_share`` of the run with the flag: steadier than the
ratio on a busy machine) and their rate.
Run with the repository on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from memsvc.core import KVPool
from memsvc.core.layout import PoolLayout


def churn(args: argparse.Namespace, zero: bool) -> tuple[float, int, float]:
    """One run: (seconds, pages zeroed, seconds spent zeroing)."""
    layout = PoolLayout(
        num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        page_size=args.page_size, num_pages=args.pages, dtype="float16",
        max_running_requests=8, max_context_len=4096,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    namespaces = [f"{i:032x}" if i else "" for i in range(args.namespaces)]
    systems = {ns: rng.integers(1, 30000, args.system_len) for ns in namespaces}
    shape = layout.kv_shape
    token_kv = np.ones((1, shape[1], shape[2], shape[4], shape[5]), np.float16)
    with KVPool(layout, backend=args.backend, zero_freed_kv=zero) as pool:
        spent = 0.0
        if pool.scrub is not None:  # time the zeroing itself
            for scrubber in (pool.scrub.full,):
                inner = scrubber.zero

                def timed(pages, inner=inner):
                    nonlocal spent
                    t = time.perf_counter()
                    inner(pages)
                    spent += time.perf_counter() - t

                scrubber.zero = timed
        started = time.perf_counter()
        for i in range(args.requests):
            salted = rng.random() < args.salted
            ns = namespaces[1 + i % (len(namespaces) - 1)] if salted else ""
            prompt = np.concatenate([systems[ns], rng.integers(1, 30000, args.user_len)])
            rid = f"r{i}"
            pool.open_request(rid, ns)
            matched = pool.match_prefix(rid, prompt[:-1])
            slots = pool.alloc_extend([(rid, len(prompt) - matched)])
            assert slots is not None, "pool too small for one request"
            kv = np.broadcast_to(token_kv, (len(slots), *token_kv.shape[1:]))
            pool.buffers.write_slots(slots, kv)
            for _ in range(args.decode):
                slot = pool.alloc_decode([rid])
                pool.buffers.write_slots(slot, token_kv)
            out = rng.integers(1, 30000, args.decode)
            pool.release(rid, np.concatenate([prompt, out])[: len(prompt) + args.decode - 1])
        seconds = time.perf_counter() - started
        zeroed = pool.scrub.num_zeroed_pages if pool.scrub else 0
        pool.evict(pool.evictable_size())
        pool.check_integrity(idle=True)
    return seconds, zeroed, spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="shm", choices=("shm", "cuda"))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--pages", type=int, default=256, help="device pool pages")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--user-len", type=int, default=256)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--namespaces", type=int, default=5, help="the default one + salted")
    parser.add_argument("--salted", type=float, default=0.5, help="fraction of salted requests")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    runs = {False: [], True: []}
    churn(args, False)  # warm-up: first touches of fresh memory, imports
    for _ in range(args.repeat):
        for zero in (False, True):  # interleaved: drift hits both alike
            runs[zero].append(churn(args, zero))
    off = min(r[0] for r in runs[False])
    on_run = min(runs[True], key=lambda r: r[0])
    page_bytes = args.layers * 2 * args.page_size * args.kv_heads * args.head_dim * 2  # fp16
    zeroed = on_run[1]
    print(
        json.dumps(
            {
                "backend": args.backend,
                "requests": args.requests,
                "salted_fraction": args.salted,
                "page_bytes": page_bytes,
                "seconds_off": round(off, 4),
                "seconds_on": round(on_run[0], 4),
                "ratio": round(on_run[0] / off, 4),
                "zeroed_pages": zeroed,
                "zeroed_bytes": zeroed * page_bytes,
                "zeroing_seconds": round(on_run[2], 4),
                # the zeroing's own share of the run with the flag (timed around each
                # zeroing call): a figure the shared machine's noise does not blur
                "zeroing_share": round(on_run[2] / on_run[0], 4),
                "zeroing_gb_per_s": round(zeroed * page_bytes / on_run[2] / 1e9, 2)
                if on_run[2]
                else None,
            }
        )
    )


if __name__ == "__main__":
    main()
