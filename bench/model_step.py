"""Prefill throughput and decode step time of the tiny model, in process, on this machine.

Drives :class:`LlamaModel` over a :class:`KVPool` the way a scheduler does
(``open_request`` + ``alloc_extend`` then ``extend``; ``alloc_decode`` then
``decode``), with the pool mapped through ``attach(handle)`` as the model
worker maps it. Only the forward pass is timed; the pool's bookkeeping runs
untimed between passes.

- prefill: one request of 512, 2048 and 8192 prompt tokens in one extend,
  fastest of ``--repeats`` runs after a warm-up (of two runs when one takes
  over 2 s, as the 8k one does on two CPU cores);
- decode: batches of 1, 16 and 64 requests, each first prefilled to
  ``--context-len`` tokens (untimed), then ``--decode-steps`` steps per repeat;
  the median step. The context grows by one token per step, so each batch's
  contexts run from ``context_len`` to ``context_len + decode_steps * (repeats + 1)``.

Prints one JSON object on its last line::

    {"prefill": {"512": {"tokens_per_s": .., "s_per_token": .., "seconds": ..}, ..},
     "decode": {"1": {"ms_per_step": .., "p90_ms": .., "ms_per_token": ..}, ..},
     "decode_context_len": .., "decode_context_len_max": .., "threads": .., ..}

``s_per_token`` (prefill seconds / prompt tokens) is what the retract cost
model charges for re-prefilling a retracted request's tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from memsvc.core import KVPool, PoolLayout, attach
from memsvc.core.backends.shm import install_sigterm_cleanup, list_segments, segment_owner_pid
from model_svc.__main__ import keep_freed_memory
from model_svc.model import ExtendItem, LlamaModel
from model_svc.tiny import BYTE_VOCAB, write_tiny_checkpoint

PREFILL_LENS = (512, 2048, 8192)
DECODE_BATCHES = (1, 16, 64)
PAGE_SIZE = 16
SLOW_S = 2.0  # a prefill this slow is timed twice, not repeats + 1 times


def best_seconds(fn: Callable[[], object], repeats: int, slow_s: float = SLOW_S) -> float:
    """Fastest of ``repeats`` runs after one warm-up: the least disturbed figure.

    A warm-up slower than ``slow_s`` (the 8k prefill) is itself a fair sample,
    since one-time costs are noise next to it; one more run is timed then, to
    keep the whole benchmark short.
    """
    start = time.perf_counter()
    fn()
    warmup = time.perf_counter() - start
    best = warmup if warmup > slow_s else float("inf")
    for _ in range(1 if warmup > slow_s else repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass
class Bench:
    """A pool the model is bound to, and a seeded source of prompt tokens."""

    pool: KVPool
    model: LlamaModel
    rng: np.random.Generator

    def prompt(self, num_tokens: int) -> np.ndarray:
        return self.rng.integers(0, BYTE_VOCAB, num_tokens, dtype=np.int64)

    def open(self, rids: list[str], prompt_len: int) -> None:
        """Open ``rids`` and reserve ``prompt_len`` positions each (not yet computed)."""
        for rid in rids:
            self.pool.open_request(rid)
        if self.pool.alloc_extend([(rid, prompt_len) for rid in rids]) is None:
            raise RuntimeError(f"pool too small for {len(rids)} x {prompt_len} tokens")

    def close(self, rids: list[str]) -> None:
        for rid in rids:
            self.pool.release(rid, is_insert=False)

    def extend(self, rid: str, token_ids: np.ndarray) -> torch.Tensor:
        """Compute the whole of ``rid``'s (already allocated) prompt in one pass."""
        return self.model.extend([ExtendItem(self.pool.request(rid).row, 0, token_ids)])


def measure_prefill(bench: Bench, num_tokens: int, repeats: int) -> dict[str, float]:
    rid = f"prefill-{num_tokens}"
    bench.open([rid], num_tokens)
    try:
        ids = bench.prompt(num_tokens)
        # Re-running the same extend writes the same slots: every run is a full prefill.
        seconds = best_seconds(lambda: bench.extend(rid, ids), repeats)
    finally:
        bench.close([rid])
    return {
        "seconds": round(seconds, 4),
        "tokens_per_s": round(num_tokens / seconds, 1),
        "s_per_token": float(f"{seconds / num_tokens:.4g}"),
    }


