"""Putting the scheduler back together after a memsvc fault, on the engine's own state.

An engine step that raises has stopped half-way: a prefill batch may hold
rows and slots whose forward pass never ran, a decode step may have
allocated slots it never filled. :class:`Recovery` decides what the failure
means and has the engine repair its own queues (its ``requeue_kv_holders``,
``rollback_torn``, ``fail_request``) so that the next step starts from a
consistent state:

- **memsvc lost our KV** (it restarted with a new epoch and an empty pool, it
  stopped answering, it expired our session after a stall, which model_svc
  may report first by refusing rows without KV, or it rejected a message
  damaged in transit): open a new session (with backoff, bounded by
  ``recovery_timeout_s``), end the old one so memsvc reclaims whatever it
  still held, and treat every request that held KV (running, the chunked
  one, one in a half-built prefill batch) as retracted: ``reset_for_retract``
  keeps its output, and it is re-prefilled from ``origin_input_ids +
  output_ids`` ahead of the requests that never started. With greedy (or
  seeded) sampling its tokens come out the same. A PD engine has its own
  queues and says what losing the KV means for them (its own
  ``requeue_kv_holders(why)``, see :mod:`scheduler_svc.pd`).
- **a request id is owned by another session** (the session of a scheduler
  that died before us, until memsvc ends it): undo the half-built batch and
  try again shortly; past the timeout the request ends with an explicit error.
- anything else: :class:`RecoveryFailedError`, and the service ends every
  live request with an explicit error (then reclaims the KV with a new session).

The session id of the live session is kept in ``session_file`` (if given), so
a scheduler restarted by the supervisor adopts its dead predecessor's session
(its requests and their KV, :mod:`scheduler_svc.adopt`: nothing re-prefilled),
or, when it cannot, ends it at once instead of waiting for the lease to run out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from memsvc import protocol as wire
from memsvc import rpc
from memsvc.cli import write_private_file
from memsvc.client import AsyncMemClient, EpochChangedError, PeerDeadError, RequestRejectedError
from memsvc.core.errors import MemsvcError
from memsvc.curve import CurveClientKeys
from memsvc.sessions import NotOwnerError, UnknownSessionError
from model_svc.client import ForwardError
from scheduler_svc import adopt

if TYPE_CHECKING:
    from scheduler_svc.engine import Engine

log = logging.getLogger("scheduler_svc")

# Failures after which the pool (or our session in it) is gone or in an unknown state.
KV_LOST_ERRORS = (EpochChangedError, PeerDeadError, UnknownSessionError, RequestRejectedError)
MAX_CONSECUTIVE_RESETS = 3  # resets without one clean step in between: give up
NOT_OWNER_PAUSE_S = 0.25
BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 2.0
GOODBYE_TIMEOUT_S = 2.0


class RecoveryFailedError(Exception):
    """The fault cannot be repaired; the message names it (it goes to every live request)."""


@dataclass
class RecoveryStats:
    memsvc_resets: int = 0  # new sessions opened after losing the KV
    requeued_reqs: int = 0  # requests re-prefilled because their KV was lost
    rolled_back_reqs: int = 0  # requests taken out of a half-built prefill batch
    not_owner_waits: int = 0
    failures: int = 0  # faults that ended every live request
    # A restart after the scheduler died: KV tokens of the dead scheduler's requests that
    # memsvc freed (each to be computed again), and what this scheduler adopted instead.
    reprefilled_tokens: int = 0
    adopted_reqs: int = 0
    adopted_kv_tokens: int = 0
    discarded_step_tokens: int = 0  # slots of the step in flight at the death, freed

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def kv_lost(exc: BaseException) -> bool:
    """Whether ``exc`` means our memsvc session's KV is gone or can no longer be trusted."""
    if isinstance(exc, KV_LOST_ERRORS):
        return True
    # model_svc maps a newer pool than the one we named: memsvc restarted under us.
    return isinstance(exc, ForwardError) and exc.code == "stale_pool"


async def end_session(
    address: str,
    session: str,
    timeout_s: float = GOODBYE_TIMEOUT_S,
    *,
    curve: CurveClientKeys | None = None,
) -> bool:
    """Say goodbye for ``session`` (memsvc reclaims all it held); True if memsvc ended it."""
    return (await goodbye(address, session, timeout_s, curve=curve)) is not None


