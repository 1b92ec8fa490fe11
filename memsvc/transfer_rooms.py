"""PD transfer rooms: one request's KV transfer, its states, and the book of all of them.

Per-room state (SGLang's ``KVPoll``): Bootstrapping -> WaitingForInput ->
Transferring -> Success, or Failed with a reason. A :class:`Room` is the same
record on either side; :class:`RoomBook` holds one memsvc's rooms and counts
how they ended. The messages between the two sides are
:mod:`memsvc.transfer`'s (the protocol), :mod:`memsvc.transfer_decode`'s
and :mod:`memsvc.transfer_prefill`'s (each side's part of it).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

from memsvc.core.errors import InvalidArgumentError
from memsvc.core.pool import KVPool
from memsvc.core.swa_radix_cache import swa_tail_start
from memsvc.limits import MessageLimit
from memsvc.movers import CHUNK_PAGES

log = logging.getLogger("memsvc.transfer")

HELLO_INTERVAL_S = 0.5
QUERY_RETRY_S = (0.002, 0.1)  # first and longest wait between queries for a room not yet expected
BOOTSTRAP_TIMEOUT_ENV, BOOTSTRAP_TIMEOUT_S = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0


def bootstrap_timeout_from_env() -> float:
    """SGLang's prefill-side wait for the decode side to expect a room, in seconds."""
    value = os.environ.get(BOOTSTRAP_TIMEOUT_ENV)
    return BOOTSTRAP_TIMEOUT_S if value in (None, "") else float(value)


class KVPoll(IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


Peer = tuple[bytes, str | None]  # a transfer peer: its connection's routing id, its CURVE key


def listener_limit(pool: KVPool) -> MessageLimit:
    """What a prefill peer may send the listener at once: one data chunk and a small header."""
    layout = pool.buffers.layout
    chunk_bytes = CHUNK_PAGES * max(layout.bytes_per_page, layout.swa_bytes_per_page)
    return MessageLimit(max_bytes=chunk_bytes + (1 << 20), max_frames=4, hard_factor=1)


def page_geometry(pool: KVPool) -> list[Any]:
    """What must agree between two pools for their pages to be interchangeable."""
    layout = pool.buffers.layout
    geometry = [layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.page_size]
    geometry.append(layout.dtype)
    if layout.is_hybrid:  # the same layers in each pool, the same window
        geometry += [list(layout.layer_types), layout.sliding_window]
    return geometry


def swa_window_pages(pool: KVPool, pages: np.ndarray, num_tokens: int) -> np.ndarray | None:
    """A hybrid pool's SWA-pool pages of the window of ``num_tokens`` positions on full
    ``pages`` (from ``floor_page(max(0, num_tokens - W))``, the SWA tail the next query
    reads); None without sliding layers. Raises if one has no SWA page (freed)."""
    layout = pool.layout
    f2s = pool.buffers.full_to_swa_page
    if not layout.is_hybrid or f2s is None:
        return None
    swa_from = swa_tail_start(num_tokens, layout.sliding_window, layout.page_size)
    swa_pages = f2s[pages[swa_from // layout.page_size :]].astype(np.int64)
    if not swa_pages.all():
        raise InvalidArgumentError("a page of the request's window has no SWA KV (freed)")
    return swa_pages


@dataclass
class Room:
    """One request's transfer, on either side."""

    room: int
    rid: str
    pages: np.ndarray
    num_tokens: int
    state: KVPoll
    created: float
    why: str = ""
    first_token: int = -1
    cached_tokens: int = 0
    # prefill side
    next_query: float = 0.0
    query_wait: float = QUERY_RETRY_S[0]
    waiting_since: float = 0.0  # when the last message that expects an answer went out
    handle: Any = None
    started: float = 0.0
    # decode side
    chunks: dict[int, int] = field(default_factory=dict)  # zmq: first page -> pages received
    # hybrid models: this side's SWA-pool pages of the window (see swa_window_pages)
    swa_pages: np.ndarray | None = None
    swa_chunks: dict[int, int] = field(default_factory=dict)  # zmq: as chunks, SWA pages
    bytes: int = 0
    owner: int = 0  # the memsvc session whose request this is
    peer: Peer | None = None  # decode side: the peer whose query opened the room
    peer_rid: str = ""  # prefill side: the rid the decode side expects
    peer_address: str = ""  # prefill side: the decode node's transfer socket it goes to
    # sending from the host store (a retracted request migrating): its pages, in order
    host_pages: np.ndarray | None = None
    swa_host_pages: np.ndarray | None = None  # hybrid: its window's SWA pages, in order

    def report(self) -> dict[str, Any]:
        return {
            "room": self.room,
            "rid": self.rid,
            "state": int(self.state),
            "why": self.why,
            "first_token": self.first_token,
            "cached_tokens": self.cached_tokens,
        }


class RoomBook:
    """One memsvc's rooms by id, and the count of how they ended."""

    def __init__(self) -> None:
        self.rooms: dict[int, Room] = {}
        self.counters = {"success": 0, "failed": 0, "bytes": 0, "seconds": 0.0}

    def finish(self, room: Room, why: str | None) -> None:
        """End ``room``: a success (``why`` None) or a failure for ``why``; once only."""
        if room.state in (KVPoll.SUCCESS, KVPoll.FAILED):
            return
        if why is None:
            room.state = KVPoll.SUCCESS
            self.counters["success"] += 1
            if room.started:
                self.counters["bytes"] += room.bytes
                self.counters["seconds"] += time.monotonic() - room.started
        else:
            room.state, room.why = KVPoll.FAILED, why
            self.counters["failed"] += 1
            log.warning("transfer of room %d (%s) failed: %s", room.room, room.rid, why)

    def cancelled(self, room: Room) -> None:
        """``room`` was dropped while still in flight."""
        self.counters["failed"] += 1

    def report(self, room_id: int) -> dict[str, Any]:
        room = self.rooms.get(room_id)
        if room is None:
            return {"room": room_id, "state": int(KVPoll.FAILED), "why": "unknown room"}
        return room.report()

    def stats(self) -> dict[str, Any]:
        by_state = {s.name.lower(): 0 for s in KVPoll}
        for room in self.rooms.values():
            by_state[room.state.name.lower()] += 1
        return {**self.counters, "rooms": by_state}
