"""PD pairing behind SGLang's router (SMG): a prefill node and a decode node meet by room.

SMG sends the same request to one prefill and one decode node, each with
``bootstrap_host``, ``bootstrap_port`` (the prefill node's, as given to SMG's
``--prefill URL PORT``) and ``bootstrap_room``. On kvstack, **the bootstrap
port is the prefill node's HTTP port**: the decode node POSTs
``/kvstack/bootstrap`` there (``{"room", "rid", "peer"}``: the room, its own
rid for the request, its memsvc's transfer socket) before it hands the request
to its scheduler; the prefill node's half waits for that registration, then
goes to its scheduler with the room, the decode rid and the peer, so that
memsvc-P sends the prompt's KV to that decode memsvc (over zmq or NIXL, as
with kvstack's own router)::

    SMG ──(room)──► decode front ──POST /kvstack/bootstrap──► prefill front
     │                  └──► scheduler-D (prealloc, pd_expect room)      │
     └────(room)─────────────────────────────────────────► scheduler-P (peer, rid)
                                     memsvc-P ══KV══► memsvc-D

A normal-mode (or kvstack-PD) front has :class:`NoPairing`: a request carrying
a bootstrap field is refused (400) rather than served without its other half.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

import aiohttp
from aiohttp import web

from kvstack.serve.errors import ApiError

BOOTSTRAP_PATH = "/kvstack/bootstrap"
BOOTSTRAP_TIMEOUT_S = 30.0  # a prefill half waits this long for its decode node
MAX_WAITING_ROOMS = 4096  # registrations kept for prefill halves not come yet


def _fields(one: Any) -> tuple[str | None, int | None, int | None]:
    return one.bootstrap_host, one.bootstrap_port, one.bootstrap_room


class NoPairing:
    """A node that pairs no transfer: bootstrap fields are refused."""

    async def kwargs(self, one: Any, rid: str) -> dict[str, Any]:
        names = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
        for name, value in zip(names, _fields(one), strict=True):
            if value is not None:
                raise ApiError(
                    400,
                    "unsupported_field",
                    f"{name} is not supported by this node: it is not a PD node behind "
                    "SGLang's router (kvstack serve --mode prefill / decode are)",
                    param=name,
                )
        return {}

    async def close(self) -> None:
        pass


class DecodePairing:
    """A decode node: tell the prefill node where to send the room's KV, then expect it."""

    def __init__(self, transfer: str, timeout_s: float = 10.0) -> None:
        self.transfer = transfer  # this node's memsvc --transfer-listen
        self.timeout_s = timeout_s
        self._http: aiohttp.ClientSession | None = None

    async def kwargs(self, one: Any, rid: str) -> dict[str, Any]:
        host, port, room = _fields(one)
        if host is None or port is None or room is None:
            raise ApiError(
                400,
                "invalid_request",
                "a decode node needs bootstrap_host, bootstrap_port and bootstrap_room "
                "(SMG's --prefill URL BOOTSTRAP_PORT, the prefill node's HTTP port)",
            )
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        url = f"http://{_host(host)}:{port}{BOOTSTRAP_PATH}"
        body = {"room": room, "rid": rid, "peer": self.transfer}
        try:
            async with self._http.post(url, json=body) as response:
                if response.status != 200:
                    why = (await response.text())[:300]
                    raise ApiError(502, "bootstrap_failed", f"prefill node {url}: {why}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ApiError(502, "bootstrap_failed", f"prefill node {url}: {exc}") from None
        return {"bootstrap_room": room}

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()


class PrefillPairing:
    """A prefill node: each half waits for its decode node's registration."""

    def __init__(self, timeout_s: float = BOOTSTRAP_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._registered: OrderedDict[int, tuple[str, str, float]] = OrderedDict()
        self._waiting: dict[int, asyncio.Future] = {}

    async def register(self, request: web.Request) -> web.Response:
        """``POST /kvstack/bootstrap``: a decode node's ``{"room", "rid", "peer"}``."""
        try:
            body = await request.json()
            room, rid, peer = int(body["room"]), str(body["rid"]), str(body["peer"])
        except (ValueError, KeyError, TypeError):
            raise ApiError(400, "invalid_request", "give room, rid and peer") from None
        if not (0 <= room < 2**63) or not rid or not peer.startswith(("ipc://", "tcp://")):
            raise ApiError(400, "invalid_request", "room, rid or peer out of range")
        self.offer(room, rid, peer)
        return web.json_response({"ok": True})

    def offer(self, room: int, rid: str, peer: str) -> None:
        """A decode node's registration: to the half waiting for it, or kept for it."""
        waiter = self._waiting.pop(room, None)
        if waiter is not None and not waiter.done():
            waiter.set_result((rid, peer))
        else:
            self._registered[room] = (rid, peer, time.monotonic())
            while len(self._registered) > MAX_WAITING_ROOMS:
                self._registered.popitem(last=False)

    async def kwargs(self, one: Any, rid: str) -> dict[str, Any]:
        room = one.bootstrap_room
        if room is None:
            raise ApiError(400, "invalid_request", "a prefill node needs bootstrap_room")
        known = self._registered.pop(room, None)
        if known is not None:
            decode_rid, peer = known[0], known[1]
        else:
            waiter = asyncio.get_running_loop().create_future()
            self._waiting[room] = waiter
            try:
                decode_rid, peer = await asyncio.wait_for(waiter, self.timeout_s)
            except TimeoutError:
                raise ApiError(
                    504,
                    "bootstrap_timeout",
                    f"no decode node registered bootstrap_room {room} within {self.timeout_s:g}s",
                ) from None
            finally:
                self._waiting.pop(room, None)
        return {"bootstrap_room": room, "bootstrap_peer": peer, "bootstrap_rid": decode_rid}

    async def close(self) -> None:
        for waiter in self._waiting.values():
            waiter.cancel()


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
