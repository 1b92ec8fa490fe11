"""Serving bench/hicache.py's workloads on stacks: a chat's turns one after another, a
round of chats ``in_flight`` at a time, and the timed rounds over every stack of a cell
(warm-up rounds first, the order rotating), with each stack's figures and replies."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import time
from typing import Any

from hicache_figures import STAT_KEYS, compare, process_cpu_s, summarize  # bench/
from hicache_workload import Chat, Turn, Workload

from scheduler_svc.client import AsyncGenerateClient, Chunk, GenerateResult

REQUEST_TIMEOUT_S = 600.0


async def run_chat(
    client: AsyncGenerateClient,
    chat: Chat,
    output_len: int,
    end_of_turn: list[int],
    opened: asyncio.Event | None = None,
) -> None:
    """The chat's turns one after another; each reply joins the history, token for token.
    ``opened`` is set once the first turn's first token is out (its prompt is in the
    prefix tree by then)."""
    sampling = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.0}
    for index, user_ids in enumerate(chat.user_turns):
        prompt = chat.history + user_ids
        start = time.perf_counter()
        first: float | None = None
        result: GenerateResult | None = None
        async for item in client.stream(prompt, rid=f"{chat.name}-t{index}", sampling=sampling):
            if isinstance(item, Chunk) and first is None and item.token_ids:
                first = time.perf_counter()
                if opened is not None:
                    opened.set()
            elif isinstance(item, GenerateResult):
                result = item
        end = time.perf_counter()
        if result is None or result.finish_reason.get("type") == "abort":
            raise RuntimeError(f"{chat.name} turn {index} failed: {result and result.meta_info}")
        chat.turns.append(
            Turn((first or end) - start, end - start, result.output_ids, result.meta_info)
        )
        chat.history = prompt + result.output_ids + end_of_turn


async def serve_round(
    client: AsyncGenerateClient, chats: list[Chat], workload: Workload
) -> dict[str, Any]:
    """Every chat of the round, ``in_flight`` at a time (a chat holds its slot to its end).

    With a shared prefix, the first chat opens the round alone and the others start
    once its first token is out, so they all hit the shared prefix it computed. Sent
    together, the first turns would race the scheduler's batch forming (FCFS, no
    in-batch prefix sharing, as SGLang's default policy): one prefill batch computes
    the shared prefix once per request in it, and whether they arrive in one batch or
    two is chance, which made the roomy cells' prefill differ between the stacks by up
    to ``in_flight - 1`` shared prefixes a round.
    """
    slots = asyncio.Semaphore(workload.spec.in_flight)
    opened = asyncio.Event()
    if not workload.spec.system_len:
        opened.set()

    async def one(chat: Chat, leader: bool) -> None:
        async with slots:
            if not leader:
                await opened.wait()
            try:
                await run_chat(
                    client,
                    chat,
                    workload.spec.output_len,
                    workload.end_of_turn,
                    opened if leader else None,
                )
            finally:
                opened.set()

    before = (await client.info())["stats"]
    start = time.perf_counter()
    await asyncio.gather(*(one(chat, i == 0) for i, chat in enumerate(chats)))
    wall_s = time.perf_counter() - start
    after = (await client.info())["stats"]
    ttft_p50_s = statistics.median(t.ttft_s for c in chats for t in c.turns)
    deltas = {k: after[k] - before[k] for k in STAT_KEYS if k in after}
    return {"wall_s": wall_s, "ttft_p50_s": ttft_p50_s, **deltas}


def cpu_s(pids: dict[str, int]) -> dict[str, float | None]:
    return {service: process_cpu_s(pid) for service, pid in pids.items()}


async def serve(
    addresses: dict[str, str],
    workload: Workload,
    rounds: int,
    pids: dict[str, dict[str, int]] | None = None,
    warmup_rounds: int = 0,
) -> dict[str, Any]:
    """Every stack serves ``warmup_rounds`` untimed rounds (chats of their own), then
    ``rounds`` rounds, the order rotating; figures per stack (with ``pids``, each
    stack's services by name, the CPU seconds each used per round)."""
    figures: dict[str, list[dict[str, Any]]] = {name: [] for name in addresses}
    turns: dict[str, list[Turn]] = {name: [] for name in addresses}
    outputs: dict[str, list[list[list[int]]]] = {name: [] for name in addresses}  # [chat][turn]
    async with contextlib.AsyncExitStack() as stack:
        clients = {
            name: await stack.enter_async_context(
                AsyncGenerateClient(address, timeout_s=REQUEST_TIMEOUT_S)
            )
            for name, address in addresses.items()
        }
        warmup = workload.encode("Hello there, how are you today?")
        for name, client in clients.items():
            await client.generate(warmup, rid=f"warmup-{name}", sampling={"max_new_tokens": 2})
        order = list(clients)
        for index in range(rounds, rounds + warmup_rounds):  # chats no timed round has
            for name in order:
                await serve_round(clients[name], workload.chats(index), workload)
        for index in range(rounds):
            for name in order[index % len(order) :] + order[: index % len(order)]:
                chats = workload.chats(index)
                before = cpu_s(pids[name]) if pids else {}
                figures[name].append(await serve_round(clients[name], chats, workload))
                after = cpu_s(pids[name]) if pids else {}
                if after and None not in after.values() and None not in before.values():
                    figures[name][-1]["cpu_s"] = {s: after[s] - before[s] for s in after}
                turns[name] += [t for c in chats for t in c.turns]
                outputs[name] += [[t.output_ids for t in c.turns] for c in chats]
                wall = figures[name][-1]["wall_s"]
                print(f"  round {index} {name}: {wall:.1f}s", file=sys.stderr, flush=True)
    out: dict[str, Any] = {name: summarize(figures[name], turns[name]) for name in addresses}
    names = list(addresses)
    out["agreement"] = {
        f"{a}_vs_{b}": compare(outputs[a], outputs[b])
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    out["outputs_identical"] = all(v["replies_differing"] == 0 for v in out["agreement"].values())
    return out
