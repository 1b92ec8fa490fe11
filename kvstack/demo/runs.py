"""The demo's three runs, each on a stack of its own, and what is measured while they go.

:func:`execute` starts, one after the other, a normal-mode stack and a PD stack
(each with a :data:`SMALL_PAGES` pool on the node that decodes) and a reference
stack whose pool is big enough that nothing is retracted; each gets the same
requests, all at once, while a :class:`Sampler` thread polls memsvc and the
scheduler (or router). Each run ends with memsvc's idle check. Its
:class:`RunResult` is what :mod:`kvstack.demo.report` and :mod:`kvstack.demo.plots`
show.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvstack.demo.workload import Request
from kvstack.stack.launch import Launcher
from memsvc.client import MemClient
from scheduler_svc.client import AsyncGenerateClient, GenerateClient

PAGE_SIZE = 4
SMALL_PAGES = 64  # 256 tokens: the pool under pressure (the decode node's, in PD mode)
PREFILL_PAGES = 256  # the PD prefill node's pool: it only holds prompts until sent
BIG_PAGES = 2048  # the reference: nothing is retracted
POOL = ["--page-size", str(PAGE_SIZE), "--max-running-requests", "32", "--max-context-len", "1024"]
PRESSURE = ["--schedule-conservativeness", "0.3"]
PD_SCHEDULER = ["--num-reserved-decode-tokens", "8"]
CALIBRATION_LEN = 192  # prompt tokens of the request that measures prefill speed

# -- sampling --------------------------------------------------------------------------


@dataclass
class Sample:
    t: float  # seconds since the run started
    used: int  # capacity - available: tokens held by requests or cached (the full pool's)
    evictable: int
    new_token_ratio: float
    queues: dict[str, int]
    retract_events: int
    swa_used: int | None = None  # a hybrid model's SWA pool, held or cached (else None)


class Sampler:
    """A thread that polls memsvc (pool sizes) and a scheduler or router (``info``)."""

    def __init__(
        self,
        mem_address: str,
        sched_address: str,
        interval_s: float,
        on_sample: Callable[[Sample], None] = lambda sample: None,
    ) -> None:
        self.interval_s = interval_s
        self.on_sample = on_sample
        self.samples: list[Sample] = []
        self.mem = MemClient(mem_address, heartbeat=False, timeout_s=2.0, retries=0)
        layout = self.mem.layout
        self.capacity = layout.capacity_tokens
        self.swa_capacity = layout.swa_capacity_tokens if layout.is_hybrid else None
        self.bytes_per_token = layout.bytes_per_token
        self.sched = GenerateClient(sched_address, timeout_s=2.0)
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="demo-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(Exception):
            self.sample()  # the state at the end
        self.sched.close()
        self.mem.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(Exception):  # a slow reply: skip this sample
                self.sample()

    def sample(self) -> None:
        self.mem.heartbeat()  # every reply carries the pool's sizes
        sizes = self.mem.sizes
        info = self.sched.info()
        # a hybrid pool's ``available`` is the smaller pool's; each pool has its own
        full = sizes.available if sizes.full_available is None else sizes.full_available
        swa = sizes.swa_available
        sample = Sample(
            t=time.monotonic() - self.t0,
            used=self.capacity - full,
            evictable=sizes.evictable,
            new_token_ratio=float(info["new_token_ratio"]),
            queues=queue_lengths(info),
            retract_events=int(info["stats"]["retract_events"]),
            swa_used=None if self.swa_capacity is None or swa is None else self.swa_capacity - swa,
        )
        self.samples.append(sample)
        self.on_sample(sample)


def queue_lengths(info: dict[str, Any]) -> dict[str, int]:
    """The decode node's queues in PD mode; running / waiting in normal mode."""
    if "queues" in info:
        return dict(info["queues"])
    return {"running": info["num_running"], "waiting": info["num_waiting"]}


# -- one run ---------------------------------------------------------------------------


@dataclass
class RunResult:
    name: str
    outputs: dict[str, list[int]]
    # SGLang's: {"type": "stop" | "length" | "abort", ...}; an abort's has "message" and
    # "status_code"
    finish_reasons: dict[str, dict[str, Any]]
    latencies: list[float]
    seconds: float
    stats: dict[str, Any]  # the scheduler's (the decode node's, in PD mode) engine stats
    bytes_per_token: int = 0
    capacity: int = 0
    swa_capacity: int | None = None  # a hybrid model's SWA pool (None: one pool)
    samples: list[Sample] = field(default_factory=list)
    prefill_tokens_per_s: float = 0.0  # measured on the reference run only
    retractions: dict[str, int] = field(default_factory=dict)  # rid -> times retracted

    @property
    def aborts(self) -> dict[str, dict[str, Any]]:
        """The finish reason of each aborted request, by rid."""
        return {
            rid: reason
            for rid, reason in self.finish_reasons.items()
            if reason.get("type") == "abort"
        }


