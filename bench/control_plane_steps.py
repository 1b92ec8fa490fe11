"""memsvc at serving scale (issue 28, item 6): the ``decode`` and ``retract`` sections.

Each figure is measured four ways in the same run, calls interleaved in rounds
so that drift on a shared machine hits every side of a ratio alike (see
:mod:`control_plane_mem`): ``async`` / ``sync`` (round trips to a memsvc
process), ``handler`` / ``call`` (memsvc's handler in this process) and
``echo`` (a bare ZMQ round trip of the same frames).

``decode``: ``decode_step`` at each batch size and tree size, with a free pool
and with a full one (filler requests hold every free page, so every step
evicts from the tree, which is refilled between steps once it has lost 5%).
``retract``: 256 requests in a full pool whose own KV is 7 pages each and
whose next step needs a page each, so that memsvc's retract (FREE targets)
releases exactly 32 of them; the 32 are re-opened between calls.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
from control_plane_mem import (  # bench/, on the path as the script's folder
    INSERT_BATCH,
    METHODS,
    OWN_TOKENS,
    SHARED_PREFIX,
    SHARED_TOKEN,
    Batch,
    Filler,
    InProcClient,
    Pool,
    Sequences,
    Tree,
    Worlds,
    count_nodes,
    grow_to_nodes,
    median_us,
    memsvc_worlds,
    must_fit,
    nothing,
    once,
    once_async,
    pin_shared_prefix,
    timed,
    timed_async,
    timed_inproc,
    tree_tokens,
)
from zmq_echo import echo_roundtrip, running_echo  # bench/ too

from memsvc.client import Call, RetractTarget
from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig

RETRACT_BATCH, RETRACT_VICTIMS = 256, 32
RETRACT_OWN_PAGES = 7  # so that exactly 32 victims free the pages the other 224 need
BATCHES = (1, 16, 64, 256, 1024)


# -- decode -----------------------------------------------------------------------------


def decode_pool(page_size: int, args: argparse.Namespace) -> Pool:
    """The pool: ``--pool-tokens``, or what the largest tree and batches need if more."""
    tail_pages = max(1, args.decode_tail_tokens // page_size)
    tree = tree_tokens(page_size, max(args.tree_sizes), args.seed, tail_pages)
    steps = 2 * args.rounds * args.steps  # per batch: free and full phases
    batch = max(args.batches) * (OWN_TOKENS + steps + page_size)
    # Process: the tree, two batches, the filler's share (what full steps evict), slack.
    need = tree + 2 * batch + max(args.batches) * steps + SHARED_PREFIX + (1 << 16)
    tokens = max(args.pool_tokens, need)
    context = max(4096, SHARED_PREFIX + OWN_TOKENS + steps + 2 * page_size)
    rows = 2 * max(args.batches) + INSERT_BATCH + tokens // context + 16
    return Pool(page_size, -(-tokens // page_size), rows, context)


def capture_decode_frames(pool: Pool, batches: list[int]) -> dict[int, list[bytes]]:
    """A real decode_step's reply per batch size, keyed by its request's last frame size."""
    replies = {}
    with KVPool(pool.layout) as kv:
        client = InProcClient(MemService(kv, ServiceConfig()))
        shared = np.arange(SHARED_TOKEN, SHARED_TOKEN + SHARED_PREFIX)
        pin_shared_prefix(client, shared, "capture")
        for size in batches:
            batch = Batch(client, f"capture{size}-", size, shared, page_size=pool.page_size)
            batch.open()
            client.decode_step(batch.rows)
            request, reply = client.frames
            replies[len(request[-1])] = reply
            batch.close()
    return replies


class DecodeBench:
    """Every (tree size, batch) of one page size, over one pair of worlds."""

    def __init__(self, worlds: Worlds, echo: str, args: argparse.Namespace) -> None:
        self.w, self.echo, self.args = worlds, echo, args
        ps = worlds.pool.page_size
        tail_pages = max(1, args.decode_tail_tokens // ps)
        # The same seed in both pools: the same tree until eviction histories differ.
        self.trees = {
            "process": Tree(worlds.sync, Sequences(ps, args.seed, tail_pages), "tree"),
            "inproc": Tree(worlds.inproc, Sequences(ps, args.seed, tail_pages), "tree"),
        }
        self.fillers = {"process": Filler(worlds.sync), "inproc": Filler(worlds.inproc)}
        self.shared = np.arange(SHARED_TOKEN, SHARED_TOKEN + SHARED_PREFIX)
        pin_shared_prefix(worlds.sync, self.shared, "shared")
        pin_shared_prefix(worlds.inproc, self.shared, "shared")
        self.target = 0  # the tree's evictable tokens, kept through full-pool steps

    def run(self) -> list[dict[str, Any]]:
        rows = []
        for num_nodes in sorted(self.args.tree_sizes):
            grow_to_nodes(self.trees["inproc"], self.w.inproc.service, num_nodes)
            self.target = self.trees["inproc"].evictable()
            self.trees["process"].grow_to_tokens(self.target)
            for size in self.args.batches:
                row = {"page_size": self.w.pool.page_size, "nodes_target": num_nodes, "batch": size}
                row["tree_tokens"] = self.target
                row["pool_tokens"] = self.w.pool.num_pages * self.w.pool.page_size
                row.update(self.batch_case(size))
                row["nodes"] = count_nodes(self.w.inproc.service)
                rows.append(row)
        return rows

    def keep_tree(self, world: str) -> Callable[[], None]:
        """Before a full-pool step: refill the tree once it has lost 5% (or is near empty)."""
        tree, filler = self.trees[world], self.fillers[world]
        floor = max(self.target * 0.95, self.target - 4 * self.w.pool.page_size * 1024)

        def between() -> None:
            if not filler.held or (have := tree.evictable()) >= floor:
                return
            filler.give_back(2 * (self.target - have))
            tree.grow_to_tokens(self.target)
            filler.take_all()

        return between

    def batch_case(self, size: int) -> dict[str, Any]:
        w, args, ps = self.w, self.args, self.w.pool.page_size
        batches = {
            "sync": Batch(w.sync, "s", size, self.shared, page_size=ps),
            "async": Batch(w.blocking_aio, "a", size, self.shared, page_size=ps),
            "inproc": Batch(w.inproc, "i", size, self.shared, page_size=ps),
        }
        for batch in batches.values():
            batch.open()
        sync_rows, async_rows = batches["sync"].rows, batches["async"].rows
        inproc_rows = batches["inproc"].rows
        pool = w.inproc.service.pool
        result: dict[str, Any] = {}
        echo_request = capture_request(w.inproc, inproc_rows)
        with echo_roundtrip(self.echo, echo_request) as echo:
            for phase in ("free", "full"):
                if phase == "full":
                    self.fillers["process"].take_all()
                    self.fillers["inproc"].take_all()
                keep_p = self.keep_tree("process") if phase == "full" else nothing
                keep_i = self.keep_tree("inproc") if phase == "full" else nothing
                samples: dict[str, list[float]] = {m: [] for m in METHODS}
                evicted = 0  # tokens the in-process steps evicted from the tree

                def inproc_step() -> None:
                    nonlocal evicted
                    before = pool.evictable_size()
                    must_fit(w.inproc.decode_step(inproc_rows))
                    evicted += before - pool.evictable_size()

                for _ in range(args.rounds):
                    n = args.steps
                    timed(
                        lambda: must_fit(w.sync.decode_step(sync_rows)), samples["sync"], n, keep_p
                    )
                    w.loop.run_until_complete(
                        timed_async(
                            lambda: self._async_step(async_rows), samples["async"], n, keep_p
                        )
                    )
                    timed_inproc(inproc_step, w.inproc, samples, n, keep_i)
                    timed(echo, samples["echo"], n, nothing)
                result[phase] = {m: median_us(s) for m, s in samples.items()}
                result[phase]["evicted_per_step"] = evicted / (args.rounds * args.steps)
        for name in ("process", "inproc"):
            self.fillers[name].give_back()
        for batch in batches.values():
            batch.close()
        for key in ("async", "sync", "handler"):
            result[f"full_over_free_{key}"] = round(result["full"][key] / result["free"][key], 2)
        return result

    async def _async_step(self, rows: np.ndarray) -> None:
        must_fit(await self.w.aio.decode_step(rows))


def capture_request(client: InProcClient, rows: np.ndarray) -> list[bytes]:
    """The frames of a decode_step request for ``rows`` (packed, not sent)."""
    _, frames = client._state.frames(Call("decode_step", {}, {"rows": rows}, None))
    return frames


def bench_decode(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for page_size in args.page_sizes:
        pool = decode_pool(page_size, args)
        replies = capture_decode_frames(pool, args.batches)
        with memsvc_worlds(pool) as worlds, running_echo(worlds.workdir, replies) as echo:
            rows += DecodeBench(worlds, echo, args).run()
    lines = [
        f"decode_step, µs (median of {args.rounds} x {args.steps}): async / sync client round "
        "trip to memsvc, in-process handler, bare ZMQ echo; free pool | full pool (every step "
        "evicts)",
        f"{'page':>4} {'nodes':>7} {'tree tok':>9} {'pool tok':>9} {'batch':>5} |"
        f" {'async':>7} {'sync':>7} {'handler':>7} {'echo':>6} |"
        f" {'async':>7} {'sync':>7} {'handler':>7} {'echo':>6} | full/free async, handler",
    ]
    for r in rows:
        free, full = r["free"], r["full"]
        lines.append(
            f"{r['page_size']:>4} {r['nodes']:>7} {r['tree_tokens']:>9} {r['pool_tokens']:>9}"
            f" {r['batch']:>5} | {free['async']:>7} {free['sync']:>7} {free['handler']:>7}"
            f" {free['echo']:>6} | {full['async']:>7} {full['sync']:>7} {full['handler']:>7}"
            f" {full['echo']:>6} | {r['full_over_free_async']:>5} {r['full_over_free_handler']:>5}"
        )
    figures: dict[str, Any] = {"decode": rows}
    at = [r for r in rows if r["batch"] == 256 and r["nodes_target"] == 100_000]
    if at:
        figures["decode_full_over_free_256_100k"] = max(r["full_over_free_async"] for r in at)
        figures["decode_full_over_free_256_100k_handler"] = max(
            r["full_over_free_handler"] for r in at
        )
    return lines, figures


# -- retract ----------------------------------------------------------------------------


def retract_pool(page_size: int, args: argparse.Namespace) -> Pool:
    context = 4096
    rows = 3 * RETRACT_BATCH + args.pool_tokens // context + 16
    return Pool(page_size, -(-args.pool_tokens // page_size), rows, context)


class RetractCase:
    """256 requests in a full pool whose next step needs one page each, and whose own
    pages are 7: memsvc's retract (FREE targets) releases exactly 32 of them."""

    def __init__(self, client: Any, tag: str, shared: np.ndarray, page_size: int) -> None:
        own = RETRACT_OWN_PAGES * page_size
        self.batch = Batch(client, tag, RETRACT_BATCH, shared, own, stagger=False)
        self.batch.open()
        self.targets = [RetractTarget.FREE] * RETRACT_BATCH

    def retract(self, client: Any) -> Any:
        return client.retract(self.batch.rows, self.targets)

    def reopen(self, reply: Any) -> None:
        """Check that the last 32 were retracted, and open them again."""
        expected = [f"{self.batch.tag}{i}" for i in range(RETRACT_BATCH - 1, -1, -1)]
        if reply.retracted != expected[:RETRACT_VICTIMS]:
            raise RuntimeError(f"retract released {len(reply.retracted)}, not {RETRACT_VICTIMS}")
        self.batch.open(range(RETRACT_BATCH - RETRACT_VICTIMS, RETRACT_BATCH))


