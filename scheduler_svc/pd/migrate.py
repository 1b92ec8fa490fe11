"""A retracted request moves to another decode node with its KV (issue 32, part 2).

A decode node retracts by parking a victim's KV in its memsvc's host store;
the victim then waits, FIFO, in the node's retracted queue until the pool has
room for it again (and while anything waits there, no new request is
preallocated). With ``--migrate-to`` naming another decode node's scheduler,
a victim at the head of that queue that cannot resume here moves there
instead, when that node says it has room::

    scheduler-D1 ── info ─────────────────────────────► scheduler-D2
                 ◄─ its preallocation budget, queues, transfer socket
    memsvc-D1  ══ pd_send(from_host): the host entry ══► memsvc-D2's room
    scheduler-D1 ── migrate_in(rid, prompt, outputs, sampling, room) ─► scheduler-D2
                    D2 preallocates the KV's pages, expects the room, and once
                    they are written decodes on from the last token
    router ◄─ moved(D2) ── scheduler-D1     (a client that follows moves: the router)
    router ── generate (same rid) ─► scheduler-D2, which streams to it from then on
    (any other client: scheduler-D1 relays D2's chunks, then done, to it)

Nothing is computed again: the KV D2 receives is the host copy D1 made at the
retract, and D2 continues from the same tokens, so greedy and seeded outputs
are those of a run without the move. Until memsvc-D1 reports the room a
success, the request is D1's: a failed or refused move puts it back at the
head of D1's retracted queue with its host copy, as if nothing happened
(D2's side of the room fails and frees its pages). After it, D1 drops the host
copy, and either tells the client where the request went (``moved``) or keeps
only the relay (scheduler_svc.pd.moved).

The policy: move the head of the retracted queue (the request waiting
longest) when it cannot resume here this step, moving it beats waiting here
(the retract cost model, ``--migrate-policy cost``; ``always`` skips that) and
the peer's budget takes it (what D2 would admit into preallocation now, with
nothing retracted or queued there). Moves in flight are bounded by
:data:`MAX_IN_FLIGHT`. The peer's figures are asked in the background, never
on the decode step: at most every :data:`INFO_EVERY_S` while something waits,
each move spending from them, and not used once older than
:data:`INFO_STALE_S`; a peer that does not answer within :data:`INFO_TIMEOUT_S`
is left alone for :data:`PEER_DOWN_WAIT_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memsvc.curve import CurveClientKeys
from scheduler_svc.adopt import Owner
from scheduler_svc.client import AsyncGenerateClient
from scheduler_svc.core import Req
from scheduler_svc.core.sampling import SamplingParams

log = logging.getLogger("scheduler_svc")

MAX_IN_FLIGHT = 8
INFO_EVERY_S = 0.2
INFO_TIMEOUT_S = 2.0
INFO_STALE_S = INFO_TIMEOUT_S + INFO_EVERY_S  # older figures are not acted on
# A peer that did not answer its info within INFO_TIMEOUT_S is not asked again for this
# long: the step that asked waited for it, and the next ones must not.
PEER_DOWN_WAIT_S = 10.0
LOST_MESSAGE = "Request {rid} moved to decode node {peer}, which stopped answering."


def sampling_record(sp: SamplingParams) -> dict[str, Any]:
    """The wire's ``sampling`` of a request, from its params: how each token is drawn
    (``draw``) and its limits."""
    return {
        **sp.draw,
        "max_new_tokens": sp.max_new_tokens,
        "min_new_tokens": sp.min_new_tokens,
        "ignore_eos": sp.ignore_eos,
        "stop": list(sp.stop),
        "stop_token_ids": sorted(sp.stop_token_ids),
        "no_stop_trim": sp.no_stop_trim,
        "skip_special_tokens": sp.skip_special_tokens,
    }


@dataclass
class Relay:
    """One moved request's replies from the peer (the call's queue) and its tokens so far."""

    rid: str
    op_id: int
    queue: asyncio.Queue
    tokens: list[int]
    held: list[dict[str, Any] | None] = field(default_factory=list)  # read before the commit
    started: float = field(default_factory=time.monotonic)
    owner: str | None = None  # the request's client, which owns it on the peer

    async def next_reply(self) -> dict[str, Any] | None:
        """The peer's next reply for the request (None: the connection dropped)."""
        if self.held:
            return self.held.pop(0)
        return await self.queue.get()


