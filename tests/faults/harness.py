"""Seeded fault scenarios against a supervised stack (normal or PD mode) under KV pressure.

:class:`FaultHarness` starts one stack under :class:`Supervisor` (memsvc +
model_svc + scheduler_svc, a 256-token pool and a low schedule
conservativeness, so the workload below forces retracts) with a
:class:`FaultProxy` on each of the scheduler's links (to memsvc, to model_svc)
and one in front of the scheduler, and computes the fault-free reference
outputs (greedy) once. Each :class:`Scenario` then runs the same workload
under new rids (streaming, so delivery is checked chunk by chunk) and injects
one fault at a seeded point (after a number of streamed tokens):

==========================  ===================================================
``kill_memsvc``              SIGKILL memsvc (restarted: new epoch, empty pool)
``kill_model_svc``           SIGKILL model_svc
``kill_scheduler_svc``       SIGKILL the scheduler (clients re-submit)
``kill_memsvc_in_retract``   SIGKILL memsvc the moment a ``retract`` op passes
``stall``                    SIGSTOP one process longer than the timeouts, then SIGCONT
``wire``                     drop / duplicate / delay / garble / truncate messages
                             on every link for a while
==========================  ===================================================

With ``mode="pd"`` the stack is the PD one (``pd_stack``: both nodes and the
router; the decode node has the 256-token pool and retracts to its host store,
the prefill node twice that), clients talk to the router, and the one proxy
sits between the router and the decode scheduler. The last four short jobs are
submitted only once the others have streamed 20 tokens, so that a fault on the
prefill node (done with the first wave early) meets prefill work. Its
scenarios (:data:`PD_KINDS`):

==========================  ===================================================
``kill_<process>``           SIGKILL any of the seven (``kill_memsvc-p``,
                             ``kill_memsvc-d``, ``kill_scheduler-p``, ...)
``stall``                    SIGSTOP the prefill scheduler, memsvc-d or
                             model_svc-d past the timeouts, then SIGCONT
``wire``                     damage messages between the router and the decode
                             scheduler
==========================  ===================================================

With ``storage=True`` (either mode) every memsvc runs the hierarchical cache with
a file storage tier, all of them on one ``--hicache-storage-dir`` (issue 26: the
PD nodes', and a restarted memsvc's, pages must never collide), and one more
kind, ``damage_storage``: before the workload starts, every memsvc flushes its
device tier (what it cached goes down to host and disk), then a seeded half of
the page files there are flipped, zeroed, cut short, swapped or linked: the
requests that meet them recompute what they lose, and the tokens do not change.

After each scenario it checks: every request finished with the reference
tokens (and its stream delivered each token once, in order) or ended with an
explicit error; none was lost (the harness deadline is the only way to be
lost); the stack is healthy again and idle (in PD: both schedulers' queues and
the router's flights empty); every memsvc passes its idle invariant with no
page held and no host-store byte used; no process the supervisor started is
left over besides the live ones, and no shared-memory segment of a dead one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstack.stack.spec import StackOptions, normal_stack, pd_stack
from kvstack.up.cli import pid_alive
from kvstack.up.supervisor import RestartPolicy, Supervisor
from memsvc.client import MemClient
from memsvc.core.backends.shm import list_segments, segment_owner_pid
from scheduler_svc.client import AsyncGenerateClient, Chunk, GenerateClient, GenerateError
from tests.core.storage_faults import damage_file
from tests.faults.proxy import FaultPlan, FaultProxy

PAGE_SIZE = 4
NUM_PAGES = 64  # 256 tokens: the long request takes most of it
POOL = [
    "--page-size",
    str(PAGE_SIZE),
    "--num-pages",
    str(NUM_PAGES),
    "--max-running-requests",
    "32",
    "--max-context-len",
    "512",
]
# Short timeouts so that faults are noticed in seconds; generous enough for 2 slow cores.
MEMSVC_TIMEOUT_S, MEMSVC_LEASE_S, WORKER_TIMEOUT_S = 1.5, 4.0, 5.0
SCHEDULER = [
    "--schedule-conservativeness",
    "0.3",
    "--memsvc-timeout",
    str(MEMSVC_TIMEOUT_S),
    "--memsvc-lease",
    str(MEMSVC_LEASE_S),
    "--worker-timeout",
    str(WORKER_TIMEOUT_S),
    "--recovery-timeout",
    "90",
]
# SGLang's own test knob adds a retract every few forward passes on top of the
# pool's pressure, so that every scenario retracts (and a retract can be hit).
SCHEDULER_ENV = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "8"}
CLIENT_TIMEOUT_S = 15.0
CLIENT_RESUBMITS = 6
SCENARIO_DEADLINE_S = 240.0  # a request still open by then is "lost"
SETTLE_TIMEOUT_S = 60.0
# How long each process is stopped in a stall: longer than what notices it
# (memsvc: 3 tries of the op timeout, and the lease; model_svc: 2 forward
# timeouts; scheduler: the client's silence timeout).
STALL_S = {"memsvc": 6.0, "model_svc": 11.0, "scheduler_svc": CLIENT_TIMEOUT_S + 2}
WIRE_PLAN = FaultPlan(drop=0.02, duplicate=0.04, delay=0.05, garble=0.02, truncate=0.02)
WIRE_FAULTS = 24  # damage this many messages (across the links), then stop

KINDS = (
    "kill_model_svc",
    "kill_memsvc",
    "kill_scheduler_svc",
    "kill_memsvc_in_retract",
    "stall",
    "wire",
)
SERVICES = ("memsvc", "model_svc", "scheduler_svc")

# PD mode: the prefill node's pool is twice the decode node's, which has the pressure.
PD_POOL = [*POOL[:2], "--num-pages", str(2 * NUM_PAGES), *POOL[4:]]
PD_DECODE_POOL = ["--num-pages", str(NUM_PAGES)]
PD_DECODE_SCHEDULER = ["--num-reserved-decode-tokens", "8"]
PD_LATE_JOBS, PD_LATE_AFTER_TOKENS = 4, 20
PREFILL_TIMEOUT_S = 8.0  # the router fails what waits on a silent prefill scheduler
TRANSFER_TIMEOUT_S = 8.0
PD_SERVICES = (
    "memsvc-d",
    "memsvc-p",
    "model_svc-d",
    "model_svc-p",
    "scheduler-d",
    "scheduler-p",
    "router",
)
PD_KINDS = (*(f"kill_{name}" for name in PD_SERVICES), "stall", "wire")
# storage=True: the file tier, all memsvc on one base directory, and its own fault kind.
STORAGE_ARGS = [
    "--enable-hierarchical-cache",
    "--hicache-ratio",
    "0.32",  # a host tier a third of the pool (the long prompt fits): the rest goes to disk
    "--hicache-storage-backend",
    "file",
]
STORAGE_KIND = "damage_storage"
# A deleted page is a miss too, but one never read again stays "missing" for the idle
# check (which compares the files with the index): the kinds that leave a file in place.
STORAGE_DAMAGE = ("truncate", "corrupt", "zero", "swap", "symlink")
STORAGE_DAMAGED_SHARE = 0.5
PD_STALL_TARGETS = ("scheduler-p", "memsvc-d", "model_svc-d")
STALL_S.update(
    {
        "scheduler-p": CLIENT_TIMEOUT_S + 2,
        "scheduler-d": CLIENT_TIMEOUT_S + 2,
        "router": CLIENT_TIMEOUT_S + 2,
        "memsvc-d": STALL_S["memsvc"],
        "memsvc-p": STALL_S["memsvc"],
        "model_svc-d": STALL_S["model_svc"],
        "model_svc-p": STALL_S["model_svc"],
    }
)


@dataclass(frozen=True)
class Job:
    name: str
    prompt: list[int]
    max_new: int


def workload(seed: int, count: int = 12) -> list[Job]:
    """One request whose prompt takes most of the pool, and shorter ones (as in the demo).

    Outputs are longer than the demo's so that decoding runs out of pages.
    """
    rng = random.Random(seed)
    jobs = [Job("long", [rng.randrange(256) for _ in range(int(PAGE_SIZE * NUM_PAGES * 0.6))], 60)]
    for i in range(count):
        prompt = [rng.randrange(256) for _ in range(rng.randint(4, 24))]
        jobs.append(Job(f"short-{i}", prompt, rng.randint(16, 60)))
    return jobs


@dataclass(frozen=True)
class Scenario:
    index: int
    kind: str
    target: str | None  # the process a kill or stall hits
    trigger_tokens: int  # inject after this many streamed tokens

    @property
    def label(self) -> str:
        return f"#{self.index} {self.kind}" + (f" {self.target}" if self.target else "")


@dataclass
class Outcome:
    job: str
    status: str  # identical | error | mismatch | lost
    detail: str = ""
    retractions: int = 0


@dataclass
class ScenarioResult:
    scenario: Scenario
    outcomes: list[Outcome]
    faults: Counter
    problems: list[str] = field(default_factory=list)  # failed checks
    pages_leaked: int = 0
    host_bytes_left: int = 0
    seconds: float = 0.0

    def count(self, status: str) -> int:
        return sum(1 for o in self.outcomes if o.status == status)

    @property
    def retractions(self) -> int:
        return sum(o.retractions for o in self.outcomes)

    @property
    def ok(self) -> bool:
        return not self.problems and self.count("lost") == 0 and self.count("mismatch") == 0


@dataclass
class Totals:
    """What the soak prints."""

    scenarios: int = 0
    faults: Counter = field(default_factory=Counter)
    accepted: int = 0
    retractions: int = 0
    identical: int = 0
    errors: int = 0
    mismatched: int = 0
    lost: int = 0
    pages_leaked: int = 0
    host_bytes_left: int = 0
    problems: list[str] = field(default_factory=list)

    def add(self, result: ScenarioResult) -> None:
        self.scenarios += 1
        self.faults.update(result.faults)
        self.accepted += len(result.outcomes)
        self.retractions += result.retractions
        self.identical += result.count("identical")
        self.errors += result.count("error")
        self.mismatched += result.count("mismatch")
        self.lost += result.count("lost")
        self.pages_leaked += result.pages_leaked
        self.host_bytes_left += result.host_bytes_left
        self.problems += [f"{result.scenario.label}: {p}" for p in result.problems]

    def as_dict(self) -> dict[str, Any]:
        return {
            "scenarios_run": self.scenarios,
            "faults_injected": dict(sorted(self.faults.items())),
            "requests_accepted": self.accepted,
            "retractions": self.retractions,
            "completed_identical": self.identical,
            "ended_with_error": self.errors,
            "mismatched": self.mismatched,
            "lost": self.lost,
            "pages_leaked": self.pages_leaked,
            "host_store_bytes_left": self.host_bytes_left,
            "problems": self.problems,
        }


class _Progress:
    """Streamed tokens so far, and events once the fault's threshold and the late start pass."""

    def __init__(self, threshold: int, late_after: int = 0) -> None:
        self.tokens = 0
        self.threshold = threshold
        self.late_after = late_after
        self.reached = asyncio.Event()
        self.late = asyncio.Event()
        if late_after <= 0:
            self.late.set()

    def add(self, count: int) -> None:
        self.tokens += count
        if self.tokens >= self.threshold:
            self.reached.set()
        if self.tokens >= self.late_after:
            self.late.set()


