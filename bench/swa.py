"""What a hybrid model's two pools buy: concurrent context in the same KV bytes.

One random-weight hybrid checkpoint (transformers' ``MinistralForCausalLM``,
``layer_types`` with 5 of 6 layers ``sliding_attention``, a small realistic
shape, saved as an HF folder; nothing downloaded), served twice by real
normal-mode stacks (memsvc + model_svc + scheduler_svc), with the same
``--num-pages`` (the bytes of that many pages of every layer):

- ``hybrid``: the layout the launcher reads from the checkpoint: a full pool for
  the full-attention layer and an SWA pool for the sliding ones, split by
  ``--swa-full-tokens-ratio`` (SGLang's sizing; SWA slots that leave every window
  are freed during decode);
- ``all_full``: ``--disable-hybrid-swa-memory`` (memsvc ``--layer-types`` with every
  layer ``full_attention``): one pool holding every layer for every position,
  the worker still masking each sliding layer to its window, so the outputs are
  comparable token for token.

The workload: ``--requests`` prompts of ``--prompt-len`` tokens (several x W),
``--max-new-tokens`` each, all submitted at once, greedy. The scheduler's
``sglang:decode_sum_seq_lens`` and ``sglang:num_running_reqs`` are scraped
every ``SAMPLE_S`` while it runs: the concurrent context held and the
concurrency reached. Both stacks' pools are checked idle (memsvc's integrity
check, both pools) before they stop.

Prints one JSON object on its last line::

    {"concurrency_ratio": .., "mean_context_ratio": .., "outputs_identical": true,
     "hybrid": {"peak_context_tokens": .., "mean_context_tokens": .., "peak_running_reqs": ..,
                "retracted_reqs": .., "output_tokens_per_s": .., "wall_s": .., "pool": {..}},
     "all_full": {..}, "workload": {..}, "machine": ..}

``concurrency_ratio`` = hybrid's peak concurrent context / all-full's (tokens of
context held by running requests at once). Exits non-zero if the outputs differ
or a service left shared memory behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvstack.stack.launch import Launcher  # noqa: E402
from kvstack.stack.model_pool import all_full_layer_types  # noqa: E402
from memsvc.client import MemClient  # noqa: E402
from scheduler_svc.client import AsyncGenerateClient, GenerateClient  # noqa: E402

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING, SLIDING, SLIDING]  # 5 of 6 windowed
PAGE_SIZE = 4
SAMPLE_S = 0.05
REQUEST_TIMEOUT_S = 600.0
# shapes: (hidden, intermediate, heads, kv heads, head_dim, vocab)
SHAPES = {
    "full": (256, 512, 4, 2, 64, 512),
    "quick": (128, 256, 4, 2, 32, 256),
}


def write_checkpoint(folder: Path, window: int, shape: str, seed: int = 0) -> Path:
    """A random ``MinistralForCausalLM`` with 5 of 6 layers windowed, saved by transformers."""
    import torch
    import transformers

    hidden, inter, heads, kv_heads, head_dim, vocab = SHAPES[shape]
    config = transformers.MinistralConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.1,  # varied greedy continuations (0.02 repeats one token)
        sliding_window=window,
        layer_types=LAYER_TYPES,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[str, list[int]]]:
    import random

    rng = random.Random(args.seed)
    return [
        (f"r{i}", [rng.randrange(vocab) for _ in range(args.prompt_len)])
        for i in range(args.requests)
    ]


class Sampler(threading.Thread):
    """Scrapes the scheduler's metrics every :data:`SAMPLE_S` until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.samples: list[tuple[float, float]] = []  # (running reqs, sum of seq lens)
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                text = urllib.request.urlopen(self.url, timeout=2).read().decode()
            except OSError:
                text = ""
            values = {}
            for line in text.splitlines():
                for name in ("sglang:num_running_reqs", "sglang:decode_sum_seq_lens"):
                    if line.startswith(name + "{"):
                        values[name] = float(line.rsplit(" ", 1)[1])
            if len(values) == 2:
                running = values["sglang:num_running_reqs"]
                self.samples.append((running, values["sglang:decode_sum_seq_lens"]))
            self.done.wait(SAMPLE_S)


async def run_requests(address: str, reqs, max_new: int) -> dict[str, list[int]]:
    async with AsyncGenerateClient(address, timeout_s=REQUEST_TIMEOUT_S) as client:
        results = await asyncio.gather(
            *(
                client.generate(ids, rid=rid, sampling={"max_new_tokens": max_new})
                for rid, ids in reqs
            )
        )
    return {r.rid: list(r.output_ids) for r in results}


def pool_figures(layout) -> dict[str, Any]:
    """Tokens each pool holds and the bytes both take (K and V, padding page excluded)."""
    token_bytes = 2 * layout.num_kv_heads * layout.head_dim * 4  # one layer, float32
    n_swa = sum(1 for t in layout.layer_types if t == SLIDING)
    n_full = layout.num_layers - n_swa
    full_tokens = layout.num_pages * layout.page_size
    swa_tokens = layout.swa_num_pages * layout.page_size if n_swa and layout.is_hybrid else 0
    if not layout.is_hybrid:
        n_full = layout.num_layers
    return {
        "full_tokens": full_tokens,
        "swa_tokens": swa_tokens,
        "kv_bytes": token_bytes * (full_tokens * n_full + swa_tokens * n_swa),
    }


