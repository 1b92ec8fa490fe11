"""Round-trip latency of memsvc ops, against a bare pyzmq echo of the same message sizes.

Starts ``python -m memsvc`` on an ``ipc://`` path in a temporary folder and
times, with :class:`MemClient`, each call from before it is made until its
result is back (``time.perf_counter``):

- ``decode_step(rows)`` over batches of 1, 256 and 1,024 open requests,
  with the sync :class:`MemClient` and with the asyncio :class:`AsyncMemClient`
  (the scheduler's; its own session and batches, each call awaited in a
  running event loop),
- ``alloc_extend`` of one request by 16 tokens,
- ``stats``.

``handle`` is memsvc's own work on the same steps: :meth:`MemService.handle` in
this process on a pool of the same shape, no socket (the frames packed before
the clock starts).

A separate process runs a tight sync ROUTER loop that answers each request
with a reply of the same frames memsvc's ``decode_step`` reply has (captured
once from the real service), and a raw DEALER times that echo: the floor of
two processes, one ipc socket, the same bytes. Both servers stay up, and
decode_step and echo are timed in alternating rounds, so that drift in a
noisy machine hits both sides of the ratio alike.

Prints one JSON object on its last line, all figures in microseconds::

    {"decode_step": {"1": {"p50_us": .., "p99_us": ..}, "256": .., "1024": ..},
     "decode_step_async": {..}, "handle": {..}, "echo": {"1": .., "256": .., "1024": ..},
     "alloc_extend_16": {..}, "stats": {..},
     "frame_bytes": {"1": {"request": [..], "reply": [..]}, ..},
     "ratio_decode_step_256": ..}

``ratio_decode_step_256`` is decode_step(256) p50 / echo(256) p50 (target <= 1.5);
``decode_step_256_minus_echo_us`` is what memsvc adds to the transport floor,
``async_minus_sync_us`` what the asyncio client adds to the sync one (p50, by batch).
``--backend cuda`` runs memsvc on the GPU backend (the device ``req_to_token``
table is written on every step).
Run with the repository on ``PYTHONPATH`` (or kvstack installed, as ``make`` does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq
from zmq_echo import echo_roundtrip, running_echo  # bench/, on the path as the script's folder

from kvstack.stack.launch import Launcher
from memsvc import protocol as p
from memsvc.client import AsyncMemClient, MemClient
from memsvc.core import KVPool
from memsvc.core.layout import PoolLayout
from memsvc.handlers import MemService, ServiceConfig

BATCH_SIZES = (1, 256, 1024)
PROMPT_LEN = 16  # tokens each decode request holds when (re)opened
EXTEND_LEN = 16
CAPTURE_OP_ID = 1 << 40  # far above the client's own op ids, so never a cached retry
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PoolArgs:
    page_size: int
    num_pages: int
    max_running_requests: int
    max_context_len: int

    def layout(self) -> PoolLayout:
        return PoolLayout(
            num_layers=1,
            num_kv_heads=1,
            head_dim=8,
            page_size=self.page_size,
            num_pages=self.num_pages,
            max_running_requests=self.max_running_requests,
            max_context_len=self.max_context_len,
        )

    def cli(self) -> list[str]:
        # One layer, one head, head dim 8: the KV pool itself stays tiny.
        return [
            "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
            "--page-size", str(self.page_size),
            "--num-pages", str(self.num_pages),
            "--max-running-requests", str(self.max_running_requests),
            "--max-context-len", str(self.max_context_len),
        ]  # fmt: skip

    def steps_per_cycle(self, num_open: int) -> int:
        """Decode steps a freshly opened batch can take before it must be re-opened.

        Bounded by the context length and by a fair share of the pages among
        the ``num_open`` requests open at once.
        """
        pages_each = self.num_pages // num_open
        max_len = min(self.max_context_len, pages_each * self.page_size)
        return max_len - PROMPT_LEN


def percentiles(samples_s: list[float]) -> dict[str, float]:
    us = np.asarray(samples_s) * 1e6
    return {
        "p50_us": round(float(np.percentile(us, 50)), 1),
        "p99_us": round(float(np.percentile(us, 99)), 1),
    }


def time_calls(
    call: Callable[[], object],
    count: int,
    into: list[float],
    between: Callable[[], None] | None = None,
) -> None:
    """Append the seconds of ``count`` calls to ``into``; ``between()`` runs untimed before each."""
    for _ in range(count):
        if between is not None:
            between()
        start = time.perf_counter()
        call()
        into.append(time.perf_counter() - start)


# -- memsvc ops --------------------------------------------------------------------


@dataclass(slots=True)
class DecodeBatch:
    """``batch_size`` open requests, re-opened (untimed) before they outgrow the pool."""

    client: MemClient
    batch_size: int
    steps_per_cycle: int
    name: str = "decode"
    rows: np.ndarray = field(init=False)
    steps_left: int = 0

    def __post_init__(self) -> None:
        self.rows = np.zeros(self.batch_size, dtype=np.int64)

    @property
    def rids(self) -> list[str]:
        return [f"{self.name}{self.batch_size}-{i}" for i in range(self.batch_size)]

    def open(self) -> None:
        for i, rid in enumerate(self.rids):
            self.rows[i] = self.client.alloc_row(rid)
        result = self.client.alloc_extend([(rid, PROMPT_LEN) for rid in self.rids])
        if not result.fits:
            raise RuntimeError(f"cannot open a batch of {self.batch_size}: pool too small")
        self.steps_left = self.steps_per_cycle

    def close(self) -> None:
        for rid in self.rids:
            self.client.free_row(rid)
        self.steps_left = 0

    def make_room(self, steps: int = 1) -> None:
        """Before ``steps`` steps: re-open the batch when it has fewer left."""
        if self.steps_left < steps:
            self.close()
            self.open()
        self.steps_left -= steps

    def step(self) -> None:
        if not self.client.decode_step(self.rows).fits:
            raise RuntimeError(f"decode_step({self.batch_size}) did not fit")


class Blocking:
    """An :class:`AsyncMemClient`'s ops as blocking calls, each run to completion in ``loop``
    (for the untimed set-up: opening and closing batches)."""

    def __init__(self, client: AsyncMemClient, loop: asyncio.AbstractEventLoop) -> None:
        self.client, self.loop = client, loop

    def __getattr__(self, name: str) -> Callable[..., object]:
        op = getattr(self.client, name)
        return lambda *args: self.loop.run_until_complete(op(*args))


def time_async_steps(batch: DecodeBatch, count: int, into: list[float]) -> None:
    """``count`` decode steps of ``batch`` (opened through :class:`Blocking`), each awaited
    in one running event loop, as the scheduler awaits them."""
    blocking: Blocking = batch.client  # type: ignore[assignment]
    client, rows = blocking.client, batch.rows
    batch.make_room(count)

    async def steps() -> None:
        for _ in range(count):
            start = time.perf_counter()
            result = await client.decode_step(rows)
            into.append(time.perf_counter() - start)
            if not result.fits:
                raise RuntimeError(f"decode_step({batch.batch_size}) did not fit")

    blocking.loop.run_until_complete(steps())


def time_handle(pool: PoolArgs, args: argparse.Namespace) -> dict[int, list[float]]:
    """:meth:`MemService.handle` of decode_step in this process, per batch size."""
    kv = KVPool(pool.layout(), host_store_bytes=1 << 20)
    service = MemService(kv, ServiceConfig())
    op_ids = iter(range(1, 1 << 62))

    def call(op: str, arrays: dict | None = None, **fields: object) -> dict:
        header = {"op": op, "op_id": next(op_ids), "session": session, **fields}
        reply = p.unpack(service.handle(p.pack(header, arrays)))
        if not reply["ok"]:
            raise RuntimeError(f"in-process {op}: {reply}")
        return reply

    session = None
    session = call("hello", role="scheduler", lease_s=600.0)["session"]
    samples: dict[int, list[float]] = {}
    try:
        for size in BATCH_SIZES:
            rids = [f"handle{size}-{i}" for i in range(size)]
            rows = np.array([call("alloc_row", rid=rid)["row"] for rid in rids], dtype=np.int64)
            call("alloc_extend", {"num_tokens": np.full(size, PROMPT_LEN)}, rids=rids)
            steps = min(args.iterations + args.warmup, pool.steps_per_cycle(size))
            frames = [
                p.pack(
                    {"op": "decode_step", "op_id": next(op_ids), "session": session},
                    {"rows": rows},
                )
                for _ in range(steps)
            ]
            times = samples[size] = []
            for i, message in enumerate(frames):
                start = time.perf_counter()
                service.handle(message)
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
            for rid in rids:
                call("free_row", rid=rid)
    finally:
        kv.close()
    return samples


def time_alloc_extend(client: MemClient, iterations: int, warmup: int) -> list[float]:
    """One request extended by ``EXTEND_LEN`` tokens; closed and re-opened between calls."""
    rid = "extend"
    client.alloc_row(rid)

    def reopen() -> None:
        client.free_row(rid)
        client.alloc_row(rid)

    def extend() -> None:
        if not client.alloc_extend([(rid, EXTEND_LEN)]).fits:
            raise RuntimeError("alloc_extend did not fit")

    samples: list[float] = []
    try:
        time_calls(extend, warmup, [], reopen)
        time_calls(extend, iterations, samples, reopen)
    finally:
        client.free_row(rid)
    return samples


def capture_decode_frames(
    client: MemClient, address: str, batch_size: int
) -> tuple[list[bytes], list[bytes]]:
    """One real decode_step, sent raw: the request frames and memsvc's reply frames."""
    rids = [f"capture-{i}" for i in range(batch_size)]
    rows = np.array([client.alloc_row(rid) for rid in rids], dtype=np.int64)
    client.alloc_extend([(rid, PROMPT_LEN) for rid in rids])
    header = {"op": "decode_step", "op_id": CAPTURE_OP_ID + batch_size, "session": client.session}
    request = p.pack(header, {"rows": rows})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(request)
        if not sock.poll(10_000):
            raise RuntimeError("memsvc did not answer the raw decode_step")
        reply = sock.recv_multipart()
    finally:
        sock.close(0)
        ctx.term()
    if not p.unpack(reply).get("fits"):
        raise RuntimeError(f"raw decode_step failed: {p.unpack(reply)}")
    for rid in rids:
        client.free_row(rid)
    return request, reply