async def drive(address: str, reqs: list[Request], progress: Progress, task: Any) -> RunResult:
    """Submit every request at once; advance ``task`` as each one completes."""
    started = time.monotonic()
    latencies: list[float] = []

    async def one(client: AsyncGenerateClient, rid: str, prompt: list[int], n: int):
        result = await client.generate(prompt, rid=rid, sampling={"max_new_tokens": n})
        latencies.append(time.monotonic() - started)
        progress.advance(task)
        return result

    async with AsyncGenerateClient(address, timeout_s=300) as client:
        results = await asyncio.gather(*(one(client, *req) for req in reqs))
        seconds = time.monotonic() - started
        stats = (await client.info())["stats"]
    return RunResult(
        name="",
        outputs={r.rid: list(r.output_ids) for r in results},
        finish_reasons={r.rid: dict(r.finish_reason or {}) for r in results},
        latencies=sorted(latencies),
        seconds=seconds,
        stats=stats,
        retractions={r.rid: int(r.meta_info.get("num_retractions") or 0) for r in results},
    )


def measured_run(
    name: str, mem: str, front: str, reqs: list[Request], progress: Progress, interval_s: float
) -> RunResult:
    """``drive`` with a :class:`Sampler` on memsvc ``mem`` and scheduler / router ``front``."""
    task = progress.add_task(name, total=len(reqs), retracts=0)

    def show(sample: Sample) -> None:
        progress.update(task, retracts=sample.retract_events)

    with Sampler(mem, front, interval_s, show) as sampler:
        result = asyncio.run(drive(front, reqs, progress, task))
    result.name, result.samples = name, sampler.samples
    result.bytes_per_token, result.capacity = sampler.bytes_per_token, sampler.capacity
    result.swa_capacity = sampler.swa_capacity
    progress.update(task, retracts=result.stats["retract_events"])
    return result


def idle_check(*addresses: str) -> None:
    """Every page back where it belongs and the host store empty, on each memsvc."""
    for address in addresses:
        with MemClient(address) as mem:
            mem.check(idle=True)
            entries = mem.stats()["host_store_entries"]
            if entries:
                raise AssertionError(f"memsvc at {address} still holds {entries} host entries")


def run_normal(launcher: Launcher, checkpoint: Path, reqs, progress, interval_s) -> RunResult:
    pool = [*POOL, "--num-pages", str(SMALL_PAGES)]
    mem, _, sched = launcher.start_normal_stack(checkpoint, pool, PRESSURE, suffix="-normal")
    result = measured_run("normal", mem.address, sched.address, reqs, progress, interval_s)
    idle_check(mem.address)
    return result


def run_pd(launcher: Launcher, checkpoint: Path, reqs, progress, interval_s) -> RunResult:
    up = launcher.start_pd_stack(
        checkpoint,
        [*POOL, "--num-pages", str(PREFILL_PAGES)],
        PD_SCHEDULER,
        decode_pool=["--num-pages", str(SMALL_PAGES)],
        decode_scheduler=PRESSURE,
        suffix="-pd",
    )
    mem_d = up["memsvc-d"].address
    result = measured_run("PD", mem_d, up["router"].address, reqs, progress, interval_s)
    idle_check(up["memsvc-p"].address, mem_d)
    return result


def run_reference(launcher: Launcher, checkpoint: Path, reqs, progress, interval_s) -> RunResult:
    pool = [*POOL, "--num-pages", str(BIG_PAGES)]
    mem, _, sched = launcher.start_normal_stack(checkpoint, pool, suffix="-reference")
    result = measured_run("reference", mem.address, sched.address, reqs, progress, interval_s)
    result.prefill_tokens_per_s = measure_prefill(sched.address)
    idle_check(mem.address)
    return result


def measure_prefill(address: str) -> float:
    """Prefill tokens/s of the idle stack: one fresh prompt, one output token."""
    rng = random.Random(1234)
    prompt = [rng.randrange(256) for _ in range(CALIBRATION_LEN)]
    with GenerateClient(address, timeout_s=60) as client:
        started = time.monotonic()
        client.generate(prompt, rid="calibration", sampling={"max_new_tokens": 1})
        return CALIBRATION_LEN / max(time.monotonic() - started, 1e-6)


def measure_copy_bytes_per_s(nbytes: int = 16 << 20) -> float:
    """memcpy bandwidth of this machine (an offload or load is one copy per run of pages)."""
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return nbytes / max(best, 1e-9)


def execute(checkpoint: Path, reqs, console: Console, interval_s: float, workdir: Path):
    """The three runs, each on its own stack (in a folder of ``workdir``), stopped before
    the next starts."""
    runs: dict[str, RunResult] = {}
    columns = (
        TextColumn("{task.description:<10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("retracts {task.fields[retracts]}"),
        TimeElapsedColumn(),
    )
    leaked: list[str] = []
    with Progress(*columns, console=console) as progress:
        for name, runner in (("normal", run_normal), ("PD", run_pd), ("reference", run_reference)):
            (workdir / name).mkdir()
            launcher = Launcher(workdir / name)
            with launcher:
                runs[name] = runner(launcher, checkpoint, reqs, progress, interval_s)
            leaked += launcher.leaked_segments
    return runs, leaked
