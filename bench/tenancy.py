"""The tenant side channel in time: cold, cross-salt and same-salt time to first token.

A prefix cache shared between tenants gives away what another tenant sent: a
prompt someone cached answers faster (CVE-2025-46570). With ``cache_salt``,
kvstack shares cached KV only inside one namespace. This bench measures what
that means on one ``kvstack serve`` (SmolLM2 by default), over HTTP, in
``--trials`` rounds; each round sends three prompts of the same length, with
text no earlier round sent:

1. *cold*: a prompt nobody sent, as tenant A;
2. tenant A caches the round's *target* prompt (not timed);
3. *cross-salt*: tenant B (another ``cache_salt``) sends the target;
4. *same-salt*: tenant A sends the target again.

Each is a streamed ``/generate`` of greedy tokens; its time to first token is
the time to the first streamed chunk. Cross-salt must look like cold (no hit:
``cached_tokens`` 0) and same-salt like a hit. The order of 1, 3 and 4 is
shuffled within each round so that no one of them always runs on a warmer
machine. The pool is checked whole (nothing held) at the end.

The last line is JSON: ``cross_salt_cached_tokens`` (the most any cross-salt
request found cached: 0 is the guarantee), ``same_salt_cached_tokens`` (the
least a same-salt one found), the three TTFT medians (``ttft_*_p50_s``), the
ratios of cross-salt and same-salt to cold, ``prompt_tokens`` and ``trials``.
Exit status 0 only if no cross-salt request found anything cached.

    .venv/bin/python bench/tenancy.py                 # 15 rounds, a ~520-token prompt
    .venv/bin/python bench/tenancy.py --quick         # 3 rounds, a ~130-token prompt
    .venv/bin/python bench/tenancy.py -- --enable-hierarchical-cache   # flags for serve
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from serve_process import kvstack_serve

POOL = ["--max-total-tokens", "8192", "--page-size", "16"]
KINDS = ("cold", "cross_salt", "same_salt")


def passage(num_words: int) -> str:
    """The demo's passage, cut or repeated to ``num_words`` words."""
    from kvstack.demo.workload import PASSAGE

    words = PASSAGE.split()
    return " ".join(words[i % len(words)] for i in range(num_words))


async def first_token(
    http: aiohttp.ClientSession, url: str, text: str, salt: str
) -> tuple[float, dict[str, Any]]:
    """A streamed greedy ``/generate``: seconds to its first chunk, and its last meta_info."""
    body = {
        "text": text,
        "cache_salt": salt,
        "stream": True,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True},
    }
    started = time.perf_counter()
    ttft = None
    meta: dict[str, Any] = {}
    async with http.post(f"{url}/generate", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"/generate answered {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            meta = json.loads(line[5:])["meta_info"]
    assert ttft is not None, "no chunk streamed"
    return ttft, meta


async def run_trials(url: str, trials: int, num_words: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    body = passage(num_words)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    cached: dict[str, list[int]] = {kind: [] for kind in KINDS}
    prompt_tokens = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        # one untimed request first: the worker's first forward pays for warming up
        await first_token(http, url, f"Warm-up.\n\n{body}", "tenant-a")
        for trial in range(trials):
            target = f"Round {trial}, the target. Summarize:\n\n{body}"
            texts = {
                "cold": (f"Round {trial}, a cold one. Summarize:\n\n{body}", "tenant-a"),
                "cross_salt": (target, "tenant-b"),
                "same_salt": (target, "tenant-a"),
            }
            await first_token(http, url, target, "tenant-a")  # A caches the target
            order = list(KINDS)
            rng.shuffle(order)
            for kind in order:
                ttft, meta = await first_token(http, url, *texts[kind])
                times[kind].append(ttft)
                cached[kind].append(int(meta.get("cached_tokens", 0)))
                prompt_tokens = int(meta.get("prompt_tokens", 0))
            line = {k: (round(times[k][-1], 4), cached[k][-1]) for k in KINDS}
            print(f"round {trial}: (ttft_s, cached_tokens) {line}", flush=True)
    p50 = {kind: statistics.median(times[kind]) for kind in KINDS}
    return {
        "cross_salt_cached_tokens": max(cached["cross_salt"]),
        "same_salt_cached_tokens": min(cached["same_salt"]),
        "cold_cached_tokens": max(cached["cold"]),
        "ttft_cold_p50_s": round(p50["cold"], 5),
        "ttft_cross_salt_p50_s": round(p50["cross_salt"], 5),
        "ttft_same_salt_p50_s": round(p50["same_salt"], 5),
        "cross_salt_over_cold": round(p50["cross_salt"] / p50["cold"], 3),
        "same_salt_over_cold": round(p50["same_salt"] / p50["cold"], 3),
        "prompt_tokens": prompt_tokens,
        "trials": trials,
    }


def pool_tokens(url: str) -> dict[str, float]:
    """memsvc's token counts by state, from the front's /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {
        sample.labels["state"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "memsvc_tokens"
        for sample in family.samples
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default="smollm2", help="kvstack serve's --model-path")
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument(
        "--prompt-words", type=int, default=440, help="words of the passage in each prompt"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="3 rounds of a 100-word prompt")
    parser.add_argument("serve_args", nargs="*", help="after --: more kvstack serve flags")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.prompt_words = 3, 100
    flags = ["--model-path", args.model_path, *POOL, *args.serve_args]
    with (
        tempfile.TemporaryDirectory(prefix="kvstack-bench-tenancy-") as tmp,
        kvstack_serve(Path(tmp), flags, timeout_s=600) as serve,
    ):
        url = serve.address
        print(f"kvstack serve at {url}, {args.trials} rounds", flush=True)
        result = asyncio.run(run_trials(url, args.trials, args.prompt_words, args.seed))
        tokens = pool_tokens(url)
        if tokens.get("used", 0) != 0:
            raise RuntimeError(f"the pool is not whole after the bench: {tokens}")
    print(json.dumps(result), flush=True)
    return 0 if result["cross_salt_cached_tokens"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