# -- main --------------------------------------------------------------------------


def time_decode_and_echo(
    client: MemClient,
    aclient: Blocking,
    echo_address: str,
    requests: dict[int, list[bytes]],
    pool: PoolArgs,
    args: argparse.Namespace,
) -> dict[str, dict[int, list[float]]]:
    """decode_step (sync and async) and echo per batch size, in alternating rounds (after
    a warm-up of each)."""
    steps = pool.steps_per_cycle(2 * sum(BATCH_SIZES))
    per_round = -(-args.iterations // args.rounds)
    if steps < max(per_round, args.warmup):
        raise SystemExit(f"--num-pages too small: {steps} steps between re-opens")
    batches = {size: DecodeBatch(client, size, steps) for size in BATCH_SIZES}
    abatches = {size: DecodeBatch(aclient, size, steps, "async") for size in BATCH_SIZES}  # type: ignore[arg-type]
    times: dict[str, dict[int, list[float]]] = {
        kind: {size: [] for size in BATCH_SIZES} for kind in ("sync", "async", "echo")
    }
    with contextlib.ExitStack() as stack:
        echoes = {
            size: stack.enter_context(echo_roundtrip(echo_address, requests[size]))
            for size in BATCH_SIZES
        }
        for batch in (*batches.values(), *abatches.values()):
            batch.open()
        for size, batch in batches.items():
            time_calls(batch.step, args.warmup, [], batch.make_room)
            time_async_steps(abatches[size], args.warmup, [])
            time_calls(echoes[size], args.warmup, [])
        for _ in range(args.rounds):
            for size, batch in batches.items():
                time_calls(batch.step, per_round, times["sync"][size], batch.make_room)
                time_async_steps(abatches[size], per_round, times["async"][size])
                time_calls(echoes[size], per_round, times["echo"][size])
    # On an error the clients' goodbyes reclaim the batches instead.
    for batch in (*batches.values(), *abatches.values()):
        batch.close()
    return times


def run(args: argparse.Namespace) -> dict:
    pool = PoolArgs(args.page_size, args.num_pages, args.max_running_requests, args.max_context_len)
    with tempfile.TemporaryDirectory(prefix="memsvc-bench-") as tmp:
        workdir = Path(tmp)
        launcher = Launcher(workdir, stop_timeout=STOP_TIMEOUT_S)
        try:
            with launcher:
                memsvc = launcher.start(
                    "memsvc",
                    *pool.cli(),
                    "--backend",
                    args.backend,
                    "--log-level",
                    "WARNING",
                    timeout=START_TIMEOUT_S,
                )
                address = memsvc.address
                client = MemClient(address, name="bench", lease_s=600, heartbeat=False)
                loop = asyncio.new_event_loop()
                aclient = Blocking(
                    loop.run_until_complete(
                        AsyncMemClient.connect(
                            address, name="bench-async", lease_s=600, heartbeat=False
                        )
                    ),
                    loop,
                )
                try:
                    frames = {
                        size: capture_decode_frames(client, address, size) for size in BATCH_SIZES
                    }
                    replies = {len(request[-1]): reply for request, reply in frames.values()}
                    requests = {size: request for size, (request, _) in frames.items()}
                    with running_echo(workdir, replies) as echo_address:
                        times = time_decode_and_echo(
                            client, aclient, echo_address, requests, pool, args
                        )
                    extend = time_alloc_extend(client, args.iterations, args.warmup)
                    stats: list[float] = []
                    time_calls(client.stats, args.warmup, [])
                    time_calls(client.stats, args.iterations, stats)
                finally:
                    client.close()
                    aclient.close()
                    loop.close()
        finally:
            if launcher.leaked_segments:
                print(
                    f"memsvc left shm segments, removed: {launcher.leaked_segments}",
                    file=sys.stderr,
                )
    handle = time_handle(pool, args)
    result = {
        "backend": args.backend,
        "decode_step": {str(size): percentiles(times["sync"][size]) for size in BATCH_SIZES},
        "decode_step_async": {str(size): percentiles(times["async"][size]) for size in BATCH_SIZES},
        "handle": {str(size): percentiles(handle[size]) for size in BATCH_SIZES},
        "alloc_extend_16": percentiles(extend),
        "stats": percentiles(stats),
        "echo": {str(size): percentiles(times["echo"][size]) for size in BATCH_SIZES},
        "frame_bytes": {
            str(size): {"request": [len(f) for f in request], "reply": [len(f) for f in reply]}
            for size, (request, reply) in frames.items()
        },
    }
    decode_256, echo_256 = result["decode_step"]["256"]["p50_us"], result["echo"]["256"]["p50_us"]
    result["ratio_decode_step_256"] = round(decode_256 / echo_256, 2)
    # What memsvc adds to the transport floor: steadier than the ratio on a noisy machine.
    result["decode_step_256_minus_echo_us"] = round(decode_256 - echo_256, 1)
    result["async_minus_sync_us"] = {
        str(size): round(
            result["decode_step_async"][str(size)]["p50_us"]
            - result["decode_step"][str(size)]["p50_us"],
            1,
        )
        for size in BATCH_SIZES
    }
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=2000, help="timed calls per figure")
    parser.add_argument("--warmup", type=int, default=200, help="untimed calls before each")
    parser.add_argument("--rounds", type=int, default=10, help="decode/echo alternations")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=40960)
    parser.add_argument("--max-running-requests", type=int, default=4096)
    parser.add_argument("--max-context-len", type=int, default=1024)
    parser.add_argument(
        "--backend", choices=("shm", "cuda"), default="shm", help="memsvc's --backend"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    result = run(args)
    print(f"took {time.monotonic() - started:.1f}s", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