class MigrationPeer:
    """The decode node this one moves retracted requests to (see the module docstring)."""

    def __init__(
        self, address: str, *, timeout_s: float = 60.0, curve: CurveClientKeys | None = None
    ) -> None:
        self.address = address
        self.client = AsyncGenerateClient(address, timeout_s=timeout_s, curve=curve)
        self.relays: dict[str, Relay] = {}
        # A request's client and fingerprint here (the service's; None: not known): the
        # peer lets that client re-submit or abort the moved request.
        self.owner_of: Callable[[str], Owner | None] = lambda rid: None
        self._info: dict[str, Any] | None = None
        self._info_at = 0.0  # when the figures in hand arrived
        self._next_ask = 0.0  # no ask before then
        self._asking: asyncio.Task[None] | None = None
        self._budget = 0

    def refresh(self) -> asyncio.Task[None] | None:
        """Ask the peer's figures in the background unless an ask is under way or it is
        too soon (INFO_EVERY_S since the last one; PEER_DOWN_WAIT_S after a silence);
        returns the ask under way, if any."""
        now = time.monotonic()
        if (self._asking is None or self._asking.done()) and now >= self._next_ask:
            self._next_ask = now + INFO_EVERY_S
            self._asking = asyncio.ensure_future(self._ask())
        return None if self._asking is None or self._asking.done() else self._asking

    async def _ask(self) -> None:
        try:
            info = await asyncio.wait_for(self.client.info(), INFO_TIMEOUT_S)
        except Exception as exc:  # a peer down or slow: nothing moves for a while
            log.warning("migration peer %s does not answer (%s)", self.address, exc)
            self._info, self._next_ask = None, time.monotonic() + PEER_DOWN_WAIT_S
            return
        self._info, self._info_at = info, time.monotonic()
        self._budget = int(info.get("prealloc_budget", 0))

    async def room_for(self, tokens: int) -> str | None:
        """The peer memsvc's transfer socket if the peer, by its latest figures, can take a
        request holding ``tokens`` KV slots (its reserve included) now; None otherwise.
        Never waits on the peer (:meth:`refresh`): until its first figures arrive, and
        once they are older than INFO_STALE_S, nothing moves."""
        self.refresh()
        info = self._info
        if info is None or time.monotonic() - self._info_at > INFO_STALE_S:
            return None
        queues = info.get("queues") or {}
        if info.get("mode") != "decode" or not info.get("transfer_listen") or info.get("draining"):
            return None
        if queues.get("retracted") or queues.get("prealloc") or tokens > self._budget:
            return None
        self._budget -= tokens
        return str(info["transfer_listen"])

    async def hand_over(self, req: Req, room: int) -> None:
        """Ask the peer to take ``req`` (its KV will arrive in ``room``); its replies wait
        in the relay's queue until the move is committed or cancelled."""
        header = {
            "op": "migrate_in",
            "rid": req.rid,
            "sampling": sampling_record(req.sampling_params),
            "priority": req.priority,
            "namespace": req.namespace,
            "room": room,
            "retractions": req.retraction_count,
            "cached_tokens": req.cached_tokens,
        }
        owner = self.owner_of(req.rid)
        if owner is not None:
            header.update(owner=owner.client, fingerprint=owner.fingerprint)
        arrays = {
            "input_ids": np.asarray(req.origin_input_ids, dtype=np.int64),
            "output_ids": np.asarray(req.output_ids, dtype=np.int64),
        }
        op_id, queue = await self.client.open_call(header, arrays)
        owner = header.get("owner")
        self.relays[req.rid] = Relay(req.rid, op_id, queue, list(req.output_ids), owner=owner)

    def refused(self, rid: str) -> str | None:
        """Why the peer will not take ``rid`` (it answered with an error, or its
        connection dropped), if it said so already; None otherwise. What it sent
        is kept for the relay."""
        relay = self.relays.get(rid)
        if relay is None:
            return None
        while not relay.queue.empty():
            relay.held.append(relay.queue.get_nowait())
        for reply in relay.held:
            if reply is None:
                return f"the connection to {self.address} dropped"
            if not reply.get("ok", False):
                return str(reply.get("message") or reply.get("code") or "refused")
            if reply.get("type") == "done":  # it ended there before its KV was there
                reason = (reply.get("meta_info") or {}).get("finish_reason") or {}
                return str(reason.get("message") or "it ended on the peer")
        return None

    async def cancel(self, rid: str) -> None:
        """The move failed here: drop the relay and end the peer's side of it."""
        relay = self.relays.pop(rid, None)
        if relay is None:
            return
        self.client.close_call(relay.op_id)
        await self._abort_there(relay)  # the peer may never have seen it

    async def abort(self, rid: str) -> bool:
        """The client aborts a moved request: the peer ends it (its done is relayed)."""
        relay = self.relays.get(rid)
        if relay is None:
            return False
        await self._abort_there(relay)
        return True

    async def _abort_there(self, relay: Relay) -> None:
        """Abort the request on the peer, as its owner there (best effort)."""
        abort = self.client.abort(relay.rid, as_client=relay.owner)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(abort, INFO_TIMEOUT_S)

    def finished(self, rid: str) -> None:
        relay = self.relays.pop(rid, None)
        if relay is not None:
            self.client.close_call(relay.op_id)

    async def close(self) -> None:
        if self._asking is not None:
            self._asking.cancel()
        for rid in list(self.relays):
            self.finished(rid)
        await self.client.close()
