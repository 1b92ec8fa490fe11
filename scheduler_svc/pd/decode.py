"""The PD decode node's scheduling loop (see :mod:`scheduler_svc.pd`)."""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from memsvc.client import RetractTarget
from memsvc.core.errors import (
    InvalidArgumentError,
    MemsvcError,
    OutOfRowsError,
)
from memsvc.transfer import KVPoll
from scheduler_svc.core import Req, ReqState, ceil_page
from scheduler_svc.core.swa_budget import full_available_of
from scheduler_svc.engine import Engine
from scheduler_svc.pd.decode_swa import DecodeSwaBudget
from scheduler_svc.pd.migrate import MAX_IN_FLIGHT, MigrationPeer
from scheduler_svc.pd.rooms import (
    TRANSFER_POLL_S,
    abort_locally,
    settled_rooms,
    transfer_failed_message,
)

log = logging.getLogger("scheduler_svc")
TIMELINE_LEN = 4096
MIGRATE_IN_TIMEOUT_S = 30.0  # a moved request whose KV has not arrived by then ends (504)


class DecodeEngine(Engine):
    """Decode only: prompts' KV arrives from the prefill node; retract parks KV in host RAM."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prealloc: deque[Req] = deque()
        self.transfer: dict[int, Req] = {}
        self.retracted: deque[Req] = deque()
        self._rows: dict[str, int] = {}  # rows reserved for requests awaiting their KV
        self.swa_budget = DecodeSwaBudget(self)  # a hybrid pool's SWA gates (pass otherwise)
        # Re-bootstrap rooms: never collide with the router's (< 2**62), nor (a random
        # start) with those a restarted predecessor left on the prefill node.
        self._next_room = (1 << 62) + (secrets.randbelow(1 << 40) << 16)
        self.on_rebootstrap: Callable[[Req, int, list[int]], None] = lambda *a: None
        # Retracted requests moving to another decode node (scheduler_svc.pd.migrate):
        # the peer (None: --migrate-to not given), the moves in flight by room, and
        # what the service does with a committed one (relays its replies).
        self.migration: MigrationPeer | None = None
        self.migrating: dict[int, Req] = {}
        self.migrate_always = False  # --migrate-policy always: no cost model
        self._moving_since: dict[int, float] = {}  # room -> when its send started
        self.draining = False  # every request moves to the peer (SIGTERM with a peer)
        self.on_migrated: Callable[[Req], None] = lambda req: None
        # Moved here from another node, their KV on its way: rid -> when they give up on it.
        self.arrived: dict[str, float] = {}
        self.migrate_in_timeout_s = MIGRATE_IN_TIMEOUT_S
        # (forward pass, event, rid) for tests and plots: prealloc / commit / retract / resume.
        self.timeline: deque[tuple[int, str, str]] = deque(maxlen=TIMELINE_LEN)
        for name in (
            "transfer_failed",
            "prealloc_reqs",
            "rebootstraps",
            "host_full_aborts",
            "migrated_out_reqs",
            "migrated_out_tokens",
            "migrate_failed",
            "migrated_in_reqs",
            "migrated_from_row_reqs",
            "migrated_handed_off_reqs",
            "migrate_waited_steps",
        ):
            setattr(self.stats, name, 0)

    @property
    def idle(self) -> bool:
        return super().idle and not (
            self.prealloc or self.transfer or self.retracted or self.migrating
        )

    def idle_wait_s(self, default: float) -> float:
        busy = self.transfer or self.retracted or self.prealloc or self.migrating
        return TRANSFER_POLL_S if busy else default

    def _event(self, kind: str, req: Req) -> None:
        self.timeline.append((self.stats.forward_passes, kind, req.rid))

    def _enqueue(self, req: Req) -> None:
        """A submitted request waits for its preallocation (its KV comes from the prefill node)."""
        self.prealloc.append(req)

    async def step(self) -> bool:
        await self._apply_commands()
        if not self.running and (self.retracted or self.prealloc):
            await self.mem.heartbeat()  # fresh sizes when no decode step brought them
        if self.draining:  # nothing resumes here: everything moves to the peer
            resumed: list[Req] = []
            did = False
        else:
            resumed = await self._resume_retracted()
            did = bool(resumed)
        if self.migration is not None:
            did = await self._migrate_retracted() or did
            if self.draining and self.migration is not None:
                did = await self._move_running() or did
            did = await self._poll_migrations() or did
        if self.arrived:
            did = await self._expire_arrivals() or did
        if not self.retracted:
            did = await self._preallocate(resumed) or did
            did = await self._poll_transfers() or did
        if self.running:
            await self._decode_round()
            did = True
        elif not (self.transfer or self.prealloc or self.retracted):
            self.ratio.reset()
        return did

    # -- budget (SGLang's DecodePreallocQueue._allocatable_token_budgets) --------------

    @staticmethod
    def _fill_len(req: Req) -> int:
        """The KV ``req`` holds on this node: its prompt and all but its last token."""
        return len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)

    def _required(self, req: Req) -> int:
        """Slots to reserve for ``req``: what it holds now plus the per-request reserve."""
        return self._held(req) + self.config.num_reserved_decode_tokens

    def _max_new(self, req: Req) -> int:
        """The new tokens ``req`` may still make room for: min(max_new, clip)."""
        return min(req.sampling_params.max_new_tokens, self.config.clip_max_new_tokens)

    def _final_len(self, req: Req) -> int:
        """The KV ``req`` may grow to, in whole pages: prompt + min(max_new, clip)."""
        return ceil_page(len(req.origin_input_ids) + self._max_new(req), self.config.page_size)

    def _held(self, req: Req) -> int:
        """Slots ``req``'s KV takes here: whole pages for its prompt and all but its last token."""
        return ceil_page(self._fill_len(req), self.config.page_size)

    def _single_need(self, retractable: list[Req], held: list[Req]) -> int:
        """SGLang's ``need_space_for_single_req``, extended to KV no retract can free.

        For each running request that may be retracted (``retractable``): what
        it still needs to reach its final length if every other one were
        retracted, as SGLang computes it. Beyond SGLang, the same for each
        request whose KV is held but cannot be retracted (``held``: the
        transfer queue, and the requests resumed in this step, which SGLang's
        budget does not see yet): its slots are taken, it needs only its
        growth. Lengths are counted in the whole pages a request takes, and a
        running request frees the slots it holds, not one per token it has
        (its last token has no KV yet): see docs/sglang-differences.md.
        """
        freeable = sum(map(self._held, retractable))
        needs = [self._final_len(r) for r in retractable]
        needs += [self._final_len(r) - self._held(r) for r in held]
        return max(needs, default=freeable) - freeable

    def prealloc_budget(self) -> int:
        """KV slots a request arriving now could be preallocated (what another decode node
        may move here: scheduler_svc.pd.migrate)."""
        return self._allocatable(count_retracted=True)

    def _allocatable(self, *, count_retracted: bool, need: int = 0) -> int:
        """The budget from the sizes of memsvc's last reply (every op brings them).

        A hybrid pool's full budget counts the full pool alone (SGLang's
        ``full_available_size`` under SWA-tail prealloc); the SWA pool has its
        own (:class:`~scheduler_svc.pd.decode_swa.DecodeSwaBudget`).
        """
        sizes = self.mem.sizes
        reserve = self.config.num_reserved_decode_tokens
        n_active = len(self.running) + len(self.transfer)
        hybrid = self.swa_budget.tail() is not None
        available = full_available_of(sizes) if hybrid else sizes.available
        allocatable = available + sizes.evictable - max(reserve * n_active, need)
        if count_retracted:
            allocatable -= sum(self._required(r) for r in self.retracted)
        return allocatable

    def _alone_fits(self, req: Req, allocatable: int) -> bool:
        """With nothing else active, admit what physically fits rather than starve it."""
        busy = self.running or self.transfer
        return not busy and self._required(req) - self.config.num_reserved_decode_tokens <= (
            allocatable
        )

    # -- resume ------------------------------------------------------------------------

    async def _resume_retracted(self) -> list[Req]:
        """Load retracted requests back, FIFO with head-of-line blocking; returns them.

        The budget is re-read from the pool before each one, and those already
        resumed count among the active requests: their slots and reserve leave
        it as SGLang 0.5.23 takes ``required + R`` off a budget read once
        (docs/sglang-differences.md, row 26).
        """
        resumed: list[Req] = []
        while self.retracted:
            req = self.retracted[0]
            allocatable = self._allocatable(count_retracted=False)
            if self._required(req) > allocatable and not self._alone_fits(req, allocatable):
                break  # head-of-line: FIFO
            if not self.swa_budget.resume_fits(req):
                break
            try:
                row = await self.open_row(req)
            except OutOfRowsError:
                break
            if not (await self.mem.load(req.rid)).fits:
                await self.mem.free_row(req.rid)
                break
            self.retracted.popleft()
            req.resume(row)
            self._mark_readmitted(req)
            self.stats.loaded_reqs += 1
            self.stats.loaded_tokens += req.kv_len
            self.running.append(req)
            self._event("resume", req)
            resumed.append(req)
        return resumed

    # -- migration to another decode node (scheduler_svc.pd.migrate) --------------------

    async def _migrate_retracted(self) -> bool:
        """Move the head of the retracted queue, with its host copy, to the peer decode
        node while the peer takes it; returns whether one started."""
        assert self.migration is not None
        started = False
        while self.retracted and len(self.migrating) < MAX_IN_FLIGHT:
            req = self.retracted[0]
            if not req.host_copy:
                break
            if not (self.draining or self.migrate_always or self._move_pays(req)):
                self.stats.migrate_waited_steps += 1
                break
            peer = await self.migration.room_for(self._required(req))
            if peer is None:
                break
            self.retracted.popleft()
            if not await self._send_move(req, peer):
                self.retracted.appendleft(req)
                break
            started = True
        return started

    async def _move_running(self) -> bool:
        """Draining: send running requests to the peer straight from their pool pages (no
        host-store copy), as the peer has room; returns whether one started. One the
        peer cannot take yet decodes on here meanwhile; one whose move fails decodes on
        from its row (:meth:`_poll_migrations`)."""
        assert self.migration is not None
        if not self.running:
            return False
        await self._drop_ahead()  # a row holds exactly its written KV: what is sent
        started = False
        for req in list(self.running):
            if len(self.migrating) >= MAX_IN_FLIGHT:
                break
            peer = await self.migration.room_for(self._required(req))
            if peer is None:
                break
            self.running.remove(req)
            if not await self._send_move(req, peer, from_host=False):
                self.running.append(req)
                break
            started = True
        return started

    async def _send_move(self, req: Req, peer: str, *, from_host: bool = True) -> bool:
        """Start sending ``req``'s KV (its host copy, or its row's pages) to ``peer`` and
        hand the request over; False (migration turned off) if this memsvc cannot send."""
        assert self.migration is not None
        room, self._next_room = self._next_room, self._next_room + 1
        self.migrating[room] = req
        await self.commit_journal()  # its record goes first: a successor must not take it
        try:
            await self.mem.pd_send(
                req.rid,
                room,
                req.seq_len - 1,
                req.output_ids[-1],
                req.cached_tokens,
                peer=peer,
                from_host=from_host,
            )
        except InvalidArgumentError as exc:  # this memsvc cannot send (no PD role)
            log.warning("migration to %s is off: %s", self.migration.address, exc)
            del self.migrating[room]
            self.migration = None
            return False
        self._moving_since[room] = time.perf_counter()
        await self.migration.hand_over(req, room)
        self._event("migrate", req)
        return True

    def _move_pays(self, req: Req) -> bool:
        """The retract cost model's choice for ``req``, retracted to the host store: moving
        it beats waiting here for its slots (scheduler_svc.core.retract_cost)."""
        reserve = self.config.num_reserved_decode_tokens
        running = [
            (max(self._max_new(r) - len(r.output_ids), 1), self._held(r) + reserve)
            for r in self.running
        ]
        allocatable = self._allocatable(count_retracted=False)
        return self.cost.migrate_beats_waiting(req, self._required(req), allocatable, running)

    async def _poll_migrations(self) -> bool:
        """Commit the moves whose KV arrived (the peer has the request: drop the host copy,
        or release the row it was sent from; its replies are relayed from now on), and
        take back those that failed (retracted again, or decoding on from its row)."""
        if not self.migrating:
            return False
        assert self.migration is not None
        refused = {}
        for room, req in self.migrating.items():  # the peer said no: its room never opens
            why = self.migration.refused(req.rid)
            if why is not None:
                refused[room] = {"room": room, "state": KVPoll.FAILED, "why": why}
        if refused:
            await self.mem.pd_forget(list(refused))  # cancels the sends
        done = [*refused.values()]
        done += await settled_rooms(self.mem, [r for r in self.migrating if r not in refused])
        for report in done:
            req = self.migrating.pop(report["room"])
            started = self._moving_since.pop(report["room"], None)
            from_row = req.state is ReqState.RUNNING  # sent from its row (draining)
            if report["state"] == KVPoll.FAILED:
                log.warning("request %s did not move: %s", req.rid, report["why"])
                self.stats.migrate_failed += 1
                await self.migration.cancel(req.rid)
                if from_row:
                    self.running.append(req)
                else:
                    self.retracted.appendleft(req)
                continue
            if from_row:
                await self.mem.release(req.rid, is_insert=False)
                self.stats.migrated_from_row_reqs += 1
            else:
                await self.mem.host_discard(req.rid)
                req.host_copy = False
            if started is not None:
                self.cost.observe_move(self.cost.kv_bytes(req), time.perf_counter() - started)
            self.stats.migrated_out_reqs += 1
            self.stats.migrated_out_tokens += req.seq_len - 1
            self.reqs.pop(req.rid, None)
            self._event("migrated", req)
            self.on_migrated(req)
        return bool(done)

    def accept_migrated(self, req: Req) -> None:
        """``req`` moved here from another decode node (the service checked it): it waits
        for its preallocation and its KV, for ``migrate_in_timeout_s`` at most."""
        self.arrived[req.rid] = time.monotonic() + self.migrate_in_timeout_s
        self.submit(req)

    async def _expire_arrivals(self) -> bool:
        """End the moved requests whose KV did not arrive in time (a sender that died or
        never sends): their preallocation and room go, nothing stays held."""
        now = time.monotonic()
        expired = [rid for rid, deadline in self.arrived.items() if now > deadline]
        for rid in expired:
            req = self.reqs.get(rid)
            self.arrived.pop(rid, None)
            if req is not None and req.is_retracted:
                message = (
                    f"Request {rid} moved here, but its KV did not arrive within "
                    f"{self.migrate_in_timeout_s:g}s"
                )
                await self._abort(req, message, 504)
        return bool(expired)

    # -- adoption by a restarted decode scheduler (scheduler_svc.adopt) ----------------

    recomputes_adopted = False  # one adopted without KV is left to the router to redrive

    def adoptable(self) -> Callable[[Req], bool]:
        """A request whose KV arrived and stays here: running, or retracted to the host
        store, and not moving to the peer (a successor could not tell where it went).
        Not one moved here from another node: that node relays its replies, and ends it
        when this node's scheduler dies."""
        moving = {id(r) for r in self.migrating.values()}

        def adoptable(req: Req) -> bool:
            if id(req) in moving or req.moved_in:
                return False
            return req.state is ReqState.RUNNING or (
                req.host_copy and req.state is ReqState.RETRACTED
            )

        return adoptable

    def adopt_from_host(self, reqs: list[Req]) -> None:
        """They wait in the retracted queue, to be loaded back as any victim."""
        self.retracted.extend(reqs)

    # -- preallocation and transfer --------------------------------------------------

    async def _preallocate(self, resumed: list[Req]) -> bool:
        """Give queued requests rows and slots for their KV, head of the line first.

        The gate is SGLang's ``pop_preallocated``: the request's slots plus the
        reserve, and its own final length beside what retract could free, must
        fit the budget. The budget keeps back the reserve of every active
        request or the largest single need (:meth:`_single_need`), whichever
        is more, and is re-read from the pool before each preallocation.
        Requests resumed in this step (``resumed``) are not retractable yet:
        SGLang still has them in its waiting queue.
        """
        if not self.prealloc:
            return False
        retractable = [r for r in self.running if r not in resumed]
        freeable = sum(map(self._held, retractable))
        need = self._single_need(retractable, [*self.transfer.values(), *resumed])
        swa_gate = self.swa_budget.prealloc_gate(retractable)
        started = False
        while self.prealloc:
            if len(self.running) + len(self.transfer) >= self.config.max_running_requests:
                break
            req = self.prealloc[0]
            allocatable = self._allocatable(count_retracted=True, need=need)
            gate = max(self._required(req), self._final_len(req) - freeable)
            if gate > allocatable and not self._alone_fits(req, allocatable):
                break
            if swa_gate is not None and not swa_gate.fits(req):
                break
            try:
                row = await self.open_row(req)
            except OutOfRowsError:
                break
            if not (await self.mem.alloc_extend([(req.rid, self._fill_len(req))])).fits:
                await self.mem.free_row(req.rid)
                break
            await self.mem.pd_expect(req.rid, req.bootstrap_room)
            self.prealloc.popleft()
            self._rows[req.rid] = row
            self.transfer[req.bootstrap_room] = req
            # It joins the held requests of _single_need: one more term in the maximum
            # (a need below 0 keeps back nothing beside R x n_active, as 0 does).
            need = max(need, self._final_len(req) - self._held(req) - freeable)
            if swa_gate is not None:
                swa_gate.take(req)
            self.stats.prealloc_reqs += 1
            self._event("prealloc", req)
            started = True
        return started

    async def _poll_transfers(self) -> bool:
        if not self.transfer:
            return False
        done = await settled_rooms(self.mem, list(self.transfer))
        if not done:
            return False
        finished = []
        for report in done:
            room = report["room"]
            req = self.transfer.pop(room)
            row = self._rows.pop(req.rid)
            if report["state"] == KVPoll.FAILED:
                self.stats.transfer_failed += 1
                await self.mem.free_row(req.rid)  # nothing inserted: the KV may be partial
                await self._abort(req, transfer_failed_message(req, room, report["why"]), 500)
                continue
            self._commit(req, row, report)
            if req.check_finished(self.eos_token_ids):
                finished.append(req)
                continue
            self.running.append(req)
            self.emit(req, False)
        await self._finish_many(finished)
        return True

    def _commit(self, req: Req, row: int, report: dict[str, Any]) -> None:
        if req.is_retracted:  # re-bootstrapped or moved here: the KV of all but its last token
            if self.arrived.pop(req.rid, None) is not None:
                self.stats.migrated_in_reqs += 1
            req.resume(row)
            self._mark_readmitted(req)
            self._event("resume", req)
            return
        req.commit_transfer(row, int(report["first_token"]), int(report["cached_tokens"]))
        self.stats.generated_tokens += 1
        self._event("commit", req)

    # -- retract: offload to the host store ---------------------------------------------

    def _retract_targets(self, ordered: list[Req]) -> list[RetractTarget]:
        """Every victim's KV is parked in memsvc-D's host store and loaded back on resume
        (a decode node cannot prefill; the tree is not used for victims here)."""
        return [RetractTarget.HOST_ENTRY] * len(ordered)

    async def _requeue_retracted(self, req: Req) -> None:
        self.retracted.append(req)
        self._event("retract", req)

    async def _offload_failed(self, req: Req) -> None:
        self._event("retract", req)
        if self.config.pd_retract_fallback == "recompute":
            self.prealloc.appendleft(req)
            self._rebootstrap(req)
            return
        self.stats.host_full_aborts += 1
        await self._abort(
            req,
            f"Request {req.rid} aborted: the host store has no room for its KV "
            "(retract by offload failed)",
            500,
        )

    def _rebootstrap(self, req: Req) -> None:
        """Ask (through the router) for ``req``'s KV again, under a fresh room.

        A retracted request gets everything but its last token recomputed; one
        that never got its prompt's KV gets the prompt (and the first token).
        """
        room, self._next_room = self._next_room, self._next_room + 1
        req.bootstrap_room = room
        self.stats.rebootstraps += 1
        ids = req.fill_ids[:-1] if req.is_retracted else req.origin_input_ids
        self.on_rebootstrap(req, room, ids)

    # -- recovery (called by scheduler_svc.recovery; no memsvc calls: the KV is gone) ---

    def requeue_kv_holders(self, why: str) -> list[Req]:
        """memsvc-D lost our KV: re-bootstrap every request that held any there.

        Running, retracted to memsvc-D's host store, or in the transfer queue
        (its pages preallocated, its room expected): all of that went with the
        old session. This node cannot prefill, so each one goes to the front of
        the preallocation queue under a fresh room, and the prefill node
        recomputes its KV (``on_rebootstrap``); its tokens do not change.
        Requests still waiting for preallocation held nothing and stay, except
        the head of that queue: the failed step may have been preallocating it,
        and memsvc-D may have expected its room for the lost session (then the
        prefill node's transfer into that room can succeed, and a second one
        would never come).
        """
        log.warning("memsvc-D lost the KV (%s): re-bootstrapping its holders", why)
        queued = {id(r) for r in list(self.prealloc)[1:]}
        lost = []
        for req in list(self.reqs.values()):
            if req.is_finished:
                self.report_ended(req)
            elif id(req) not in queued:
                if req.state is ReqState.RUNNING:
                    req.reset_for_retract()
                req.host_copy = False
                lost.append(req)
        self.prealloc = deque(r for r in self.prealloc if id(r) in queued)
        self._drop_kv_queues()
        self.prealloc.extendleft(reversed(lost))
        for req in lost:
            self._event("retract", req)
            self._rebootstrap(req)
        return lost

    def forget_all(self) -> None:
        """Every live request was failed (and reported): drop the PD queues too."""
        super().forget_all()
        self._drop_kv_queues()
        self.prealloc.clear()

    def _drop_kv_queues(self) -> None:
        if self.migration is not None:  # their host copies went with the KV
            for req in self.migrating.values():
                self.migration.finished(req.rid)
        self.migrating.clear()
        self._moving_since.clear()
        self.running.clear()
        self.transfer.clear()
        self.retracted.clear()
        self._rows.clear()

    async def _abort(self, req: Req, message: str, status_code: int) -> None:
        if req in self.prealloc:
            self.prealloc.remove(req)
        if req in self.retracted:
            self.retracted.remove(req)
        self.arrived.pop(req.rid, None)
        moving = next((room for room, r in self.migrating.items() if r is req), None)
        if moving is not None:  # its send is cancelled; its row or host copy goes below
            del self.migrating[moving]
            self._moving_since.pop(moving, None)
            if self.migration is not None:
                await self.migration.cancel(req.rid)
            await self.mem.pd_forget([moving])
        room = req.bootstrap_room
        if room is not None and self.transfer.get(room) is req:
            del self.transfer[room]
            self._rows.pop(req.rid, None)
            try:
                await self.mem.pd_forget([room])
                await self.mem.free_row(req.rid)
            except MemsvcError:
                abort_locally(self, req, message, status_code)
                raise
        await super()._abort(req, message, status_code)

    def queue_lengths(self) -> dict[str, int]:
        return {
            "prealloc": len(self.prealloc),
            "transfer": len(self.transfer),
            "retracted": len(self.retracted),
            "migrating": len(self.migrating),
            "running": len(self.running),
        }
