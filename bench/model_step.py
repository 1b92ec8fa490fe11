"""Prefill tokens/s and decode step time of kvstack's paged worker against HF transformers.

``--model-path`` is a checkpoint folder, or a name resolved as kvstack does:
``tiny`` (the bundled random model, the default) or ``smollm2``
(SmolLM2-135M-Instruct, fetched and converted on first use).

- kvstack: :class:`LlamaModel` over a :class:`KVPool` driven the way a
  scheduler does (``open_request`` + ``alloc_extend`` then ``extend``;
  ``alloc_decode`` then ``decode``), with the pool mapped through
  ``attach(handle)`` as the model worker maps it;
- HF: transformers' ``AutoModelForCausalLM`` on the same folder, float32,
  its default attention (``sdpa``), the same torch threads, a dense
  ``DynamicCache``; only the last token's logits, as ``generate`` asks for.

Both are measured in one run. Only forward passes are timed, and the two
sides take turns (each going first every other time), so both see the same
background load:

- prefill: one request of each ``--prefill-lens`` prompt length in one
  forward (kvstack: one extend; HF: one forward of the prompt), fastest of
  ``--repeats`` runs each after a warm-up;
- decode: batches of ``--decode-batches`` requests with a context of
  ``--context-len`` tokens each, then ``--decode-steps`` steps per repeat,
  kvstack and HF alternating step by step at equal context lengths; the
  median step. The contexts' K/V are seeded random values written straight
  into the pool and into HF's cache: the timed work does not depend on them,
  and prefilling 64 x 256 tokens of a real model would take a minute here.
  Contexts grow by one token per step, from ``context_len`` to
  ``context_len + decode_steps * (repeats + 1)``.

Ratios are HF seconds / kvstack seconds (above 1: kvstack is faster); the
top-level two are taken at ``--ratio-prefill-len`` prompt tokens and
``--ratio-batch`` requests. Prints one JSON object on its last line::

    {"ratio_decode_vs_hf": .., "ratio_prefill_vs_hf": ..,
     "prefill": {"512": {"tokens_per_s": .., "s_per_token": .., "seconds": ..,
                         "hf_tokens_per_s": .., "hf_seconds": .., "ratio_vs_hf": ..}, ..},
     "decode": {"1": {"ms_per_step": .., "p90_ms": .., "ms_per_token": ..,
                      "hf_ms_per_step": .., "hf_p90_ms": .., "ratio_vs_hf": ..}, ..},
     "decode_context_len": .., "decode_context_len_max": .., "threads": .., ..}

``--no-hf`` measures kvstack alone (no transformers needed; ratios null).
``s_per_token`` (prefill seconds / prompt tokens) is what the retract cost
model charges for re-prefilling a retracted request's tokens.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from memsvc.core import KVPool, PoolLayout, attach
from memsvc.core.backends.shm import install_sigterm_cleanup, list_segments, segment_owner_pid
from model_svc.__main__ import keep_freed_memory
from model_svc.model import ExtendItem, LlamaModel

PREFILL_LENS = (512, 2048, 8192)
REAL_PREFILL_LENS = (512, 2048)  # 8k of a real model takes minutes here, on both sides
DECODE_BATCHES = (1, 16, 64)
PAGE_SIZE = 16
SLOW_S = 2.0  # best_seconds: a run this slow is timed twice, not repeats + 1 times
T = TypeVar("T")


def resolve_model_path(name: str) -> Path:
    """``tiny`` and ``smollm2`` as kvstack resolves them; anything else is a folder."""
    if name == "tiny":
        from model_svc.tiny import default_checkpoint

        return default_checkpoint()
    if name == "smollm2":
        from kvstack.model.fetch import fetch

        return fetch("smollm2")
    return Path(name)


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and the seconds it took."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def best_seconds_each(
    fns: Sequence[Callable[[], object]], repeats: int, slow_s: float = SLOW_S
) -> list[float]:
    """Fastest of ``repeats`` runs of each of ``fns`` after one warm-up, the fns in
    turns (in reverse order every other round, so none always runs first).

    A warm-up slower than ``slow_s`` (a long prefill) is itself a fair sample,
    since one-time costs are noise next to it; one more round is timed then,
    to keep the whole benchmark short.
    """
    warmups = [timed(fn)[1] for fn in fns]
    slow = max(warmups) > slow_s
    best = [w if slow else float("inf") for w in warmups]
    for round_index in range(1 if slow else repeats):
        order = range(len(fns)) if round_index % 2 else reversed(range(len(fns)))
        for i in order:
            best[i] = min(best[i], timed(fns[i])[1])
    return best


def best_seconds(fn: Callable[[], object], repeats: int, slow_s: float = SLOW_S) -> float:
    """:func:`best_seconds_each` of one function."""
    return best_seconds_each([fn], repeats, slow_s)[0]


@dataclass
class Bench:
    """A pool the model is bound to, and a seeded source of prompt tokens."""

    pool: KVPool
    model: LlamaModel
    rng: np.random.Generator

    def prompt(self, num_tokens: int) -> np.ndarray:
        return self.rng.integers(0, self.model.config.vocab_size, num_tokens, dtype=np.int64)

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

    def fill_random(self, rids: list[str], generator: torch.Generator) -> None:
        """Seeded random K/V on every page of ``rids``' allocated positions (all layers)."""
        table = self.pool.buffers.req_to_token
        slots = np.concatenate(
            [table[self.pool.request(rid).row, : self.pool.request(rid).kv_len] for rid in rids]
        )
        pages = torch.from_numpy(np.unique(slots // self.pool.page_size).astype(np.int64))
        kv = torch.from_numpy(self.pool.buffers.kv)
        kv[pages] = torch.randn((pages.numel(), *kv.shape[1:]), generator=generator)


class HFBaseline:
    """transformers' own forward of the same checkpoint, with a dense ``DynamicCache``."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path).float().eval()
        forward = inspect.signature(self.model.forward).parameters
        # transformers 5 names the cache argument ``cache``; 4.x ``past_key_values``.
        self.cache_arg = "cache" if "cache" in forward else "past_key_values"

    @property
    def attn_implementation(self) -> str:
        return str(self.model.config._attn_implementation)

    @torch.inference_mode()
    def prefill(self, token_ids: np.ndarray) -> torch.Tensor:
        """One forward of the prompt into a fresh cache; logits of the last token."""
        ids = torch.as_tensor(token_ids)[None]
        return self.model(ids, use_cache=True, logits_to_keep=1).logits[:, -1]

    def random_cache(self, batch_size: int, context_len: int, generator: torch.Generator):
        """A dense cache of ``batch_size`` sequences of ``context_len`` seeded random K/V."""
        from transformers import DynamicCache

        cfg = self.model.config
        shape = (batch_size, cfg.num_key_value_heads, context_len, cfg.head_dim)
        cache = DynamicCache()
        for layer in range(cfg.num_hidden_layers):
            key = torch.randn(shape, generator=generator)
            cache.update(key, torch.randn(shape, generator=generator), layer)
        return cache

    @torch.inference_mode()
    def decode(self, cache, token_ids: np.ndarray) -> torch.Tensor:
        """One token per sequence after what ``cache`` holds (which grows by one)."""
        ids = torch.as_tensor(token_ids)[:, None]
        positions = torch.full_like(ids, cache.get_seq_length())
        kwargs = {self.cache_arg: cache}
        out = self.model(ids, position_ids=positions, use_cache=True, logits_to_keep=1, **kwargs)
        return out.logits[:, -1]


def ratio(hf_seconds: float | None, seconds: float) -> float | None:
    return None if hf_seconds is None else round(hf_seconds / seconds, 3)


def measure_prefill(
    bench: Bench, hf: HFBaseline | None, num_tokens: int, repeats: int
) -> dict[str, float | None]:
    rid = f"prefill-{num_tokens}"
    bench.open([rid], num_tokens)
    try:
        ids = bench.prompt(num_tokens)
        # Re-running the same extend writes the same slots: every run is a full prefill.
        fns = [lambda: bench.extend(rid, ids)] + ([lambda: hf.prefill(ids)] if hf else [])
        # Every length gets all its rounds: the two sides' figures are compared.
        seconds, *hf_seconds = best_seconds_each(fns, repeats, slow_s=math.inf)
    finally:
        bench.close([rid])
    hf_s = hf_seconds[0] if hf_seconds else None
    return {
        "seconds": round(seconds, 4),
        "tokens_per_s": round(num_tokens / seconds, 1),
        "s_per_token": float(f"{seconds / num_tokens:.4g}"),
        "hf_seconds": None if hf_s is None else round(hf_s, 4),
        "hf_tokens_per_s": None if hf_s is None else round(num_tokens / hf_s, 1),
        "ratio_vs_hf": ratio(hf_s, seconds),
    }


def step_stats(samples: list[float]) -> tuple[float, float]:
    """Median and 90th percentile of ``samples`` (seconds), in ms."""
    ms = np.asarray(samples) * 1e3
    return float(np.median(ms)), float(np.percentile(ms, 90))


def measure_decode(
    bench: Bench,
    hf: HFBaseline | None,
    batch_size: int,
    context_len: int,
    steps: int,
    repeats: int,
) -> dict[str, float | None]:
    rids = [f"decode{batch_size}-{i}" for i in range(batch_size)]
    generator = torch.Generator().manual_seed(batch_size)
    bench.open(rids, context_len)
    try:
        bench.fill_random(rids, generator)
        cache = hf.random_cache(batch_size, context_len, generator) if hf else None
        rows = np.array([bench.pool.request(rid).row for rid in rids], dtype=np.int64)
        last_tokens = bench.prompt(batch_size)
        samples: list[float] = []
        hf_samples: list[float] = []
        for i in range(repeats + 1):  # the first round is the warm-up
            for step in range(steps):
                if bench.pool.alloc_decode(rids) is None:
                    raise RuntimeError(f"pool too small to decode a batch of {batch_size}")
                seq_lens = np.array([bench.pool.request(rid).kv_len for rid in rids])
                hf_step = None if hf is None else partial(hf.decode, cache, last_tokens)
                hf_first = hf_step is not None and step % 2 == 1  # each side first in turn
                if hf_first:
                    hf_seconds = timed(hf_step)[1]
                logits, seconds = timed(partial(bench.model.decode, rows, seq_lens, last_tokens))
                if hf_step is not None and not hf_first:
                    hf_seconds = timed(hf_step)[1]
                last_tokens = logits.argmax(-1).numpy()
                if i:
                    samples.append(seconds)
                    if hf_step is not None:
                        hf_samples.append(hf_seconds)
    finally:
        bench.close(rids)
    median, p90 = step_stats(samples)
    hf_median, hf_p90 = step_stats(hf_samples) if hf_samples else (None, None)
    return {
        "ms_per_step": round(median, 3),
        "p90_ms": round(p90, 3),
        "ms_per_token": round(median / batch_size, 4),
        "hf_ms_per_step": None if hf_median is None else round(hf_median, 3),
        "hf_p90_ms": None if hf_p90 is None else round(hf_p90, 3),
        "ratio_vs_hf": ratio(hf_median, median),
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
    decode_pages = max(args.decode_batches) * -(-max_decode_len(args) // PAGE_SIZE)
    prefill_pages = -(-max(args.prefill_lens) // PAGE_SIZE)
    return PoolLayout(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        page_size=PAGE_SIZE,
        num_pages=max(decode_pages, prefill_pages) + 16,
        dtype="float32",
        max_running_requests=max(args.decode_batches) + 1,
        max_context_len=max(max(args.prefill_lens), max_decode_len(args)) + PAGE_SIZE,
    )


def run(args: argparse.Namespace) -> dict:
    path = resolve_model_path(args.model_path)
    model = LlamaModel.from_checkpoint(path)
    hf = None if args.no_hf else HFBaseline(path)
    layout = pool_layout(model, args)
    with bound_pool(model, layout) as pool:
        bench = Bench(pool, model, np.random.default_rng(args.seed))
        prefill = {str(n): measure_prefill(bench, hf, n, args.repeats) for n in args.prefill_lens}
        decode = {
            str(b): measure_decode(bench, hf, b, args.context_len, args.decode_steps, args.repeats)
            for b in args.decode_batches
        }
    cfg = model.config
    return {
        "ratio_decode_vs_hf": decode[str(args.ratio_batch)]["ratio_vs_hf"],
        "ratio_prefill_vs_hf": prefill[str(args.ratio_prefill_len)]["ratio_vs_hf"],
        "ratio_batch": args.ratio_batch,
        "ratio_prefill_len": args.ratio_prefill_len,
        "model": {
            "path": str(path),
            "layers": cfg.num_hidden_layers,
            "hidden": cfg.hidden_size,
            "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "vocab": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "dtype": "float32",
            "page_size": PAGE_SIZE,
        },
        "hf_attn_implementation": None if hf is None else hf.attn_implementation,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "prefill": prefill,
        "decode": decode,
        "decode_context_len": args.context_len,
        "decode_context_len_max": max_decode_len(args),
        "decode_steps_timed": args.decode_steps * args.repeats,
    }


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-path", default="tiny", help="checkpoint folder, or tiny / smollm2 (default tiny)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure")
    parser.add_argument(
        "--prefill-lens",
        type=int_list,
        help=f"comma-separated prompt lengths (default {','.join(map(str, PREFILL_LENS))} "
        f"on tiny, {','.join(map(str, REAL_PREFILL_LENS))} otherwise)",
    )
    parser.add_argument(
        "--decode-batches",
        type=int_list,
        default=DECODE_BATCHES,
        help=f"comma-separated batch sizes (default {','.join(map(str, DECODE_BATCHES))})",
    )
    parser.add_argument("--context-len", type=int, default=256, help="decode: tokens per request")
    parser.add_argument("--decode-steps", type=int, default=16, help="decode steps per repeat")
    parser.add_argument("--ratio-batch", type=int, default=16, help="batch of ratio_decode_vs_hf")
    parser.add_argument(
        "--ratio-prefill-len", type=int, default=2048, help="prompt of ratio_prefill_vs_hf"
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.prefill_lens is None:
        args.prefill_lens = PREFILL_LENS if args.model_path == "tiny" else REAL_PREFILL_LENS
    if args.ratio_batch not in args.decode_batches:
        parser.error(f"--ratio-batch {args.ratio_batch} is not in --decode-batches")
    if args.ratio_prefill_len not in args.prefill_lens:
        parser.error(f"--ratio-prefill-len {args.ratio_prefill_len} is not in --prefill-lens")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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