class FaultHarness:
    """``with FaultHarness(dir, seed) as h: h.run(h.scenario(0, "kill_memsvc"))``.

    ``mode``: ``normal`` or ``pd`` (see the module docstring).
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        seed: int,
        *,
        checkpoint: str | None = None,
        mode: str = "normal",
        storage: bool = False,
    ) -> None:
        self.workdir = Path(workdir)
        self.seed = seed
        self.mode = mode
        self.storage_dir = self.workdir / "disk" if storage else None
        tier = [*STORAGE_ARGS, "--hicache-storage-dir", str(self.storage_dir)] if storage else []
        self.rng = random.Random(seed)
        self.jobs = workload(seed)
        self.reference: dict[str, list[int]] = {}
        self._stack = contextlib.ExitStack()
        run_dir = self.workdir / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        self._retract_trap = threading.Event()  # armed: kill memsvc when a retract passes
        self.retract_kills = 0
        self.leftovers: list[str] = []  # what stopping the stack found left behind
        # Jobs submitted only once the others streamed late_after tokens (PD: so that a
        # fault on the prefill node, which is done with the first wave early, meets work).
        self.late: set[str] = set()
        self.late_after = 0
        policy = RestartPolicy(initial_s=0.2, max_s=3.0, stable_s=5.0, ready_timeout_s=180.0)
        if mode == "pd":
            self.late = {job.name for job in self.jobs[-PD_LATE_JOBS:]}
            self.late_after = PD_LATE_AFTER_TOKENS
            self.kinds, self.services, self.stall_targets = PD_KINDS, PD_SERVICES, PD_STALL_TARGETS
            self.kinds += (STORAGE_KIND,) if storage else ()
            self.proxies = {
                "decode": FaultProxy(
                    f"ipc://{run_dir}/via-decode.sock",
                    f"ipc://{run_dir}/scheduler-d.sock",
                    seed=seed * 3 + 1,
                    name="proxy-decode",
                )
            }
            options = StackOptions(
                checkpoint=checkpoint,
                memsvc_args=[*PD_POOL, *tier],
                decode_memsvc_args=PD_DECODE_POOL,
                scheduler_args=SCHEDULER,
                decode_scheduler_args=PD_DECODE_SCHEDULER,
                router_args=["--prefill-timeout", str(PREFILL_TIMEOUT_S)],
                env=SCHEDULER_ENV,
                via={"scheduler-d": self.proxies["decode"].front},
                transfer_backend="zmq",
                transfer_timeout=TRANSFER_TIMEOUT_S,
            )
            specs = pd_stack(run_dir, options)
            self.supervisor = Supervisor(
                specs,
                run_dir,
                mode="pd",
                policy=policy,
                health_interval_s=2.0,
                health_timeout_s=5.0,
            )
            return
        self.kinds, self.services, self.stall_targets = KINDS, SERVICES, SERVICES
        self.kinds += (STORAGE_KIND,) if storage else ()
        self.proxies = {
            "memsvc": FaultProxy(
                f"ipc://{run_dir}/via-memsvc.sock",
                f"ipc://{run_dir}/memsvc.sock",
                seed=seed * 3 + 1,
                name="proxy-memsvc",
                on_request=self._watch_memsvc,
            ),
            "model_svc": FaultProxy(
                f"ipc://{run_dir}/via-model.sock",
                f"ipc://{run_dir}/model_svc.sock",
                seed=seed * 3 + 2,
                name="proxy-model",
            ),
            "client": FaultProxy(
                f"ipc://{run_dir}/via-scheduler.sock",
                f"ipc://{run_dir}/scheduler_svc.sock",
                seed=seed * 3 + 3,
                name="proxy-client",
            ),
        }
        options = StackOptions(
            checkpoint=checkpoint,
            memsvc_args=[*POOL, *tier],
            scheduler_args=SCHEDULER,
            env=SCHEDULER_ENV,
            via={name: self.proxies[name].front for name in ("memsvc", "model_svc")},
        )
        self.supervisor = Supervisor(
            normal_stack(run_dir, options),
            run_dir,
            policy=policy,
            health_interval_s=2.0,
            health_timeout_s=5.0,
        )

    # -- life ----------------------------------------------------------------------

    def __enter__(self) -> FaultHarness:
        try:
            for proxy in self.proxies.values():
                self._stack.enter_context(proxy)
            self._stack.enter_context(self.supervisor.running())
            self.reference = self._reference()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        pids = self.supervisor.all_pids()
        self._stack.close()
        alive = sorted(pid for pid in pids if pid_alive(pid))
        segments = [n for n in list_segments() if segment_owner_pid(n) in pids]
        if alive:
            self.leftovers.append(f"processes still alive after stop: {alive}")
        if segments:
            self.leftovers.append(f"shm segments left after stop: {segments}")

    @property
    def scheduler(self) -> str:
        """Where clients send requests: the scheduler, or in PD mode the router."""
        return self.supervisor.address("router" if self.mode == "pd" else "scheduler_svc")

    def info(self) -> dict[str, Any]:
        """The front's ``info`` (in PD mode the router's: the decode node's, and the prefill's)."""
        with GenerateClient(self.scheduler, timeout_s=10, resubmits=0) as client:
            return client.info()

    @property
    def memsvcs(self) -> list[str]:
        return ["memsvc-d", "memsvc-p"] if self.mode == "pd" else ["memsvc"]

    def _reference(self) -> dict[str, list[int]]:
        progress = _Progress(1 << 30, self.late_after)
        streams = asyncio.run(self._drive(self.scheduler, "ref", progress, None))
        failed = {name: s for name, s in streams.items() if s.status != "identical"}
        if failed:
            raise RuntimeError(f"the fault-free run failed: {failed}")
        return {name: stream.tokens for name, stream in streams.items()}

    # -- scenarios -------------------------------------------------------------------

    def scenario(
        self,
        index: int,
        kind: str | None = None,
        target: str | None = None,
        trigger: int | None = None,
    ) -> Scenario:
        """A seeded scenario: ``kind``, ``target`` and ``trigger`` drawn when not given."""
        kind = kind or self.rng.choice(self.kinds)
        if target is None and kind == "stall":
            target = self.rng.choice(self.stall_targets)
        elif kind.startswith("kill_"):
            target = "memsvc" if kind == "kill_memsvc_in_retract" else kind[len("kill_") :]
        total = sum(job.max_new for job in self.jobs)
        latest = total // 3
        if kind == "wire":
            latest = 40  # wire faults start early: they need traffic left to damage
        elif target is not None and target.endswith("-p"):
            latest = 30  # the prefill node is busy only while the decode node catches up
        drawn = self.rng.randint(5, latest)
        return Scenario(index, kind, target, drawn if trigger is None else trigger)

    def run(self, scenario: Scenario) -> ScenarioResult:
        """Run the workload with ``scenario``'s fault, then check the stack."""
        started = time.monotonic()
        restarts_before = {name: self.supervisor[name].restarts for name in self.services}
        faults: Counter = Counter()
        via_proxy = scenario.kind == "wire" and "client" in self.proxies
        address = self.proxies["client"].front if via_proxy else self.scheduler
        progress = _Progress(scenario.trigger_tokens, self.late_after)
        if scenario.kind == STORAGE_KIND:  # before any request: the first matches meet it
            self._damage_storage(scenario, faults)
        outcomes = asyncio.run(
            self._drive(address, f"s{scenario.index}", progress, (scenario, faults))
        )
        result = ScenarioResult(scenario, [], faults)
        for name, outcome in outcomes.items():
            result.outcomes.append(self._judge(name, outcome))
        self._settle(result)
        restarts = {n: self.supervisor[n].restarts - restarts_before[n] for n in self.services}
        if scenario.kind.startswith("kill_") and faults and restarts[scenario.target] < 1:
            result.problems.append(f"{scenario.target} was killed but not restarted: {restarts}")
        result.seconds = time.monotonic() - started
        return result

    async def _drive(
        self,
        address: str,
        prefix: str,
        progress: _Progress,
        fault: tuple[Scenario, Counter] | None,
    ) -> dict[str, _Stream]:
        async with AsyncGenerateClient(
            address, timeout_s=CLIENT_TIMEOUT_S, resubmits=CLIENT_RESUBMITS
        ) as client:
            tasks = {
                job.name: asyncio.create_task(
                    self._one(client, job, f"{prefix}-{job.name}", progress)
                )
                for job in self.jobs
            }
            helpers = [asyncio.create_task(self._release_late(tasks, progress))]
            if fault is not None:
                helpers.append(asyncio.create_task(self._inject(*fault, progress)))
            done, _ = await asyncio.wait(tasks.values(), timeout=SCENARIO_DEADLINE_S)
            for helper in helpers:
                helper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await helper
            streams = {}
            for name, task in tasks.items():
                if task in done:
                    streams[name] = task.result()
                else:
                    task.cancel()
                    streams[name] = _Stream("lost", [], "no result by the harness deadline")
            return streams

    async def _release_late(self, tasks: dict[str, asyncio.Task], progress: _Progress) -> None:
        """The late jobs start at ``late_after`` tokens, or once the others all ended."""
        first = [task for name, task in tasks.items() if name not in self.late]
        await asyncio.wait(first)
        progress.late.set()

    async def _one(
        self, client: AsyncGenerateClient, job: Job, rid: str, progress: _Progress
    ) -> _Stream:
        got: list[int] = []
        sampling = {"max_new_tokens": job.max_new}
        if job.name in self.late:
            await progress.late.wait()
        try:
            async for item in client.stream(job.prompt, rid=rid, sampling=sampling):
                if isinstance(item, Chunk):
                    if item.offset != len(got):
                        return _Stream("mismatch", got, f"chunk at {item.offset} after {len(got)}")
                    got += item.token_ids
                    progress.add(len(item.token_ids))
                    continue
                reason = item.finish_reason or {}
                if reason.get("type") == "abort":
                    return _Stream("error", item.output_ids, f"aborted: {reason.get('message')}")
                if item.output_ids[: len(got)] != got:  # the last tokens come with the result
                    return _Stream("mismatch", got, f"stream {got} !< result {item.output_ids}")
                retractions = item.meta_info.get("num_retractions", 0)
                return _Stream("identical", item.output_ids, json.dumps(reason), retractions)
        except GenerateError as exc:
            return _Stream("error", got, f"{exc.code}: {exc}")
        return _Stream("lost", got, "stream ended without a result")

    def _judge(self, name: str, stream: _Stream) -> Outcome:
        if stream.status != "identical":
            if stream.status == "error" and not stream.detail.strip():
                return Outcome(name, "mismatch", "an error that names no fault")
            return Outcome(name, stream.status, stream.detail)
        want = self.reference[name]
        if stream.tokens != want:
            return Outcome(name, "mismatch", f"got {stream.tokens}, reference {want}")
        return Outcome(name, "identical", retractions=stream.retractions)

    # -- faults ------------------------------------------------------------------------

    async def _inject(self, scenario: Scenario, faults: Counter, progress: _Progress) -> None:
        if scenario.kind == "kill_memsvc_in_retract":
            await self._kill_in_retract(faults)
            return
        await progress.reached.wait()
        if scenario.kind.startswith("kill_"):
            self._signal(scenario.target, signal.SIGKILL)
            faults[f"sigkill_{scenario.target}"] += 1
        elif scenario.kind == "stall":
            await self._stall(scenario.target, faults)
        elif scenario.kind == "wire":
            await self._wire(faults)

    async def _kill_in_retract(self, faults: Counter) -> None:
        kills = self.retract_kills
        self._retract_trap.set()
        try:
            while self.retract_kills == kills:
                await asyncio.sleep(0.02)
        finally:
            self._retract_trap.clear()
        faults["sigkill_memsvc_in_retract"] += 1

    def _watch_memsvc(self, header: dict[str, Any]) -> None:
        """In the memsvc proxy's thread: the trap fires on the next ``retract`` op."""
        if header.get("op") == "retract" and self._retract_trap.is_set():
            self._retract_trap.clear()
            self._signal("memsvc", signal.SIGKILL)
            self.retract_kills += 1

    async def _stall(self, target: str, faults: Counter) -> None:
        pid = self.supervisor.pid(target)
        if pid is None:
            return
        os.kill(pid, signal.SIGSTOP)
        faults[f"stall_{target}"] += 1
        try:
            await asyncio.sleep(STALL_S[target])
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    async def _wire(self, faults: Counter) -> None:
        """Damage messages on every link until ``WIRE_FAULTS`` were (or the workload ends)."""
        before = {name: p.counts for name, p in self.proxies.items()}

        def injected() -> int:
            return sum((p.counts - before[n]).total() for n, p in self.proxies.items())

        for proxy in self.proxies.values():
            proxy.plan = WIRE_PLAN
        try:
            while injected() < WIRE_FAULTS:
                await asyncio.sleep(0.05)
        finally:
            for proxy in self.proxies.values():
                proxy.plan = None
        for name, proxy in self.proxies.items():
            for kind, count in (proxy.counts - before[name]).items():
                faults[f"wire_{kind}"] += count

    def _damage_storage(self, scenario: Scenario, faults: Counter) -> None:
        """Damage a seeded share of the page files (of every memsvc) in one seeded way, once
        each memsvc flushed its device tier (so that the next matches load from below)."""
        for name in self.memsvcs:
            with MemClient(self.supervisor.address(name), timeout_s=5) as mem:
                mem.flush_cache(device_only=True)
        rng = random.Random(self.seed * 1000 + scenario.index)
        kind = rng.choice(STORAGE_DAMAGE)
        files = sorted(self.storage_dir.rglob("*.kvpage"))
        for path in rng.sample(files, int(len(files) * STORAGE_DAMAGED_SHARE)):
            with contextlib.suppress(OSError):  # replaced or deleted by memsvc meanwhile
                damage_file(str(path), kind, str(rng.choice(files)), rng.randrange(1 << 12))
                faults[f"storage_{kind}"] += 1

    def _signal(self, name: str, sig: int) -> None:
        pid = self.supervisor.pid(name)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    # -- checks ------------------------------------------------------------------------

    def _settle(self, result: ScenarioResult) -> None:
        """The stack is healthy and idle again, nothing leaked, nothing left over."""
        if not self.supervisor.wait_healthy(SETTLE_TIMEOUT_S):
            result.problems.append(f"stack not healthy again: {self.supervisor.state()}")
            return
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            problem, stats = self._idle_problem()
            if problem is None or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if problem is not None:
            result.problems.append(problem)
            result.pages_leaked = -(-int(stats.get("held", 0)) // PAGE_SIZE)
            result.host_bytes_left = int(stats.get("host_store_used_bytes", 0))
        result.problems += self._leftovers()

    def _idle_problem(self) -> tuple[str | None, dict[str, Any]]:
        """What is not idle (None: all is), and the memsvc stats (summed over the memsvcs)."""
        try:
            with GenerateClient(self.scheduler, timeout_s=10, resubmits=0) as client:
                info = client.info()
            busy = _busy(info)
            if busy:
                return f"not idle: {busy}", {}
            total: Counter = Counter()
            for name in self.memsvcs:
                with MemClient(self.supervisor.address(name), timeout_s=5) as mem:
                    stats = mem.stats()
                    held = {k: int(stats[k]) for k in ("held", "host_store_used_bytes")}
                    total.update(held)
                    try:
                        mem.check(idle=True)
                    except Exception as exc:  # the invariant's own message says what is wrong
                        return f"{name} idle check failed: {exc}; stats {stats}", total
                    if any(held.values()):
                        return f"{name} holds KV when idle: {stats}", total
            return None, total
        except Exception as exc:  # a service that does not answer the check
            return f"idle check failed: {type(exc).__name__}: {exc}", {}

    def _leftovers(self) -> list[str]:
        live = self.supervisor.live_pids()
        dead = self.supervisor.all_pids() - live
        problems = []
        orphans = sorted(pid for pid in dead if pid_alive(pid))
        if orphans:
            problems.append(f"orphan processes: {orphans}")
        segments = [n for n in list_segments() if segment_owner_pid(n) in dead]
        if segments:
            problems.append(f"segments of dead processes: {segments}")
        return problems


def _busy(info: dict[str, Any]) -> dict[str, Any]:
    """The non-empty queues of a scheduler's (or the PD router's) ``info``."""
    if not info.get("ok", True):
        return {"info": info.get("message")}
    busy = {k: info[k] for k in ("num_running", "num_waiting") if info.get(k)}
    busy.update({k: n for k, n in (info.get("queues") or {}).items() if n})
    if info.get("mode") == "pd":
        prefill = info.get("prefill") or {}
        if not prefill:
            busy["prefill"] = "does not answer"
        busy.update({f"prefill {k}": n for k, n in (prefill.get("queues") or {}).items() if n})
        if info["router"].get("flights"):
            busy["router flights"] = info["router"]["flights"]
    return busy


@dataclass
class _Stream:
    status: str
    tokens: list[int]
    detail: str = ""
    retractions: int = 0


def temp_workdir() -> Path:
    """A short path: ipc:// socket paths must stay under ~100 bytes."""
    return Path(tempfile.mkdtemp(prefix="kvf-", dir="/tmp"))