async def goodbye(
    address: str,
    session: str,
    timeout_s: float = GOODBYE_TIMEOUT_S,
    *,
    curve: CurveClientKeys | None = None,
) -> dict[str, Any] | None:
    """:func:`end_session`, returning memsvc's reply (None: it did not end it)."""
    ctx = zmq.asyncio.Context()
    sock = rpc.dealer(ctx, address, curve)
    try:
        frames = wire.pack({"op": "goodbye", "op_id": 1, "session": session})
        reply = await rpc.request_async(sock, frames, 1, timeout_s, 1)
        return reply if reply.get("ok") else None
    except rpc.NoReplyError:
        return None
    finally:
        sock.close(0)
        ctx.term()


class Recovery:
    """Repairs the engine after a failed step (see the module docstring).

    ``connect_mem()`` opens a new memsvc session (an :class:`AsyncMemClient`
    like the engine's) at ``memsvc_address``; ``recovery_timeout_s`` bounds
    each wait for memsvc. Without ``connect_mem`` every fault is final.
    """

    def __init__(
        self,
        engine: Engine,
        connect_mem: Callable[[], Awaitable[AsyncMemClient]] | None,
        memsvc_address: str = "",
        *,
        recovery_timeout_s: float = 120.0,
        session_file: str | os.PathLike | None = None,
        curve: CurveClientKeys | None = None,
    ) -> None:
        self.engine = engine
        self.connect_mem = connect_mem
        self.memsvc_address = memsvc_address
        self.curve = curve  # for the goodbyes it sends memsvc itself
        self.recovery_timeout_s = recovery_timeout_s
        self.session_file = Path(session_file) if session_file else None
        self.stats = RecoveryStats()
        self.adopted: adopt.Adopted | None = None  # what adopt_session took over
        self._consecutive = 0
        self._blocked: tuple[str, float] | None = None  # (rid, since) refused as not ours

    # -- start-up --------------------------------------------------------------

    async def adopt_session(self) -> None:
        """Take over the session a dead predecessor left in ``session_file`` (its
        requests and their KV, :mod:`scheduler_svc.adopt`), or end it when this engine
        keeps no journal or memsvc refuses; then record ours."""
        if self.session_file is None:
            return
        with contextlib.suppress(OSError):
            old = self.session_file.read_text().strip()
            if old and old != self.engine.mem.session and not await self._adopt(old):
                reply = await goodbye(self.memsvc_address, old, curve=self.curve)
                if reply is not None:
                    self.stats.reprefilled_tokens += int(reply.get("reclaimed_tokens", 0))
                log.info("ended the previous scheduler's memsvc session: %s", reply is not None)
        self._record_session()

    async def _adopt(self, old: str) -> bool:
        if self.engine.journal is None:
            return False
        try:
            reply = await adopt.adopt(self.engine, old)
        except MemsvcError as exc:
            log.info("did not adopt the previous scheduler's memsvc session: %s", exc)
            return False
        adopted = adopt.rebuild(self.engine, reply)
        self.adopted = adopted
        await self.engine.journal.close(self.engine, adopted.dropped)
        taken = len(reply["records"]) - len(adopted.dropped)
        stats = self.stats
        stats.adopted_reqs += taken
        stats.adopted_kv_tokens += adopted.kv_tokens
        stats.discarded_step_tokens += adopted.trimmed_tokens
        stats.reprefilled_tokens += adopted.freed_tokens
        log.warning(
            "adopted the previous scheduler's session: %d requests (%d decoding on, %d in the "
            "host store, %d waiting for their client), %d KV tokens kept, %d freed; %d left "
            "to the router",
            taken,
            adopted.running,
            adopted.from_host,
            len(adopted.parked),
            adopted.kv_tokens,
            adopted.freed_tokens,
            len(adopted.dropped),
        )
        return True

    def _record_session(self) -> None:
        if self.session_file is None or self.engine.mem.session is None:
            return
        # The session id lets its holder end this scheduler's memsvc session: ours alone.
        write_private_file(self.session_file, self.engine.mem.session)

    # -- after a failed step ---------------------------------------------------

    def step_succeeded(self) -> None:
        self._consecutive = 0

    async def recover(self, exc: BaseException) -> float:
        """Repair the engine after ``exc``; returns seconds to pause before the next step.

        Raises :class:`RecoveryFailedError` when the fault cannot be repaired.
        """
        exc = await self._explain(exc)
        if isinstance(exc, NotOwnerError):
            try:
                return await self._not_owner(exc)
            except MemsvcError as again:
                exc = again  # memsvc failed while we undid the batch: start over
        if not kv_lost(exc) or self.connect_mem is None:
            raise RecoveryFailedError(f"{type(exc).__name__}: {exc}")
        self._consecutive += 1
        if self._consecutive > MAX_CONSECUTIVE_RESETS:
            raise RecoveryFailedError(
                f"memsvc failed {self._consecutive} times in a row, last: "
                f"{type(exc).__name__}: {exc}"
            )
        why = f"{type(exc).__name__}: {exc}"
        await self.new_session(why)
        requeued = self.engine.requeue_kv_holders(why)
        self.stats.requeued_reqs += len(requeued)
        log.warning(
            "memsvc recovery: new session (epoch %s); %d requests re-queued for re-prefill: %s",
            self.engine.mem.epoch,
            len(requeued),
            [r.rid for r in requeued],
        )
        return 0.0

    async def _explain(self, exc: BaseException) -> BaseException:
        """The memsvc fault behind a forward refused for missing KV, if there is one.

        model_svc refuses a batch whose rows have no KV slots: after a stall
        longer than our lease, memsvc expired the session and cleared its rows
        before our next memsvc op could say so. A heartbeat tells.
        """
        if not (isinstance(exc, ForwardError) and exc.code == "invalid_batch"):
            return exc
        try:
            await self.engine.mem.heartbeat()
        except MemsvcError as cause:
            log.warning("model_svc refused the batch (%s): memsvc says %s", exc, cause)
            return cause
        return exc

    async def _not_owner(self, exc: NotOwnerError) -> float:
        head = self.engine.waiting[0] if self.engine.waiting else None
        torn = await self.engine.rollback_torn()
        self.stats.rolled_back_reqs += len(torn)
        self.stats.not_owner_waits += 1
        if head is None:
            return NOT_OWNER_PAUSE_S
        now = time.monotonic()
        if self._blocked is None or self._blocked[0] != head.rid:
            self._blocked = (head.rid, now)
            log.warning("request %s is still held by another memsvc session: waiting", head.rid)
        elif now - self._blocked[1] > self.recovery_timeout_s:
            self._blocked = None
            message = f"request id {head.rid!r} is held by another memsvc session: {exc}"
            self.engine.fail_request(head, message, 409)
        return NOT_OWNER_PAUSE_S

    async def new_session(self, why: str, *, timeout_s: float | None = None) -> None:
        """Swap the engine's memsvc client for a new session; end the old one.

        The old client stays in place until the new one is connected, so the
        engine always holds a usable client.
        """
        timeout_s = self.recovery_timeout_s if timeout_s is None else timeout_s
        fresh = await self._connect(time.monotonic() + timeout_s, why)
        old = self.engine.mem
        old_session = old.session
        self.engine.mem = fresh
        self.stats.memsvc_resets += 1
        if self.engine.journal is not None:  # the new session has none of our records
            self.engine.journal.reset()
        close = getattr(old, "close", None)  # an in-process client (tests, sim) has none
        if close is not None:
            await close(goodbye=False)
        if old_session is not None and fresh.epoch == old.epoch:
            # memsvc reclaims what it held
            await end_session(self.memsvc_address, old_session, curve=self.curve)
        self._record_session()

    async def reclaim(self) -> None:
        """After every live request was failed: a new session, so nothing stays held."""
        if self.connect_mem is None:
            return
        try:
            await self.new_session("reclaim after failure", timeout_s=GOODBYE_TIMEOUT_S * 3)
        except RecoveryFailedError as exc:
            log.warning("could not reclaim the scheduler's KV now: %s", exc)

    async def _connect(self, deadline: float, why: str) -> AsyncMemClient:
        delay = BACKOFF_START_S
        last = why
        while (left := deadline - time.monotonic()) > 0:
            try:
                return await asyncio.wait_for(self.connect_mem(), left)
            except (MemsvcError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0)))
            delay = min(delay * 2, BACKOFF_MAX_S)
        raise RecoveryFailedError(
            f"memsvc did not come back within {self.recovery_timeout_s:.0f}s after {why} "
            f"(last: {last})"
        )
