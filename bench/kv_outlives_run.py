"""What bench/kv_outlives.py's parts share: a workload of greedy streams over a stack,
when each token arrived, and the figures read off it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hicache_figures import percentile  # bench/, the script's folder

from scheduler_svc.client import AsyncGenerateClient, Chunk, GenerateResult

PAGE_SIZE = 16
TOKEN_RANGE = (256, 8192)  # prompt tokens: ordinary BPE ids of SmolLM2's vocabulary
QUICK_TOKEN_RANGE = (3, 255)  # the tiny model's byte vocabulary


class Run:
    """One workload over the stack: streams, when each token arrived, and an optional kill."""

    def __init__(self, prompts: list[list[int]], max_new: int, prefix: str) -> None:
        self.prompts = prompts
        self.max_new = max_new
        self.prefix = prefix
        self.tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        self.arrivals: list[float] = []
        self.errors: list[str] = []
        self.latency_s: dict[int, float] = {}  # submission to the last token
        self.ttft_s: dict[int, float] = {}

    async def one(self, client: AsyncGenerateClient, i: int) -> None:
        sampling = {"max_new_tokens": self.max_new, "temperature": 0.0, "ignore_eos": True}
        got = self.tokens[i]
        rid = f"{self.prefix}-{i}"
        started = time.monotonic()
        async for item in client.stream(self.prompts[i], rid=rid, sampling=sampling):
            if isinstance(item, Chunk):
                got += item.token_ids
                self.arrivals.append(time.monotonic())
                self.ttft_s.setdefault(i, self.arrivals[-1] - started)
            elif isinstance(item, GenerateResult):
                reason = item.finish_reason or {}
                if reason.get("type") == "abort":
                    self.errors.append(f"{i}: {reason.get('message')}")
                self.tokens[i] = list(item.output_ids)
        self.latency_s[i] = time.monotonic() - started

    async def serve(self, address: str, kill: Any = None) -> None:
        async with AsyncGenerateClient(address, timeout_s=600.0, resubmits=6) as client:
            tasks = [asyncio.create_task(self.one(client, i)) for i in range(len(self.prompts))]
            if kill is not None:
                tasks.append(asyncio.create_task(kill(self)))
            await asyncio.gather(*tasks)


def next_token_s(arrivals: list[float], killed_at: float, burst_s: float = 0.1) -> float | None:
    """Seconds from the kill to the first token the restarted scheduler sent: chunks the
    dead one had sent still arrive in a burst right after the kill, so the first
    arrival after a silence of ``burst_s`` (else the first arrival)."""
    last = killed_at
    for at in arrivals:
        if at - last >= burst_s:
            return round(at - killed_at, 3)
        last = at
    return round(arrivals[0] - killed_at, 3) if arrivals else None


def quantile_s(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (seconds), as bench/hicache.py reads it, rounded."""
    return round(percentile(values, q), 3)