def measure_decode(
    bench: Bench, batch_size: int, context_len: int, steps: int, repeats: int
) -> dict[str, float]:
    rids = [f"decode{batch_size}-{i}" for i in range(batch_size)]
    bench.open(rids, context_len)
    try:
        for rid in rids:  # prefill the contexts, untimed
            bench.extend(rid, bench.prompt(context_len))
        rows = np.array([bench.pool.request(rid).row for rid in rids], dtype=np.int64)
        last_tokens = bench.prompt(batch_size)
        samples: list[float] = []
        for i in range(repeats + 1):  # the first round is the warm-up
            for _ in range(steps):
                if bench.pool.alloc_decode(rids) is None:
                    raise RuntimeError(f"pool too small to decode a batch of {batch_size}")
                seq_lens = np.array([bench.pool.request(rid).kv_len for rid in rids])
                start = time.perf_counter()
                logits = bench.model.decode(rows, seq_lens, last_tokens)
                elapsed = time.perf_counter() - start
                last_tokens = logits.argmax(-1).numpy()
                if i:
                    samples.append(elapsed)
    finally:
        bench.close(rids)
    ms = np.asarray(samples) * 1e3
    median = float(np.median(ms))
    return {
        "ms_per_step": round(median, 3),
        "p90_ms": round(float(np.percentile(ms, 90)), 3),
        "ms_per_token": round(median / batch_size, 4),
    }


@contextmanager
def bound_pool(
    model: LlamaModel, layout: PoolLayout, host_store_bytes: int = 0, backend: str = "shm"
) -> Iterator[KVPool]:
    """A pool mapped as the model worker maps it; unbound and unmapped before it closes.

    On ``cuda`` the model (on the GPU) uses the pool's device buffers directly
    through DLPack: CUDA IPC cannot map memory into the process that owns it.
    """
    with KVPool(
        layout, backend=backend, host_store_bytes=host_store_bytes, async_offload=backend == "cuda"
    ) as pool:
        attached = attach(pool.buffers.handle()) if backend == "shm" else None
        try:
            if attached is not None:
                model.bind(attached.kv_torch(), attached.req_to_token_torch(), layout.page_size)
            else:
                kv = torch.from_dlpack(pool.buffers.kv)
                if layout.dtype == "bfloat16":
                    kv = kv.view(torch.bfloat16)
                table = torch.from_dlpack(pool.buffers.req_to_token_device)
                model.bind(kv, table, layout.page_size)
            pool.buffers.kv[:] = 0  # touch every page so no first-touch faults get timed
            yield pool
            pool.check_integrity(idle=True)
        finally:
            model.unbind()
            if attached is not None:
                attached.close()


def max_decode_len(args: argparse.Namespace) -> int:
    """The longest context a decode batch reaches (warm-up round included)."""
    return args.context_len + args.decode_steps * (args.repeats + 1)


def pool_layout(model: LlamaModel, args: argparse.Namespace) -> PoolLayout:
    cfg = model.config
    decode_pages = max(DECODE_BATCHES) * -(-max_decode_len(args) // PAGE_SIZE)
    prefill_pages = -(-max(PREFILL_LENS) // PAGE_SIZE)
    return PoolLayout(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        page_size=PAGE_SIZE,
        num_pages=max(decode_pages, prefill_pages) + 16,
        dtype="float32",
        max_running_requests=max(DECODE_BATCHES) + 1,
        max_context_len=max(max(PREFILL_LENS), max_decode_len(args)) + PAGE_SIZE,
    )


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="model-step-bench-") as tmp:
        model = LlamaModel.from_checkpoint(write_tiny_checkpoint(tmp))
    layout = pool_layout(model, args)
    with bound_pool(model, layout) as pool:
        bench = Bench(pool, model, np.random.default_rng(args.seed))
        prefill = {str(n): measure_prefill(bench, n, args.repeats) for n in PREFILL_LENS}
        decode = {
            str(b): measure_decode(bench, b, args.context_len, args.decode_steps, args.repeats)
            for b in DECODE_BATCHES
        }
    cfg = model.config
    return {
        "model": {
            "layers": cfg.num_hidden_layers,
            "hidden": cfg.hidden_size,
            "kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_position_embeddings,  # the 8k prefill is past it
            "dtype": "float32",
            "page_size": PAGE_SIZE,
        },
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "prefill": prefill,
        "decode": decode,
        "decode_context_len": args.context_len,
        "decode_context_len_max": max_decode_len(args),
        "decode_steps_timed": args.decode_steps * args.repeats,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure")
    parser.add_argument("--context-len", type=int, default=256, help="decode: tokens per request")
    parser.add_argument("--decode-steps", type=int, default=16, help="decode steps per repeat")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as model_svc does at start
    install_sigterm_cleanup()  # a SIGTERM still unlinks the pool's shm segments
    started = time.monotonic()
    result = run(args)
    print(f"took {time.monotonic() - started:.1f}s", file=sys.stderr)
    print(json.dumps(result))
    left = [name for name in list_segments() if segment_owner_pid(name) == os.getpid()]
    if left:
        sys.exit(f"shm segments left behind: {left}")


if __name__ == "__main__":
    main()