def time_retracts(w: Worlds, args: argparse.Namespace) -> dict[str, list[float]]:
    """Retract and re-open, in rounds: sync, in-process, async, echo."""
    shared = np.arange(SHARED_TOKEN, SHARED_TOKEN + SHARED_PREFIX)
    pin_shared_prefix(w.sync, shared, "shared")
    pin_shared_prefix(w.inproc, shared, "shared")
    ps = w.pool.page_size
    sync = RetractCase(w.sync, "s", shared, ps)
    aio = RetractCase(w.blocking_aio, "a", shared, ps)
    inproc = RetractCase(w.inproc, "i", shared, ps)
    Filler(w.sync).take_all()
    Filler(w.inproc).take_all()
    reply = inproc.retract(w.inproc)  # a warm-up
    request, reply_frames = w.inproc.frames  # what the echo answers with
    inproc.reopen(reply)
    samples: dict[str, list[float]] = {m: [] for m in METHODS}
    with (
        running_echo(w.workdir, {len(request[-1]): reply_frames}) as address,
        echo_roundtrip(address, request) as echo,
    ):
        for _ in range(args.retract_repeats):
            seconds, reply = once(lambda: sync.retract(w.sync))
            samples["sync"].append(seconds)
            sync.reopen(reply)
            seconds, reply = once(lambda: inproc.retract(w.inproc))
            samples["call"].append(seconds)
            samples["handler"].append(w.inproc.handler_s)
            inproc.reopen(reply)
            seconds, reply = w.loop.run_until_complete(once_async(lambda: aio.retract(w.aio)))
            samples["async"].append(seconds)
            aio.reopen(reply)
            samples["echo"].append(once(echo)[0])
    w.inproc.service.pool.check_integrity()
    w.sync.check()
    return samples


def bench_retract(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    rows = []
    for page_size in args.page_sizes:
        with memsvc_worlds(retract_pool(page_size, args)) as worlds:
            samples = time_retracts(worlds, args)
        row = {"page_size": page_size, "victims": RETRACT_VICTIMS, "batch": RETRACT_BATCH}
        row.update({m: median_us(s) for m, s in samples.items()})
        rows.append(row)
    lines = [
        f"retract {RETRACT_VICTIMS} of {RETRACT_BATCH} (FREE targets), µs, median of "
        f"{args.retract_repeats}: memsvc round trip (async / sync client), in-process "
        "(client call / handler), bare ZMQ echo of the same frames",
        f"{'page':>4} {'async':>8} {'sync':>8} {'call':>8} {'handler':>8} {'echo':>8}",
    ]
    lines += [
        f"{r['page_size']:>4} {r['async']:>8} {r['sync']:>8} {r['call']:>8} {r['handler']:>8}"
        f" {r['echo']:>8}"
        for r in rows
    ]
    figures = {
        "retract": rows,
        "retract_32_of_256_async_us": max(r["async"] for r in rows),
        "retract_32_of_256_handler_us": max(r["handler"] for r in rows),
    }
    return lines, figures