def serve(launcher: Launcher, name: str, checkpoint: Path, pool, scheduler, reqs, args) -> dict:
    """One stack: warm up, run the workload under the sampler, check the pool idle."""
    mem, _model, sched = launcher.start_normal_stack(
        checkpoint,
        [*pool, "--metrics-port", "0"],
        [*scheduler, "--metrics-port", "0"],
        suffix=f"-{name}",
    )
    with MemClient(mem.address) as client:
        layout = client.layout
    asyncio.run(run_requests(sched.address, [("warmup", reqs[0][1][:16])], 4))
    with GenerateClient(sched.address) as client:
        before = client.info()["stats"]
    sampler = Sampler(f"http://127.0.0.1:{sched.metrics_port}/metrics")
    sampler.start()
    start = time.perf_counter()
    outputs = asyncio.run(run_requests(sched.address, reqs, args.max_new_tokens))
    wall = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    with GenerateClient(sched.address) as client:
        stats = client.info()["stats"]
    with MemClient(mem.address) as client:
        client.check(idle=True)  # both pools of a hybrid layout
    busy = [held for running, held in sampler.samples if running > 0]
    generated = stats["generated_tokens"] - before["generated_tokens"]
    return {
        "outputs": outputs,
        "figures": {
            "peak_context_tokens": max(busy, default=0),
            "mean_context_tokens": round(statistics.fmean(busy), 1) if busy else 0,
            "peak_running_reqs": int(max((r for r, _ in sampler.samples), default=0)),
            "retracted_reqs": stats["retracted_reqs"] - before["retracted_reqs"],
            "reprefilled_tokens": stats["reprefilled_tokens"] - before["reprefilled_tokens"],
            "output_tokens_per_s": round(generated / wall, 1),
            "wall_s": round(wall, 2),
            "samples": len(sampler.samples),
            "pool": pool_figures(layout),
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="small model and workload (a smoke run)"
    )
    parser.add_argument(
        "--window", type=int, default=None, help="sliding window W (default 64; quick 32)"
    )
    parser.add_argument("--requests", type=int, default=None, help="requests (default 16; quick 8)")
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="prompt tokens (default 6 x W)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="output tokens (default W)"
    )
    parser.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="pages of every layer both stacks get (default: 3 contexts' worth)",
    )
    parser.add_argument(
        "--swa-full-tokens-ratio",
        type=float,
        default=None,
        help="the hybrid stack's SWA/full token ratio (default: a window and four "
        "pages over the context, as an operator sizes it for long contexts)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)  # fmt: skip
    quick = args.quick
    args.window = args.window or (32 if quick else 64)
    args.requests = args.requests or (8 if quick else 16)
    args.prompt_len = args.prompt_len or 6 * args.window
    args.max_new_tokens = args.max_new_tokens or args.window
    context = args.prompt_len + args.max_new_tokens
    args.num_pages = args.num_pages or 3 * context // PAGE_SIZE
    if args.swa_full_tokens_ratio is None:
        held = args.window + 2 * PAGE_SIZE  # a decoding request's SWA slots, at most
        args.swa_full_tokens_ratio = round(1.25 * held / context, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = "quick" if args.quick else "full"
    context = args.prompt_len + args.max_new_tokens
    common = [
        "--page-size", str(PAGE_SIZE), "--dtype", "float32",
        "--num-pages", str(args.num_pages), "--max-context-len", str(context + PAGE_SIZE),
        "--max-running-requests", str(args.requests),
    ]  # fmt: skip
    scheduler = ["--chunked-prefill-size", str(2 * args.window)]
    stacks = {
        "hybrid": [*common, "--swa-full-tokens-ratio", str(args.swa_full_tokens_ratio)],
        "all_full": [*common, *all_full_layer_types(len(LAYER_TYPES))],
    }
    results: dict[str, dict] = {}
    leaked: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvstack-swa-") as tmp:
        checkpoint = write_checkpoint(Path(tmp) / "ckpt", args.window, shape, args.seed)
        reqs = workload(args, SHAPES[shape][5])
        for name, pool in stacks.items():
            with Launcher(Path(tmp)) as launcher:
                results[name] = serve(launcher, name, checkpoint, pool, scheduler, reqs, args)
                print(f"{name}: {json.dumps(results[name]['figures'])}", file=sys.stderr)
            leaked += launcher.leaked_segments
    hybrid, full = results["hybrid"]["figures"], results["all_full"]["figures"]
    identical = results["hybrid"]["outputs"] == results["all_full"]["outputs"]
    report = {
        "concurrency_ratio": round(hybrid["peak_context_tokens"] / full["peak_context_tokens"], 2)
        if full["peak_context_tokens"]
        else None,
        "mean_context_ratio": round(hybrid["mean_context_tokens"] / full["mean_context_tokens"], 2)
        if full["mean_context_tokens"]
        else None,
        "throughput_ratio": round(hybrid["output_tokens_per_s"] / full["output_tokens_per_s"], 2)
        if full["output_tokens_per_s"]
        else None,
        "outputs_identical": identical,
        "hybrid": hybrid,
        "all_full": full,
        "workload": {
            "window": args.window,
            "layer_types": LAYER_TYPES,
            "shape": dict(
                zip(
                    ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"),
                    SHAPES[shape],
                    strict=True,
                )
            ),
            "requests": args.requests,
            "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens,
            "num_pages": args.num_pages,
            "page_size": PAGE_SIZE,
            "swa_full_tokens_ratio": args.swa_full_tokens_ratio,
        },
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "leaked_segments": leaked,
    }
    print(json.dumps(report))
    return 0 if identical and not leaked else 1


if __name__ == "__main__":
    sys.exit(main())
