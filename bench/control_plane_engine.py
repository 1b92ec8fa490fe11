"""The scheduler engine at serving scale (issue 28, item 6): ``admission`` and ``overlap``.

``admission``: the real :class:`~scheduler_svc.engine.Engine` admits 64
prompts of ``--admission-prompt-tokens`` tokens in one prefill round (its
``max_prefill_tokens`` raised so that all fit one round; SGLang's default of
16,384 would take several). Half of them start with one of 8 cached
1,024-token prefixes (half their length at smaller sizes). The model is a stub
that answers at once, so what is timed is the scheduler and memsvc: from the
first ``engine.step()`` until all 64 run, against memsvc's process with
:class:`AsyncMemClient` and against its in-process twin (:class:`InProcessMem`),
rounds interleaved. Every memsvc op the engine makes in that time is counted,
by op: ``admission_64_round_trips``.

``overlap``: the tiny model (``model_svc`` and ``memsvc`` processes, the engine
in this process with the real clients). After all requests run, decode steps
in blocks of ``--overlap-steps``, the overlap schedule on and off alternately
(the engine's config swapped between blocks, where it has the field), and the
share of wall time with no forward pass in flight (the model's ``decode`` calls
timed from when each starts until it returns) is ``exposed_share_overlap_on``
/ ``_off``, at the largest of ``--overlap-batches``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from control_plane_mem import Pool  # bench/, on the path as the script's folder

from kvstack.stack.launch import Launcher
from kvstack.stack.model_pool import pool_layout_args, worker_threads
from kvstack.stack.process import model_ready_timeout
from memsvc.client import AsyncMemClient
from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig
from memsvc.inproc import InProcessMem
from model_svc.client import AsyncModelClient, ForwardResult
from scheduler_svc.core import Req, SamplingParams, SchedulerConfig
from scheduler_svc.engine import Engine

ADMITTED = 64
GROUPS = 8  # cached prefixes the sharing prompts start with
OVERLAP_FIELD = "disable_overlap_schedule"
PROMPT_BYTES = 32  # the tiny model's prompts: random bytes


class Counting:
    """Counts the memsvc round trips a client makes, by op (``ops``), and when each was in
    flight (``intervals``: from the call until its reply is parsed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ops: list[str] = []
        self.intervals: list[tuple[float, float]] = []

    async def _invoke(self, call: Any) -> Any:
        self.ops.append(call.op)
        started = time.perf_counter()
        try:
            return await super()._invoke(call)  # type: ignore[misc]
        finally:
            self.intervals.append((started, time.perf_counter()))


class CountingAsyncMemClient(Counting, AsyncMemClient):
    pass


class CountingInProcessMem(Counting, InProcessMem):
    pass


class StubModel:
    """Answers every forward at once: the next token is the last one plus one."""

    async def extend(self, items: Any, sampling: Any = None, **kwargs: Any) -> ForwardResult:
        return ForwardResult(np.array([int(new[-1]) + 1 for _, _, new in items], dtype=np.int64))

    async def decode(self, rows: Any, seq_lens: Any, token_ids: Any, **kwargs: Any) -> Any:
        return ForwardResult(np.asarray(token_ids, dtype=np.int64) + 1)


# -- admission ----------------------------------------------------------------------------


class Prompts:
    """64 prompts per round: even ones start with one of 8 cached prefixes."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.prefix_tokens = prompt_tokens // 2
        self.next_token = 1
        self.prefixes = [self.fresh(self.prefix_tokens) for _ in range(GROUPS)]

    def fresh(self, count: int) -> list[int]:
        self.next_token += count
        return list(range(self.next_token - count, self.next_token))

    def round(self) -> list[list[int]]:
        return [
            self.prefixes[i // 2 % GROUPS] + self.fresh(self.prompt_tokens - self.prefix_tokens)
            if i % 2 == 0
            else self.fresh(self.prompt_tokens)
            for i in range(ADMITTED)
        ]


async def cache_prefixes(mem: Any, prefixes: list[list[int]]) -> None:
    rids = [f"warm{i}" for i in range(len(prefixes))]
    for rid in rids:
        await mem.alloc_row(rid)
    await mem.alloc_extend([(rid, len(p)) for rid, p in zip(rids, prefixes, strict=True)])
    for rid, prefix in zip(rids, prefixes, strict=True):
        await mem.release(rid, prefix)


async def admission_round(
    mem: Any, pool: Pool, prompts: list[list[int]], tag: str
) -> tuple[float, list[str]]:
    """Seconds and memsvc ops from the first step until every prompt runs; then undone."""
    config = SchedulerConfig(
        page_size=pool.page_size, max_running_requests=ADMITTED, max_prefill_tokens=1 << 22
    )
    capacity = pool.num_pages * pool.page_size
    engine = Engine(config, mem, StubModel(), lambda req, finished: None, capacity=capacity)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=8, draw={"temperature": 0.0})
        engine.submit(Req(f"{tag}-{i}", prompt, params))
    mem.ops.clear()
    started = time.perf_counter()
    for _ in range(ADMITTED):
        await engine.step()
        if len(engine.running) == ADMITTED:
            break
    else:
        raise RuntimeError(f"only {len(engine.running)} of {ADMITTED} prompts were admitted")
    seconds, ops = time.perf_counter() - started, list(mem.ops)
    for req in engine.running:
        await mem.free_row(req.rid)
    return seconds, ops


async def admission_page(page_size: int, args: argparse.Namespace) -> dict[str, Any]:
    prompts = Prompts(args.admission_prompt_tokens)
    tokens = max(args.pool_tokens, 4 * ADMITTED * args.admission_prompt_tokens)
    pool = Pool(page_size, -(-tokens // page_size), ADMITTED + GROUPS + 8, 4096)
    samples: dict[str, list[float]] = {"process": [], "inproc": []}
    ops: dict[str, list[str]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="control-plane-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        launcher = stack.enter_context(Launcher(Path(tmp), stop_timeout=10))
        address = launcher.start("memsvc", *pool.cli(), timeout=120).address
        kv = stack.enter_context(KVPool(pool.layout))
        clients = {
            "process": await CountingAsyncMemClient.connect(
                address, name="bench-admission", lease_s=600, heartbeat=False
            ),
            "inproc": await CountingInProcessMem.connect(MemService(kv, ServiceConfig())),
        }
        try:
            for repeat in range(args.admission_repeats):
                batch = prompts.round()
                for name, mem in clients.items():
                    await cache_prefixes(mem, prompts.prefixes)
                    seconds, ops[name] = await admission_round(mem, pool, batch, f"r{repeat}")
                    samples[name].append(seconds)
                    await mem.flush_cache()
            await clients["process"].check(idle=True)
            kv.check_integrity(idle=True)
        finally:
            await clients["process"].close()
    return {
        "page_size": page_size,
        "prompts": ADMITTED,
        "prompt_tokens": args.admission_prompt_tokens,
        "round_trips": len(ops["process"]),
        "round_trips_inproc": len(ops["inproc"]),
        "ops": dict(Counter(ops["process"])),
        "process_ms": round(statistics.median(samples["process"]) * 1e3, 2),
        "inproc_ms": round(statistics.median(samples["inproc"]) * 1e3, 2),
    }


def bench_admission(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    rows = [asyncio.run(admission_page(ps, args)) for ps in args.page_sizes]
    lines = [
        f"admission of {ADMITTED} prompts of {args.admission_prompt_tokens} tokens (half "
        f"sharing {GROUPS} cached prefixes) by the engine, stub model, median of "
        f"{args.admission_repeats}: memsvc round trips, ms against the process / in process",
        f"{'page':>4} {'trips':>6} {'process ms':>11} {'inproc ms':>10}  ops",
    ]
    lines += [
        f"{r['page_size']:>4} {r['round_trips']:>6} {r['process_ms']:>11} {r['inproc_ms']:>10}  "
        + ", ".join(f"{op} {n}" for op, n in r["ops"].items())
        for r in rows
    ]
    return lines, {
        "admission": rows,
        "admission_64_round_trips": max(r["round_trips"] for r in rows),
    }


# -- overlap --------------------------------------------------------------------------------


class TimedModel:
    """The model client, each ``decode`` timed from when it starts until it returns."""

    def __init__(self, model: AsyncModelClient) -> None:
        self.model = model
        self.intervals: list[tuple[float, float]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    async def decode(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await self.model.decode(*args, **kwargs)
        finally:
            self.intervals.append((started, time.perf_counter()))


def covered(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] inside at least one of ``intervals``."""
    total, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            total += b - a
            reach = b
    return total


def with_overlap(config: SchedulerConfig, on: bool) -> SchedulerConfig:
    if not hasattr(config, OVERLAP_FIELD):
        return config
    return dataclasses.replace(config, **{OVERLAP_FIELD: not on})


async def overlap_batch(
    mem_address: str, model_address: str, page_size: int, batch: int, args: argparse.Namespace
) -> dict[str, Any]:
    steps = args.overlap_rounds * 2 * args.overlap_steps
    config = SchedulerConfig(
        page_size=page_size, max_running_requests=batch, max_prefill_tokens=1 << 22
    )
    mem = await CountingAsyncMemClient.connect(mem_address, name="bench-overlap", lease_s=600)
    model = TimedModel(AsyncModelClient(model_address))
    try:
        capacity = mem.layout.num_pages * page_size
        engine = Engine(config, mem, model, lambda req, finished: None, capacity=capacity)
        rng = np.random.default_rng(args.seed)
        for i in range(batch):
            prompt = rng.integers(0, 256, PROMPT_BYTES).tolist()
            params = SamplingParams(max_new_tokens=steps + 16, draw={"temperature": 0.0})
            engine.submit(Req(f"overlap{batch}-{i}", prompt, params))
        while len(engine.running) < batch:
            await engine.step()
        for _ in range(3):  # warm-up
            await engine.step()
        wall = {True: 0.0, False: 0.0}
        forward = {True: 0.0, False: 0.0}
        memsvc = {True: 0.0, False: 0.0}  # a memsvc call in flight and no forward pass
        reserved = {True: 0, False: 0}  # steps whose next step memsvc reserved during them
        for _ in range(args.overlap_rounds):
            for on in (True, False):
                engine.config = with_overlap(config, on)
                model.intervals.clear()
                mem.intervals.clear()
                ahead = getattr(engine.stats, "reserved_ahead_steps", 0)
                start = time.perf_counter()
                for _ in range(args.overlap_steps):
                    await engine.step()
                end = time.perf_counter()
                reserved[on] += getattr(engine.stats, "reserved_ahead_steps", 0) - ahead
                wall[on] += end - start
                forward[on] += covered(model.intervals, start, end)
                either = covered(model.intervals + mem.intervals, start, end)
                memsvc[on] += either - covered(model.intervals, start, end)
        if len(engine.running) != batch:
            raise RuntimeError("a request finished during the measurement")
    finally:
        await mem.close()  # its goodbye frees the rows
        await model.close()
    row: dict[str, Any] = {"page_size": page_size, "batch": batch}
    for on, name in ((True, "on"), (False, "off")):
        row[f"step_ms_{name}"] = round(wall[on] / (steps / 2) * 1e3, 2)
        row[f"exposed_{name}"] = round(1 - forward[on] / wall[on], 4)
        row[f"exposed_memsvc_{name}"] = round(memsvc[on] / wall[on], 4)
        row[f"reserved_ahead_{name}"] = reserved[on]
    return row


def bench_overlap(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    from model_svc.tiny import write_tiny_checkpoint  # imports torch: only here

    rows = []
    longest = PROMPT_BYTES + args.overlap_rounds * 2 * args.overlap_steps + 32
    with tempfile.TemporaryDirectory(prefix="control-plane-") as tmp:
        checkpoint = write_tiny_checkpoint(Path(tmp) / "tiny-llama")
        for page_size in args.page_sizes:
            pages = max(args.overlap_batches) * (-(-longest // page_size) + 1) + 64
            pool = [
                "--page-size", str(page_size), "--num-pages", str(pages),
                "--max-running-requests", str(max(args.overlap_batches) + 8),
                "--max-context-len", str(longest + 2 * page_size), "--log-level", "WARNING",
            ]  # fmt: skip
            with Launcher(Path(tmp), stop_timeout=10) as launcher:
                mem = launcher.start("memsvc", *pool_layout_args(checkpoint), *pool)
                model = launcher.start(
                    "model_svc", "--memsvc", mem.address, "--checkpoint", str(checkpoint),
                    "--threads", str(worker_threads(1)), "--log-level", "WARNING",
                    timeout=model_ready_timeout(checkpoint),
                )  # fmt: skip
                for batch in args.overlap_batches:
                    rows.append(
                        asyncio.run(
                            overlap_batch(mem.address, model.address, page_size, batch, args)
                        )
                    )
    has_flag = OVERLAP_FIELD in {f.name for f in dataclasses.fields(SchedulerConfig)}
    lines = [
        "share of decode step wall time with no forward pass in flight (tiny model, "
        f"{args.overlap_rounds} x {args.overlap_steps} steps each way, alternating); of it, "
        "with a memsvc call in flight"
        + ("" if has_flag else "; this engine has no overlap schedule: on = off"),
        f"{'page':>4} {'batch':>5} | overlap on: {'step ms':>7} {'exposed':>7} {'memsvc':>7} |"
        f" off: {'step ms':>7} {'exposed':>7} {'memsvc':>7}",
    ]
    lines += [
        f"{r['page_size']:>4} {r['batch']:>5} |             {r['step_ms_on']:>7}"
        f" {r['exposed_on']:>7.2%} {r['exposed_memsvc_on']:>7.2%} |      {r['step_ms_off']:>7}"
        f" {r['exposed_off']:>7.2%} {r['exposed_memsvc_off']:>7.2%}"
        for r in rows
    ]
    at = [r for r in rows if r["batch"] == max(args.overlap_batches)]
    return lines, {
        "overlap": rows,
        "overlap_schedule_in_engine": has_flag,
        "overlap_batch": max(args.overlap_batches),
        "exposed_share_overlap_on": max(r["exposed_on"] for r in at),
        "exposed_share_overlap_off": max(r["exposed_off"] for r in at),
    }
