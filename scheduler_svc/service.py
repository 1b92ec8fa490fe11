"""The scheduler's asyncio shell: the generate socket, the engine loop, the control ops.

Three tasks, all kept and cancelled on the way out: ``_intake`` reads client
requests (validating each one at the edge and answering bad ones at once),
``_loop`` runs :meth:`Engine.step` while there is work, and ``_send`` writes
replies in order (``info`` also says whether the loop gets anywhere with the
work it has, see :mod:`scheduler_svc.stall`). A ``generate`` passes
:mod:`scheduler_svc.intake` (SGLang's checks, each a 400 with SGLang's
message, and the clamp that lets one request alone always fit) and is
answered through :mod:`scheduler_svc.replies`. ``flush_cache`` requests wait
for the loop's next turn and flush memsvc's prefix tree only if no request is
running or waiting (an engine left with work that ends by itself, such as queued
aborts or a PD prefill node's transfers in flight, gets up to FLUSH_SETTLE_S first).

Faults: a step that fails because a peer failed goes to
:class:`scheduler_svc.recovery.Recovery`, which has the engine repair its
queues (a new memsvc session and re-prefill when the KV was lost); only a
fault it cannot repair ends every live request, with an error that names it.
A ``generate`` whose rid is still live (a client re-submitting after it lost
its connection, or a duplicated message) attaches to the running request
instead of starting it twice; one whose rid finished recently is answered
from a small cache of results. Both, and ``abort``, only for the client that
submitted the rid (the ``client`` id it sends, see :mod:`scheduler_svc.protocol`):
another client's re-submission is ``duplicate_rid``, its abort ``not_owner``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import zmq
import zmq.asyncio

from memsvc import protocol as wire
from memsvc.cli import write_ready_file
from memsvc.client import PeerDeadError
from memsvc.core.errors import MemsvcError
from memsvc.curve import CurveServerKeys, secure_server
from memsvc.gcpolicy import gc_state
from memsvc.limits import recv_bounded_async
from memsvc.reply_cache import ReplyCache
from memsvc.server import remove_endpoint, serve_tasks
from model_svc.errors import ModelSvcError
from scheduler_svc import protocol as p
from scheduler_svc.adopt import ADOPT_EXPIRED_STATUS, Adopted, Owner, Reattach
from scheduler_svc.core import Req, RequestTooLargeError
from scheduler_svc.engine import Engine
from scheduler_svc.intake import DRAINING, fingerprint, new_req, out_of_vocabulary, refusal
from scheduler_svc.pd.moved import MovedRequests
from scheduler_svc.protocol import RESULT_CACHE_BYTES, RESULT_CACHE_SIZE
from scheduler_svc.recovery import Recovery, RecoveryFailedError
from scheduler_svc.replies import (
    Waiter,
    chunk_header,
    done_header,
    error_reply,
    nothing_to_generate,
)
from scheduler_svc.stall import StallWatch

log = logging.getLogger("scheduler_svc")

IDLE_WAIT_S = 0.5
FLUSH_SETTLE_S = 1.0  # a full flush_cache waits this long at most for a settling engine


class SchedulerService(MovedRequests):
    def __init__(
        self,
        engine: Engine,
        listen: str,
        *,
        tokenizer: Any,
        capacity: int,
        page_size: int,
        max_context_len: int,
        vocab_size: int,
        ready_file: str | None = None,
        ready_info: dict[str, Any] | None = None,
        recovery: Recovery | None = None,
        mode: str = "normal",
        curve: CurveServerKeys | None = None,
        model_info: dict[str, Any] | None = None,
        result_cache_bytes: int | None = None,
    ) -> None:
        self.engine = engine
        # What it serves, for a front that was not told: the checkpoint whose tokenizer
        # it uses for text (None: the byte tokenizer) and the served model name.
        self.model_info = model_info or {"checkpoint": None, "served_model_name": None}
        self.mode = mode
        self.curve = curve
        self.recovery = recovery or Recovery(engine, None)
        self.ready_info = ready_info or {}
        self.listen = listen
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.page_size = page_size
        self.max_context_len = max_context_len
        self.vocab_size = vocab_size
        self.ready_file = ready_file
        self._waiters: dict[str, Waiter] = {}
        # rid -> (client, fingerprint, the done reply's header as sent): packed, for a
        # result's Python lists (prompt logprobs) are several times its msgpack bytes
        self._finished: ReplyCache[str, tuple[str, str, bytes]] = ReplyCache(
            RESULT_CACHE_SIZE,
            RESULT_CACHE_BYTES if result_cache_bytes is None else result_cache_bytes,
        )
        self._outbox: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        # flush_cache requests (identity, op_id, namespace or None: all), run between steps
        # (a full one waits up to FLUSH_SETTLE_S while the engine is settling)
        self._flushes: list[tuple[bytes, int, str | None, float]] = []
        self.stall = StallWatch()
        engine.emit = self._emit
        # A restarted scheduler's adopted requests wait for their clients (scheduler_svc.adopt).
        self.reattach: Reattach | None = None
        journal = getattr(engine, "journal", None)  # (the tests' stand-in engines have none)
        if journal is not None:
            journal.owner_of = self._owner_of
        adopted = getattr(self.recovery, "adopted", None)
        if adopted is not None:
            self._await_clients(adopted)
        if mode == "decode":
            engine.on_rebootstrap = self._rebootstrap
            engine.on_migrated = self._relay
            if getattr(engine, "migration", None) is not None:
                engine.migration.owner_of = self._owner_of
        self._relays: set[asyncio.Task] = set()  # moved requests' replies, relayed

    async def run(self) -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        p.MESSAGE_LIMIT.apply(sock)
        auth = None

        def announce() -> None:
            write_ready_file(self.ready_file, self.listen, **self.ready_info)
            print(f"scheduler_svc listening on {self.listen}", flush=True)

        try:
            auth = secure_server(ctx, sock, self.curve)
            sock.bind(self.listen)
            await serve_tasks(
                [self._intake(sock), self._send(sock), self._loop()],
                self._stop,
                announce,
                on_signal=self._on_signal,
            )
        finally:
            sock.close(0)
            if auth is not None:
                auth.stop()
            ctx.term()
            remove_endpoint(self.listen, self.ready_file)
            log.info("scheduler_svc stopped")

    # -- tasks -------------------------------------------------------------------

    async def _intake(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            inbound = await recv_bounded_async(sock, p.MESSAGE_LIMIT, keep=2)
            if len(inbound.frames) < 2:
                continue
            identity, payload = inbound.frames[0], inbound.frames[1:]
            op_id = None
            try:
                if inbound.too_large is not None:
                    raise inbound.too_large  # only its header was kept
                msg = p.parse_request(payload)
                op_id = msg.op_id
                reply = self._accept(identity, msg)
            except wire.ProtocolError as exc:
                # Echo the op_id even of an invalid message: the client matches by it.
                reply = error_reply(wire.best_effort_op_id(payload), exc.code, exc.message, 400)
            except RequestTooLargeError as exc:
                reply = error_reply(op_id, "too_large", str(exc), 400)
            except Exception as exc:  # a bug: answer, log, keep serving
                log.exception("intake failed")
                op_id = op_id if op_id is not None else wire.best_effort_op_id(payload)
                reply = error_reply(op_id, "internal", f"{type(exc).__name__}: {exc}", 500)
            if reply is not None:
                self._outbox.put_nowait([identity, *reply])
            self._wake.set()

    async def _loop(self) -> None:
        while True:
            await self._flush_cache()
            self._expire_adopted()
            self.stall.step_begins(time.monotonic())
            progressed = False
            try:
                did = progressed = await self.engine.step()
                self.recovery.step_succeeded()
            except (MemsvcError, ModelSvcError, PeerDeadError) as exc:
                log.warning("scheduling step failed: %s: %s", type(exc).__name__, exc)
                did = await self._recover(exc)
            self.stall.step_ends(time.monotonic(), progressed=progressed, busy=not self.engine.idle)
            if self.draining and self.engine.idle and not self._relays:
                log.info("drained: every request moved off this node and ended")
                self._stop.set()
            if not did:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.engine.idle_wait_s(IDLE_WAIT_S))

    async def _flush_cache(self) -> None:
        """Answer the queued ``flush_cache`` requests (SGLang's: only with no request
        running or waiting; memsvc then evicts everything evictable). One namespace's
        flush runs whatever runs: memsvc evicts that namespace's unlocked KV, in every
        tier; what its running requests hold is theirs until they end."""
        while self._flushes:
            identity, op_id, namespace, since = self._flushes[0]
            engine = self.engine
            busy = namespace is None and (engine.reqs or not engine.idle)
            if busy and engine.settling() and time.monotonic() - since < FLUSH_SETTLE_S:
                return  # work about to end by itself: ask again after the next step
            self._flushes.pop(0)
            if namespace is not None:
                try:
                    evicted = await engine.mem.flush_cache(namespace=namespace)
                    flushed, message = True, f"Cache flushed ({evicted} tokens evicted)."
                except (MemsvcError, PeerDeadError) as exc:
                    flushed, message = False, f"Cache not flushed: {exc}"
            elif busy:
                num_running = len(engine.running)
                flushed, message = (
                    False,
                    "Cache not flushed because there are pending requests. "
                    f"#queue-req: {max(len(engine.reqs) - num_running, 0)}, "
                    f"#running-req: {num_running}",
                )
            else:
                try:
                    evicted = await engine.mem.flush_cache()
                    flushed, message = True, f"Cache flushed ({evicted} tokens evicted)."
                except (MemsvcError, PeerDeadError) as exc:
                    flushed, message = False, f"Cache not flushed: {exc}"
            header = {"ok": True, "op_id": op_id, "flushed": flushed, "message": message}
            self._outbox.put_nowait([identity, *wire.pack(header)])

    async def _recover(self, exc: BaseException) -> bool:
        """Repair the engine after a failed step; True if there is work to go on with."""
        try:
            pause = await self.recovery.recover(exc)
        except RecoveryFailedError as failure:
            log.error("cannot recover: %s", failure)
            await self._fail_everything(str(failure))
            return False
        except (MemsvcError, ModelSvcError) as failure:  # failed again while repairing
            log.exception("recovery failed")
            await self._fail_everything(f"{type(exc).__name__}: {exc}; then {failure}")
            return False
        if pause:
            await asyncio.sleep(pause)
        return True

    async def _send(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            await sock.send_multipart(await self._outbox.get())

    # -- intake ------------------------------------------------------------------

    def _accept(self, identity: bytes, msg: Any) -> list[bytes] | None:
        if msg.op == "info":
            return wire.pack({"ok": True, "op_id": msg.op_id, **self.info()})
        if msg.op == "flush_cache":
            self._flushes.append((identity, msg.op_id, msg.namespace, time.monotonic()))
            return None
        if msg.op == "abort":
            waiter = self._waiters.get(msg.rid)
            if waiter is not None and waiter.client != msg.client:
                message = f"request {msg.rid!r} belongs to another client"
                return error_reply(msg.op_id, "not_owner", message, 403)
            found = self.engine.abort(msg.rid)
            migration = getattr(self.engine, "migration", None)
            if not found and waiter is not None and migration is not None:
                found = msg.rid in migration.relays  # moved: the peer ends it, we relay
                if found:
                    self._spawn(migration.abort(msg.rid))
            return wire.pack({"ok": True, "op_id": msg.op_id, "found": found})
        if msg.op == "migrate_in":
            return self._migrate_in(identity, msg)
        if msg.op == "adopted":
            return wire.pack({"ok": True, "op_id": msg.op_id, "rids": self._adopted(msg)})
        return self._generate(identity, msg)

    def _generate(self, identity: bytes, msg: Any) -> list[bytes] | None:
        """A ``generate``: attached to its live rid, answered from the result cache,
        refused (:mod:`scheduler_svc.intake`), or queued for the engine."""
        if msg.input_ids is not None:
            input_ids = msg.input_ids.tolist()
        else:
            input_ids = self.tokenizer.encode(msg.text)
        digest = fingerprint(input_ids, msg)
        if self.mode != "normal" and msg.bootstrap_room is None:
            return error_reply(
                msg.op_id,
                "bad_request",
                f"a {self.mode} node takes requests from the router (no bootstrap_room)",
                400,
            )
        if msg.rid in self._waiters:
            return self._attach(identity, msg, self._waiters[msg.rid], digest)
        cached = self._finished.get(msg.rid)
        if cached is not None and cached[:2] == (msg.client, digest):
            header = wire.unpack([cached[2]])
            if header.get("type") == "moved" and not msg.follow_moves:
                message = f"request {msg.rid!r} moved to decode node {header['peer']}"
                return error_reply(msg.op_id, "moved", message, 409)
            return wire.pack({**header, "op_id": msg.op_id})
        if self.draining:  # live and finished requests are still answered
            return error_reply(msg.op_id, "unavailable", DRAINING, 503)
        refused = self._refusal(input_ids, msg)
        if refused is not None:
            return refused
        req, scoring = new_req(
            msg,
            input_ids,
            capacity=self.capacity,
            page_size=self.page_size,
            mode=self.mode,
            stop_decoder=self._stop_decoder,
            swa=self.engine.swa,
            config=self.engine.config,
        )
        if req.sampling_params.max_new_tokens == 0:  # nothing to generate: done at once
            return wire.pack(nothing_to_generate(req, msg.op_id))
        self._waiters[msg.rid] = Waiter(
            identity,
            msg.op_id,
            msg.stream,
            time.monotonic(),
            fingerprint=digest,
            client=msg.client,
            scoring=scoring,
            follow_moves=msg.follow_moves,
        )
        self.engine.submit(req)
        return None

    @property
    def draining(self) -> bool:
        return bool(getattr(self.engine, "draining", False))

    def _on_signal(self) -> None:
        """SIGTERM / SIGINT: stop; a decode node with a peer to move its requests to drains
        first (every request moves off with its KV; it stops once the last relayed one
        ended), and stops at once on a second signal."""
        if self.draining or getattr(self.engine, "migration", None) is None:
            self._stop.set()
            return
        log.warning("draining: every running and retracted request moves to the peer")
        self.engine.draining = True
        self._wake.set()

    def _refusal(
        self, input_ids: list[int], msg: Any, output_ids: list[int] | None = None
    ) -> list[bytes] | None:
        """The error reply intake's checks give ``msg`` on this node (SGLang's codes and
        messages; ``output_ids``, a moved request's, must be in the vocabulary too), or
        None when it may be served."""
        refused = refusal(
            input_ids,
            msg,
            vocab_size=self.vocab_size,
            max_context_len=self.max_context_len,
            mode=self.mode,
        )
        bad_output = out_of_vocabulary(output_ids or [], self.vocab_size)
        if refused is None and bad_output is not None:
            refused = ("bad_request", bad_output, 400)
        return None if refused is None else error_reply(msg.op_id, *refused)

    def _stop_decoder(self, token_ids: list[int]) -> str:
        """How the stop-string check decodes (SGLang's tail: special tokens kept)."""
        return self.tokenizer.decode(token_ids, skip_special=False)

    def _attach(self, identity: bytes, msg: Any, waiter: Waiter, digest: str) -> list[bytes] | None:
        """A live rid again: the same request re-submitted by its client takes over its replies.

        The stream restarts at offset 0 (the client drops what it already has);
        the same message twice (same sender and op_id) changes nothing.
        """
        if waiter.client != msg.client:
            message = f"request {msg.rid!r} is already running for another client"
            return error_reply(msg.op_id, "duplicate_rid", message, 400)
        if waiter.fingerprint != digest:
            return error_reply(
                msg.op_id, "duplicate_rid", f"request {msg.rid!r} is already running", 400
            )
        if (waiter.identity, waiter.op_id) == (identity, msg.op_id):
            return None
        log.info("request %s re-submitted: attaching to the live request", msg.rid)
        waiter.identity, waiter.op_id, waiter.stream, waiter.sent = (
            identity,
            msg.op_id,
            msg.stream,
            0,
        )
        waiter.follow_moves = msg.follow_moves
        if self.reattach is not None and self.reattach.waiting_for_client(msg.rid):
            parked = self.reattach.attached(msg.rid)
            if parked is not None:  # adopted without KV: it runs now its client is back
                self.engine.submit(parked)
        req = self.engine.reqs.get(msg.rid)
        if req is not None and not req.is_finished:
            self._emit(req, False)
        return None

    # -- adopted requests (scheduler_svc.adopt) ------------------------------------

    def _owner_of(self, rid: str) -> Owner | None:
        waiter = self._waiters.get(rid)
        if waiter is None or waiter.scoring:
            return None
        return Owner(waiter.client, waiter.fingerprint, waiter.stream)

    def _adopted(self, msg: Any) -> list[str]:
        """Those of ``msg.rids`` adopted with their KV and waiting for the client named
        beside each (the PD router's question to a restarted decode node)."""
        if self.reattach is None:
            return []
        adopted = self.reattach.adopted
        return [
            rid
            for rid, client in zip(msg.rids, msg.clients, strict=True)
            if rid in adopted.owners and adopted.owners[rid].client == client
            if rid not in adopted.parked
        ]

    def _await_clients(self, adopted: Adopted) -> None:
        """Each adopted request gets a detached waiter: its client re-submits to attach."""
        now = time.monotonic()
        self.reattach = Reattach(adopted)
        for req in [*self.engine.reqs.values(), *adopted.parked.values()]:
            if req.sampling_params.stop:  # the records keep the strings, not the decoder
                req.stop_decoder = self._stop_decoder
        for rid, owner in adopted.owners.items():
            self._waiters[rid] = Waiter(
                None, 0, owner.stream, now, fingerprint=owner.fingerprint, client=owner.client
            )

    def _expire_adopted(self) -> None:
        """Adopted requests whose client did not come back in time end with an error."""
        if self.reattach is None:
            return
        for rid in self.reattach.due(time.monotonic()):
            parked = self.reattach.parked_req(rid)
            if parked is not None:  # holds no KV: it ends here
                parked.abort(self.reattach.message, ADOPT_EXPIRED_STATUS)
                self._emit(parked, True)
            else:  # its KV is released with it
                self.engine.abort(rid, self.reattach.message, ADOPT_EXPIRED_STATUS)

    # -- replies -----------------------------------------------------------------

    def _emit(self, req: Req, finished: bool) -> None:
        waiter = self._waiters.get(req.rid)
        if waiter is None:
            return
        if not finished:
            header = chunk_header(req, waiter, time.monotonic())
            if header is not None and waiter.identity is not None:  # None: no client yet
                waiter.sent = len(req.output_ids)
                self._outbox.put_nowait([waiter.identity, *wire.pack(header)])
            return
        del self._waiters[req.rid]
        (packed,) = wire.pack(done_header(req, waiter, time.monotonic(), self.tokenizer))
        if waiter.identity is not None:
            self._outbox.put_nowait([waiter.identity, packed])
        self._finished.put(req.rid, (waiter.client, waiter.fingerprint, packed), len(packed))

    async def _fail_everything(self, why: str) -> None:
        """A peer failed mid-step: end every live request with an explicit error."""
        self.engine.fail_all(f"scheduler could not continue: {why}", 503)
        self.recovery.stats.failures += 1
        await self.recovery.reclaim()  # a new memsvc session: nothing we held stays held

    def _rebootstrap(self, req: Req, room: int, input_ids: list[int]) -> None:
        """Decode node: ask the router to have ``input_ids`` re-prefilled into ``room``."""
        waiter = self._waiters.get(req.rid)
        if waiter is None:
            return
        header = {
            "ok": True,
            "op_id": waiter.op_id,
            "type": "rebootstrap",
            "rid": req.rid,
            "room": room,
            "input_ids": input_ids,
        }
        self._outbox.put_nowait([waiter.identity, *wire.pack(header)])

    def info(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "capacity": self.capacity,
            "page_size": self.page_size,
            "max_context_len": self.max_context_len,
            "retraction_policy": engine.config.retraction_policy,
            "schedule_conservativeness": engine.config.schedule_conservativeness,
            "mode": self.mode,
            "pid": os.getpid(),  # a restarted scheduler answers with another (the PD router)
            "retract_mode": engine.config.retract_mode,
            "new_token_ratio": engine.ratio.current,
            "num_running": len(engine.running),
            "num_waiting": len(engine.waiting),
            "progress": self.stall.report(time.monotonic()),
            "stats": engine.stats.as_dict(),
            "gc": gc_state(),  # the collector's policy in this process (memsvc.gcpolicy)
            "recovery": {
                **self.recovery.stats.as_dict(),
                "journal": _journal_stats(engine),
                "adopt_expired": self.reattach.expired if self.reattach is not None else 0,
                "model_resends": getattr(engine.model, "resends", 0),
            },
            **self.model_info,
            **self._pd_info(),
        }

    def _pd_info(self) -> dict[str, Any]:
        engine = self.engine
        if self.mode == "decode":
            return {
                "draining": engine.draining,
                "migrate_to": engine.migration.address if engine.migration else None,
                "queues": engine.queue_lengths(),
                "timeline": list(engine.timeline),
                # what another decode node may move here (scheduler_svc.pd.migrate)
                "prealloc_budget": engine.prealloc_budget(),
                "transfer_listen": engine.mem.hello_info.get("transfer_listen"),
            }
        if self.mode == "prefill":
            return {"queues": {"inflight": len(engine.inflight), "waiting": len(engine.waiting)}}
        return {}


def _journal_stats(engine: Any) -> dict[str, Any] | None:
    journal = getattr(engine, "journal", None)
    return journal.stats() if journal is not None else None
