"""memsvc at serving scale (issue 28, item 6): the ``decode`` and ``retract`` sections.

Each figure is measured three ways in the same run, calls interleaved in rounds
so that drift on a shared machine hits every side of a ratio alike:

- ``async`` / ``sync``: the round trip to a ``python -m memsvc`` process with
  :class:`AsyncMemClient` (what the scheduler uses) and :class:`MemClient`;
- ``in-process``: memsvc's own handler, :meth:`MemService.handle` on packed
  frames, in this process over a pool of the same size built by the same ops
  (``handler``: ``handle`` alone; ``call``: with the client's packing and parsing);
- ``echo``: a bare ZMQ round trip of the same frames to a server that answers
  with a captured reply (``bench/zmq_echo.py``'s echo server).

The pool has a small KV layout (1 layer, 1 KV head, head dim 4, float16) so a
million tokens take 16 MB. Every request of a decode batch has a 2,048-token
context: a 1,920-token prefix shared by all (a system prompt, in the tree, kept
locked by a pinned request) and up to 128 tokens of its own (at page size 16
the lengths are staggered, so each step opens pages for about 1/16 of the rows).
The tree is grown by seeded inserts (:class:`Sequences`: each a cached sequence
cut at a random page plus 1 to ``--decode-tail-tokens`` fresh tokens, whole
pages), to 5k / 20k / 100k nodes. A node holds at least one page, so at page
size 16 a 100k-node tree needs more than a million tokens: the pool grows to
what the tree and the batches need (the table gives its size).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from memsvc_ops import Blocking  # bench/, on the path as the script's folder

from kvstack.stack.launch import Launcher
from memsvc import protocol as wire
from memsvc.client import (
    AsyncMemClient,
    ClientSession,
    MemClient,
    MemClientBase,
)
from memsvc.core import KVPool, PoolLayout
from memsvc.core.allocator import PageAllocator
from memsvc.core.radix_cache import RadixCache
from memsvc.handlers import MemService, ServiceConfig

SHARED_PREFIX = 1920  # tokens every decode request shares (whole pages at 1 and 16)
OWN_TOKENS = 128  # ... and its own, at most: a context of 2,048
LAYOUT = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "dtype": "float16"}
INSERT_BATCH = 64  # tree inserts per alloc_extend
SHARED_TOKEN = 1 << 40  # token ids of the shared prefixes: apart from the trees'
METHODS = ("async", "sync", "call", "handler", "echo")


# -- a tree of seeded sequences ------------------------------------------------------


class Sequences:
    """Seeded token sequences that share prefixes: each is a page-aligned cut (at most 32
    pages in) of an earlier one plus 1 to ``max_tail_pages`` pages of fresh tokens."""

    def __init__(self, page_size: int, seed: int, max_tail_pages: int, first_token: int = 1):
        self.page_size = page_size
        self.max_tail_pages = max_tail_pages
        self.rng = np.random.default_rng(seed)
        self.made: list[np.ndarray] = []
        self.next_token = first_token

    def next(self) -> np.ndarray:
        ps, rng = self.page_size, self.rng
        prefix = np.empty(0, dtype=np.int64)
        if self.made:
            base = self.made[int(rng.integers(len(self.made)))]
            cut = int(rng.integers(0, min(len(base) // ps, 32) + 1)) * ps
            prefix = base[:cut]
        tail_len = int(rng.integers(1, self.max_tail_pages + 1)) * ps
        tail = np.arange(self.next_token, self.next_token + tail_len, dtype=np.int64)
        self.next_token += tail_len
        tokens = np.concatenate([prefix, tail])
        self.made.append(tokens)
        return tokens

    def fresh(self, num_tokens: int) -> np.ndarray:
        """``num_tokens`` tokens no sequence has."""
        tokens = np.arange(self.next_token, self.next_token + num_tokens, dtype=np.int64)
        self.next_token += num_tokens
        return tokens


class TreeGrower:
    """Inserts :class:`Sequences` straight into a :class:`RadixCache` (no pool, no service)."""

    def __init__(self, cache: RadixCache, seed: int, max_tail_pages: int) -> None:
        self.cache = cache
        self.sequences = Sequences(cache.page_size, seed, max_tail_pages)

    def insert_one(self) -> int:
        """Insert one sequence; returns the tokens the tree took."""
        tokens = self.sequences.next()
        slots = self.cache.allocator.alloc(len(tokens))
        prefix_len = self.cache.insert(tokens, slots)
        self.cache.allocator.free(slots[:prefix_len])
        return len(tokens) - prefix_len

    def grow_to(self, num_nodes: int) -> None:
        while self.cache._num_nodes_created - 1 < num_nodes:  # nothing evicted yet
            self.insert_one()

    def refill(self, num_tokens: int) -> None:
        added = 0
        while added < num_tokens:
            added += self.insert_one()


def tree_tokens(page_size: int, num_nodes: int, seed: int, max_tail_pages: int) -> int:
    """Tokens the tree of ``num_nodes`` nodes holds (grown in a throwaway cache)."""
    cache = RadixCache(PageAllocator(max_tail_pages * num_nodes + 1024, page_size))
    TreeGrower(cache, seed, max_tail_pages).grow_to(num_nodes)
    return cache.total_size()


# -- the memsvc process and its in-process twin ---------------------------------------


@dataclass(frozen=True)
class Pool:
    page_size: int
    num_pages: int
    max_running_requests: int
    max_context_len: int

    @property
    def layout(self) -> PoolLayout:
        return PoolLayout(
            page_size=self.page_size,
            num_pages=self.num_pages,
            max_running_requests=self.max_running_requests,
            max_context_len=self.max_context_len,
            **LAYOUT,
        )

    def cli(self) -> list[str]:
        layout = self.layout
        return [
            "--num-layers", str(layout.num_layers), "--num-kv-heads", str(layout.num_kv_heads),
            "--head-dim", str(layout.head_dim), "--dtype", layout.dtype,
            "--page-size", str(self.page_size), "--num-pages", str(self.num_pages),
            "--max-running-requests", str(self.max_running_requests),
            "--max-context-len", str(self.max_context_len), "--log-level", "WARNING",
        ]  # fmt: skip


class InProcClient(MemClientBase):
    """memsvc's handler in this process, called synchronously: every op packed, handled and
    parsed as over the wire. ``handler_s``: the last ``handle`` call alone; ``frames``: the
    last request and reply."""

    def __init__(self, service: MemService, name: str = "bench") -> None:
        self.service = service
        lease = ServiceConfig.max_lease_s
        self._state = ClientSession("inproc://memsvc", "scheduler", name, lease, 1.0, 0, None)
        self.handler_s = 0.0
        self.frames: tuple[list[bytes], list[bytes]] = ([], [])
        self._invoke(self._state.hello_call())

    def _invoke(self, call: Any) -> Any:
        _, request = self._state.frames(call)
        started = time.perf_counter()
        reply = self.service.handle(request)
        self.handler_s = time.perf_counter() - started
        self.frames = (request, reply)
        return self._state.finish(call, wire.unpack(reply))


@dataclass
class Worlds:
    """One memsvc process (``sync`` and ``aio`` sessions) and its in-process twin."""

    pool: Pool
    workdir: Path
    sync: MemClient
    aio: AsyncMemClient
    loop: asyncio.AbstractEventLoop
    inproc: InProcClient

    @property
    def blocking_aio(self) -> Blocking:
        return Blocking(self.aio, self.loop)


@contextlib.contextmanager
def memsvc_worlds(pool: Pool) -> Iterator[Worlds]:
    """Start memsvc (ipc in a temporary folder) and build its twin; all closed after."""
    with (
        tempfile.TemporaryDirectory(prefix="control-plane-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        launcher = stack.enter_context(Launcher(Path(tmp), stop_timeout=10))
        address = launcher.start("memsvc", *pool.cli(), timeout=120).address
        kv = KVPool(pool.layout)
        stack.callback(kv.close)
        loop = asyncio.new_event_loop()
        stack.callback(loop.close)
        sync = MemClient(address, name="bench-sync", lease_s=600, heartbeat=False)
        stack.callback(sync.close)
        aio = loop.run_until_complete(
            AsyncMemClient.connect(address, name="bench-async", lease_s=600, heartbeat=False)
        )
        stack.callback(lambda: loop.run_until_complete(aio.close()))
        inproc = InProcClient(MemService(kv, ServiceConfig()))
        yield Worlds(pool, Path(tmp), sync, aio, loop, inproc)


# -- what lives in a pool ---------------------------------------------------------------


class Tree:
    """The seeded tree in one pool, inserted through ``client`` (alloc_extend + release)."""

    def __init__(self, client: Any, sequences: Sequences, tag: str) -> None:
        self.client, self.sequences, self.tag = client, sequences, tag
        self.inserts = 0

    def insert(self, count: int) -> None:
        for start in range(0, count, INSERT_BATCH):
            batch = [self.sequences.next() for _ in range(min(INSERT_BATCH, count - start))]
            rids = [f"{self.tag}{self.inserts + i}" for i in range(len(batch))]
            self.inserts += len(batch)
            for rid in rids:
                self.client.alloc_row(rid)
            items = [(rid, len(t)) for rid, t in zip(rids, batch, strict=True)]
            if not self.client.alloc_extend(items).fits:
                raise RuntimeError("the pool is too small for the tree")
            for rid, tokens in zip(rids, batch, strict=True):
                self.client.release(rid, tokens)

    def evictable(self) -> int:
        self.client.heartbeat()  # fresh sizes: another session may have moved them
        return self.client.sizes.evictable

    def grow_to_tokens(self, target: int) -> None:
        while (missing := target - self.evictable()) > 0:
            per_insert = self.sequences.page_size * (self.sequences.max_tail_pages + 1) / 2
            self.insert(max(1, math.ceil(missing / per_insert)))


def count_nodes(service: MemService) -> int:
    return sum(1 for _ in service.pool.tree.iter_nodes()) - 1  # the root is no node


def grow_to_nodes(tree: Tree, service: MemService, num_nodes: int) -> None:
    """Insert until the in-process tree has ``num_nodes`` nodes (each insert adds 1-2)."""
    while (have := count_nodes(service)) < num_nodes:
        tree.insert(max(1, (num_nodes - have) // 2))


class Filler:
    """Requests holding every free page (each at most a context long), so that each decode
    step must evict; some give their pages back for the tree to grow into."""

    def __init__(self, client: Any, tag: str = "filler") -> None:
        self.client, self.tag = client, tag
        self.held: dict[str, int] = {}  # rid -> tokens
        self.made = 0

    def take_all(self) -> None:
        self.client.heartbeat()
        free = self.client.sizes.available
        layout = self.client.layout
        chunk = layout.max_context_len // layout.page_size * layout.page_size
        items = []
        while free > 0:
            items.append((f"{self.tag}{self.made}", min(chunk, free)))
            self.made += 1
            free -= items[-1][1]
        for rid, _ in items:
            self.client.alloc_row(rid)
        if items and not self.client.alloc_extend(items).fits:
            raise RuntimeError("the filler did not fit")
        self.held.update(items)

    def give_back(self, num_tokens: float = math.inf) -> None:
        """Free at least ``num_tokens`` (all by default)."""
        while self.held and num_tokens > 0:
            rid, tokens = self.held.popitem()
            self.client.free_row(rid)
            num_tokens -= tokens


@dataclass
class Batch:
    """``size`` open requests sharing the pinned prefix, each with tokens of its own."""

    client: Any
    tag: str
    size: int
    shared: np.ndarray
    own_tokens: int = OWN_TOKENS
    stagger: bool = True  # own lengths staggered over a page (else whole pages)
    page_size: int = 1
    rows: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.rows = np.zeros(self.size, dtype=np.int64)

    def own(self, i: int) -> int:
        return self.own_tokens - (i % self.page_size if self.stagger else 0)

    def open(self, indexes: range | None = None) -> None:
        """Open the requests ``indexes`` (all by default), their rows kept in ``rows``."""
        indexes = range(self.size) if indexes is None else indexes
        rids = [f"{self.tag}{i}" for i in indexes]
        for i, rid in zip(indexes, rids, strict=True):
            self.rows[i] = self.client.alloc_row(rid)
        for rid in rids:
            if self.client.match_prefix(rid, self.shared) != len(self.shared):
                raise RuntimeError("the shared prefix is not cached")
        items = [(rid, self.own(i)) for i, rid in zip(indexes, rids, strict=True)]
        if not self.client.alloc_extend(items).fits:
            raise RuntimeError(f"cannot open a batch of {self.size}: pool too small")

    def close(self) -> None:
        for i in range(self.size):
            self.client.free_row(f"{self.tag}{i}")


def pin_shared_prefix(client: Any, shared: np.ndarray, tag: str) -> None:
    """Cache ``shared`` and keep it locked (a pinned request matches it and stays open)."""
    client.alloc_row(f"{tag}-seed")
    client.alloc_extend([(f"{tag}-seed", len(shared))])
    client.release(f"{tag}-seed", shared)
    client.alloc_row(f"{tag}-pin")
    client.match_prefix(f"{tag}-pin", shared)


# -- timing -------------------------------------------------------------------------------


def median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def timed(call: Callable[[], Any], into: list[float], count: int, between: Callable[[], None]):
    for _ in range(count):
        between()
        started = time.perf_counter()
        call()
        into.append(time.perf_counter() - started)


async def timed_async(
    call: Callable[[], Any], into: list[float], count: int, between: Callable[[], None]
) -> None:
    for _ in range(count):
        between()
        started = time.perf_counter()
        await call()
        into.append(time.perf_counter() - started)


def timed_inproc(
    call: Callable[[], Any],
    client: InProcClient,
    into: dict[str, list[float]],
    count: int,
    between: Callable[[], None],
) -> None:
    for _ in range(count):
        between()
        started = time.perf_counter()
        call()
        into["call"].append(time.perf_counter() - started)
        into["handler"].append(client.handler_s)


def once(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


async def once_async(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = await call()
    return time.perf_counter() - started, result


def must_fit(result: Any) -> None:
    if not result.fits:
        raise RuntimeError(f"decode_step did not fit (missing {result.missing})")


def nothing() -> None:
    return None
