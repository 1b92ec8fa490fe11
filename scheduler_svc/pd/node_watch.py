"""The router's watch over its nodes: a silent prefill node, and a restarted scheduler.

Every ``PING_INTERVAL_S`` the router asks each node's scheduler for ``info``
(the decode nodes: its own, and each peer a request moved to).
A prefill node silent for ``--prefill-timeout`` seconds fails the requests
that wait on it. A node that answers with a new pid was restarted and lost
what it ran, so it is caught up: a prefill scheduler gets the prefill requests
its predecessor had not answered, a decode scheduler every live request again
(those it adopted with their KV decode on; the rest start over).
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import TYPE_CHECKING

import zmq.asyncio

from scheduler_svc.pd.flight import error_header

if TYPE_CHECKING:
    from scheduler_svc.pd.router import Router

log = logging.getLogger("scheduler_svc.pd.router")

PING_INTERVAL_S = 1.0


class NodeWatch:
    """Pings both nodes for ``router`` and catches up the one whose scheduler restarted."""

    def __init__(self, router: Router) -> None:
        self.router = router
        # who answers: "prefill", and each decode node by address
        self.pids: dict[str, int | None] = {"prefill": None}

    async def watch_prefill(self) -> None:
        """Ping the prefill node; if it stays silent, fail what waits on it."""
        router = self.router
        while True:
            await asyncio.sleep(PING_INTERVAL_S)
            router.spawn(self._ping("prefill", router.prefill, self._prefill_restarted))
            now = time.monotonic()
            silent = now - router.prefill_seen
            if silent < router.prefill_timeout_s:
                continue
            for flight in list(router.flights.values()):
                # waited as long itself: one sent just now (a restarted prefill node may
                # not have answered a ping yet) is not failed for the node's old silence
                waited = now - max(router.prefill_seen, flight.prefill_sent)
                if waited < router.prefill_timeout_s:
                    continue
                if flight.current is not None and flight.prefill_error is None:
                    why = f"prefill node unreachable for {waited:.0f}s"
                    await router.replies.prefill_failed(
                        flight, error_header("prefill_unreachable", why, 500)
                    )

    async def watch_decode(self) -> None:
        """Ping each decode node: the router's, and those its requests moved to."""
        router = self.router
        while True:
            await asyncio.sleep(PING_INTERVAL_S)
            for address, sock in list(router.decode_nodes.items()):
                restarted = partial(self._decode_restarted, address)
                router.spawn(self._ping(address, sock, restarted))

    async def _ping(self, node: str, sock: zmq.asyncio.Socket, on_restart) -> None:
        """``info``; a new scheduler process answering (a new pid) means the old one died.

        (By the pid it reports rather than by the socket: a proxy in between
        would hide the disconnect.) The restarted scheduler serves only after
        ending its predecessor's memsvc session, so the old attempt's KV and
        transfer rooms are gone by then.
        """
        info = await self.router.call(sock, {"op": "info"}, timeout=PING_INTERVAL_S)
        pid = info.get("pid") if info and info.get("ok") else None
        if pid is None:
            return
        known, self.pids[node] = self.pids.get(node), pid
        if known is not None and known != pid:
            await on_restart()

    async def _prefill_restarted(self) -> None:
        """The prefill scheduler was restarted: the new one gets what the old had not answered.

        Same rid and room: the decode side still waits for that room. (The
        successor ended its predecessor's memsvc session first, which cancelled
        the transfers that session had started: those requests fail with 500.)
        """
        router = self.router
        resent = 0
        for flight in list(router.flights.values()):
            current = flight.prefill_ops.get(flight.current) if flight.current else None
            mark = flight.commit_mark
            router.drop_prefill_ops(flight)
            if flight.redrive_pending:
                await router.replies.prefill_again(flight)
            elif current is not None:
                await router.send_prefill(flight, *current, commit_mark=mark)
            else:
                continue
            resent += 1
        router.stats["prefill_resends"] += resent
        log.warning("prefill scheduler restarted: %d requests sent to it again", resent)

    async def _decode_restarted(self, address: str) -> None:
        """The decode scheduler at ``address`` was restarted: reattach what it adopted,
        start over the rest.

        Each live request it held goes to the new decode scheduler again (under its own
        room; the stream restarts at offset 0 and clients drop what they already
        have). One the new scheduler adopted from its predecessor with its KV
        (:mod:`scheduler_svc.adopt`; asked with ``adopted``) decodes on from
        there: nothing is prefilled again, and what the prefill node still runs
        for it is aborted. Every other one has its prompt prefilled again under a
        new name on the prefill node, once that node has answered the prefill it
        still runs for the room (that one may deliver to the new decode scheduler
        instead, or fail: either way the new prefill follows), on the router's own
        decode node (the one the prefill node sends KV to), also when it had moved
        to a peer. Re-bootstraps for the old scheduler's rooms are aborted.
        """
        router = self.router
        flights = [f for f in router.flights.values() if f.decode_address == address]
        adopted = await self._adopted(flights, router.decode_nodes[address])
        for flight in [f for f in flights if f.rid in adopted]:
            await router.abort_on_prefill(router.drop_prefill_ops(flight), flight.client)
            flight.redrive_pending = False
            flight.prefill_error = None
            await router.send_decode(flight)
        flights = [f for f in flights if f.rid not in adopted]
        for flight in flights:
            room = flight.header["bootstrap_room"]
            stale = [op for op, (h, _) in flight.prefill_ops.items() if h["bootstrap_room"] != room]
            stale_rids = [flight.prefill_ops[op][0]["rid"] for op in stale]
            await router.abort_on_prefill(stale_rids, flight.client)
            for op in stale:
                del flight.prefill_ops[op]
                router.by_prefill_op.pop(op, None)
            flight.redrives += 1
            flight.prefill_error = None
            flight.current = None
            # on the router's decode node: the one the prefill node sends KV to (a request
            # that had moved to a peer starts over there)
            flight.decode_address = router.decode_address
            await router.send_decode(flight)
            if flight.prefill_ops:
                flight.redrive_pending = True  # prefill again once they are answered
            else:
                await router.replies.prefill_again(flight)
        router.stats["redrives"] += len(flights)
        router.stats["reattached"] += len(adopted)
        log.warning(
            "decode scheduler restarted: %d requests reattached with their KV, %d started over",
            len(adopted),
            len(flights),
        )

    async def _adopted(self, flights: list, sock: zmq.asyncio.Socket) -> set[str]:
        """The rids of ``flights`` the restarted decode scheduler adopted with their KV (none
        if it does not answer: those start over)."""
        if not flights:
            return set()
        query = {
            "op": "adopted",
            "rids": [f.rid for f in flights],
            "clients": [f.client for f in flights],
        }
        reply = await self.router.call(sock, query)
        if reply is None or not reply.get("ok"):
            log.warning("the restarted decode scheduler did not say what it adopted: %s", reply)
            return set()
        return set(reply.get("rids") or ())
