"""The scheduler's asyncio shell: the generate socket, intake, replies, the engine loop.

Three tasks, all kept and cancelled on the way out: ``_intake`` reads client
requests (validating each one at the edge and answering bad ones at once),
``_loop`` runs :meth:`Engine.step` while there is work, and ``_send`` writes
replies in order (``info`` also says whether the loop gets anywhere with the
work it has, see :mod:`scheduler_svc.stall`). Intake applies SGLang's checks,
each a 400 with SGLang's message: a token id outside the vocabulary, a prompt
of ``max_context_len`` tokens or more, a prompt plus ``max_new_tokens`` past
``max_context_len``, a ``logprob_start_len`` past the prompt; and the rules
that keep a request from waiting forever: an input that can never fit the pool
is rejected with 400, and ``max_new_tokens`` is clamped so that one request
alone always fits. ``flush_cache`` requests wait for the loop's next turn and
flush memsvc's prefix tree only if no request is running or waiting.

Faults: a step that fails because a peer failed goes to
:class:`scheduler_svc.recovery.Recovery`, which repairs the engine's queues
(a new memsvc session and re-prefill when the KV was lost); only a fault it
cannot repair ends every live request, with an error that names it. A
``generate`` whose rid is still live (a client re-submitting after it lost
its connection, or a duplicated message) attaches to the running request
instead of starting it twice; one whose rid finished recently is answered
from a small cache of results. Both, and ``abort``, only for the client that
submitted the rid (the ``client`` id it sends, see :mod:`scheduler_svc.protocol`):
another client's re-submission is ``duplicate_rid``, its abort ``not_owner``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from memsvc import protocol as wire
from memsvc.cli import write_ready_file
from memsvc.client import PeerDeadError
from memsvc.core.errors import MemsvcError
from memsvc.curve import CurveServerKeys, secure_server
from memsvc.limits import recv_bounded_async
from memsvc.reply_cache import ReplyCache
from memsvc.server import remove_endpoint, serve_tasks
from model_svc.errors import ModelSvcError
from scheduler_svc import protocol as p
from scheduler_svc.core import (
    FinishAbort,
    FinishMatchedStr,
    FinishMatchedToken,
    Req,
    RequestTooLargeError,
    SamplingParams,
    check_fits,
    clamp_max_new_tokens,
)
from scheduler_svc.engine import Engine
from scheduler_svc.protocol import RESULT_CACHE_BYTES, RESULT_CACHE_SIZE
from scheduler_svc.recovery import Recovery, RecoveryFailedError
from scheduler_svc.stall import StallWatch

log = logging.getLogger("scheduler_svc")

IDLE_WAIT_S = 0.5


@dataclass
class Waiter:
    """Where a request's replies go."""

    identity: bytes
    op_id: int
    stream: bool
    started: float
    sent: int = 0  # output tokens already streamed
    fingerprint: str = ""  # input + sampling: a re-submission must match it
    client: str = ""  # the client that owns the rid: only it may re-submit or abort it
    # max_new_tokens 0 with prompt logprobs (scoring): one token is run, none returned.
    scoring: bool = False


class SchedulerService:
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
        self._flushes: list[tuple[bytes, int]] = []  # flush_cache requests, run between steps
        self.stall = StallWatch()
        engine.emit = self._emit
        if mode == "decode":
            engine.on_rebootstrap = self._rebootstrap

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
                [self._intake(sock), self._send(sock), self._loop()], self._stop, announce
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
                reply = _error(wire.best_effort_op_id(payload), exc.code, exc.message, 400)
            except RequestTooLargeError as exc:
                reply = _error(op_id, "too_large", str(exc), 400)
            except Exception as exc:  # a bug: answer, log, keep serving
                log.exception("intake failed")
                op_id = op_id if op_id is not None else wire.best_effort_op_id(payload)
                reply = _error(op_id, "internal", f"{type(exc).__name__}: {exc}", 500)
            if reply is not None:
                self._outbox.put_nowait([identity, *reply])
            self._wake.set()

    async def _loop(self) -> None:
        while True:
            await self._flush_cache()
            self.stall.step_begins(time.monotonic())
            progressed = False
            try:
                did = progressed = await self.engine.step()
                self.recovery.step_succeeded()
            except (MemsvcError, ModelSvcError, PeerDeadError) as exc:
                log.warning("scheduling step failed: %s: %s", type(exc).__name__, exc)
                did = await self._recover(exc)
            self.stall.step_ends(time.monotonic(), progressed=progressed, busy=not self.engine.idle)
            if not did:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.engine.idle_wait_s(IDLE_WAIT_S))

    async def _flush_cache(self) -> None:
        """Answer the queued ``flush_cache`` requests (SGLang's: only with no request
        running or waiting; memsvc then evicts everything evictable)."""
        while self._flushes:
            identity, op_id = self._flushes.pop(0)
            engine = self.engine
            if engine.reqs or not engine.idle:
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
            self._flushes.append((identity, msg.op_id))
            return None
        if msg.op == "abort":
            waiter = self._waiters.get(msg.rid)
            if waiter is not None and waiter.client != msg.client:
                message = f"request {msg.rid!r} belongs to another client"
                return _error(msg.op_id, "not_owner", message, 403)
            found = self.engine.abort(msg.rid)
            return wire.pack({"ok": True, "op_id": msg.op_id, "found": found})
        if msg.input_ids is not None:
            input_ids = msg.input_ids.tolist()
        else:
            input_ids = self.tokenizer.encode(msg.text)
        fingerprint = _fingerprint(input_ids, msg)
        if self.mode != "normal" and msg.bootstrap_room is None:
            return _error(
                msg.op_id,
                "bad_request",
                f"a {self.mode} node takes requests from the router (no bootstrap_room)",
                400,
            )
        if msg.rid in self._waiters:
            return self._attach(identity, msg, self._waiters[msg.rid], fingerprint)
        cached = self._finished.get(msg.rid)
        if cached is not None and cached[:2] == (msg.client, fingerprint):
            return wire.pack({**wire.unpack([cached[2]]), "op_id": msg.op_id})
        refused = self._refusal(input_ids, msg)
        if refused is not None:
            return _error(msg.op_id, *refused)
        check_fits(len(input_ids), self.capacity, self.page_size)
        sampling = msg.sampling
        max_new = clamp_max_new_tokens(
            len(input_ids), sampling.max_new_tokens, self.capacity, self.page_size
        )
        if self.mode == "prefill":
            max_new = min(max_new, 1)  # the decode node generates the rest
        start = msg.logprob_start_len if msg.return_logprob else -1
        if msg.return_logprob and start == -1:
            start = len(input_ids)  # SGLang: output logprobs only
        scoring = max_new == 0 and 0 <= start < len(input_ids)
        req = Req(
            msg.rid,
            input_ids,
            SamplingParams.of(
                sampling.model_dump(),
                max_new_tokens=1 if scoring else max_new,
                ignore_eos=sampling.ignore_eos or scoring,
            ),
            priority=msg.priority,
            bootstrap_room=msg.bootstrap_room,
            bootstrap_rid=msg.bootstrap_rid,
            return_logprob=msg.return_logprob,
            logprob_start_len=start,
            top_logprobs_num=msg.top_logprobs_num if msg.return_logprob else 0,
            stop_decoder=self._stop_decoder if sampling.stop else None,
        )
        self._waiters[msg.rid] = Waiter(
            identity,
            msg.op_id,
            msg.stream,
            time.monotonic(),
            fingerprint=fingerprint,
            client=msg.client,
            scoring=scoring,
        )
        if max_new == 0 and not scoring:  # nothing to generate: done at once
            self._waiters.pop(msg.rid)
            return wire.pack(
                {
                    "ok": True,
                    "op_id": msg.op_id,
                    "type": "done",
                    "rid": msg.rid,
                    "output_ids": [],
                    "text": "",
                    "meta_info": {
                        **_meta(req, 0.0),
                        **_logprob_meta(req, 0, 0, inputs=True),
                        "finish_reason": {"type": "length", "length": 0},
                    },
                }
            )
        self.engine.submit(req)
        return None

    def _refusal(self, input_ids: list[int], msg: Any) -> tuple[str, str, int] | None:
        """SGLang's intake checks: (code, message, status) of the first that fails."""
        num = len(input_ids)
        if num == 0:  # a text that tokenizes to nothing: nothing to prefill
            return "bad_request", p.EMPTY_PROMPT, 400
        bad = next((t for t in input_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            message = f"Token ID {bad} is out of vocabulary (vocab size: {self.vocab_size})"
            return "bad_request", message, 400
        context = self.max_context_len
        if num >= context:
            message = (
                f"The input ({num} tokens) is longer than the model's context length "
                f"({context} tokens)."
            )
            return "too_large", message, 400
        max_new = msg.sampling.max_new_tokens
        if num + max_new > context:
            message = (
                "Requested token count exceeds the model's maximum context length of "
                f"{context} tokens. You requested a total of {num + max_new} tokens: {num} "
                f"tokens from the input messages and {max_new} tokens for the completion. "
                "Please reduce the number of tokens in the input messages or the completion "
                "to fit within the limit."
            )
            return "too_large", message, 400
        if msg.return_logprob and self.mode != "normal":
            message = "return_logprob is not supported in PD (prefill/decode) mode"
            return "bad_request", message, 400
        if msg.return_logprob and msg.logprob_start_len > num:
            message = (
                f"logprob_start_len={msg.logprob_start_len} is higher than the number of "
                f"input tokens len(origin_input_ids)={num}. Please use a smaller "
                "logprob_start_len."
            )
            return "bad_request", message, 400
        return None

    def _stop_decoder(self, token_ids: list[int]) -> str:
        """How the stop-string check decodes (SGLang's tail: special tokens kept)."""
        return self.tokenizer.decode(token_ids, skip_special=False)

    def _text(self, req: Req) -> str:
        """The output's text: decoded as ``skip_special_tokens`` says, cut before the
        matched stop string or stop token unless ``no_stop_trim`` (as SGLang)."""
        params = req.sampling_params
        ids = req.output_ids
        reason = req.finish_reason
        trim = not params.no_stop_trim
        if trim and isinstance(reason, FinishMatchedToken) and ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special=params.skip_special_tokens)
        if trim and isinstance(reason, FinishMatchedStr):
            at = text.find(reason.matched)
            if at != -1:
                text = text[:at]
        return text

    def _attach(
        self, identity: bytes, msg: Any, waiter: Waiter, fingerprint: str
    ) -> list[bytes] | None:
        """A live rid again: the same request re-submitted by its client takes over its replies.

        The stream restarts at offset 0 (the client drops what it already has);
        the same message twice (same sender and op_id) changes nothing.
        """
        if waiter.client != msg.client:
            message = f"request {msg.rid!r} is already running for another client"
            return _error(msg.op_id, "duplicate_rid", message, 400)
        if waiter.fingerprint != fingerprint:
            return _error(
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
        req = self.engine.reqs.get(msg.rid)
        if req is not None and not req.is_finished:
            self._emit(req, False)
        return None

    # -- replies -----------------------------------------------------------------

    def _emit(self, req: Req, finished: bool) -> None:
        waiter = self._waiters.get(req.rid)
        if waiter is None:
            return
        if not finished:
            if waiter.stream and len(req.output_ids) > waiter.sent:
                end = len(req.output_ids)
                meta = _meta(req, time.monotonic() - waiter.started)
                del meta["finish_reason"]
                header = {
                    "ok": True,
                    "op_id": waiter.op_id,
                    "type": "chunk",
                    "rid": req.rid,
                    "token_ids": req.output_ids[waiter.sent :],
                    "offset": waiter.sent,
                    "meta_info": {
                        **meta,
                        **_logprob_meta(req, waiter.sent, end, inputs=waiter.sent == 0),
                    },
                }
                waiter.sent = end
                self._outbox.put_nowait([waiter.identity, *wire.pack(header)])
            return
        del self._waiters[req.rid]
        meta = _meta(req, time.monotonic() - waiter.started)
        num_out = len(req.output_ids)
        if waiter.scoring:  # one token was run for the prompt's logprobs: none is returned
            num_out = 0
            meta["completion_tokens"] = 0
            if not isinstance(req.finish_reason, FinishAbort):
                meta["finish_reason"] = {"type": "length", "length": 0}
        header = {
            "ok": True,
            "op_id": waiter.op_id,
            "type": "done",
            "rid": req.rid,
            "output_ids": list(req.output_ids[:num_out]),
            "text": self._text(req) if num_out else "",
            "meta_info": {**meta, **_logprob_meta(req, 0, num_out, inputs=True)},
        }
        (packed,) = wire.pack(header)
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
            "recovery": {
                **self.recovery.stats.as_dict(),
                "model_resends": getattr(engine.model, "resends", 0),
            },
            **self.model_info,
            **self._pd_info(),
        }

    def _pd_info(self) -> dict[str, Any]:
        engine = self.engine
        if self.mode == "decode":
            return {"queues": engine.queue_lengths(), "timeline": list(engine.timeline)}
        if self.mode == "prefill":
            return {"queues": {"inflight": len(engine.inflight), "waiting": len(engine.waiting)}}
        return {}


def _meta(req: Req, e2e_latency: float) -> dict[str, Any]:
    reason = req.finish_reason.to_json() if req.finish_reason else None
    meta = {
        "finish_reason": reason,
        "prompt_tokens": len(req.origin_input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "num_retractions": req.retraction_count,
        "e2e_latency": e2e_latency,
    }
    # Hierarchical cache: the hit per tier, as SGLang (only when something was cached).
    if req.cached_tokens_details is not None and req.cached_tokens > 0:
        meta["cached_tokens_details"] = dict(req.cached_tokens_details)
    return meta


def _logprob_meta(req: Req, start: int, end: int, *, inputs: bool) -> dict[str, Any]:
    """SGLang's logprob keys of ``meta_info`` (none without ``return_logprob``): output
    positions ``start..end-1``, and the prompt's with ``inputs``. Entries are
    ``[logprob, token_id, None]`` (SGLang's, with return_text_in_logprobs false)."""
    if not req.return_logprob:
        return {}
    state = req.logprob
    meta: dict[str, Any] = {
        "output_token_logprobs": [
            [value, token, None]
            for value, token in zip(
                state.output_vals[start:end], req.output_ids[start:end], strict=False
            )
        ]
    }
    top = req.top_logprobs_num > 0
    if top:
        meta["output_top_logprobs"] = [_top_entry(entry) for entry in state.output_tops[start:end]]
    if inputs:
        prompt = req.origin_input_ids[req.logprob_start_len :] if state.input_done else []
        meta["input_token_logprobs"] = [
            [value, token, None] for value, token in zip(state.input_vals, prompt, strict=False)
        ]
        if top:
            tops = state.input_tops if state.input_done else []
            meta["input_top_logprobs"] = [_top_entry(entry) for entry in tops]
    return meta


def _top_entry(entry: Any) -> list[list[Any]] | None:
    """One position's top logprobs, ``[[logprob, token_id, None], ...]``, or None."""
    if entry is None:
        return None
    return [[value, token, None] for value, token in entry]


def _fingerprint(input_ids: list[int], msg: Any) -> str:
    """What makes two submissions of one rid the same request."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(input_ids).encode())
    digest.update(msg.sampling.model_dump_json().encode())
    digest.update(repr(msg.priority).encode())
    digest.update(repr((msg.return_logprob, msg.logprob_start_len, msg.top_logprobs_num)).encode())
    return digest.hexdigest()


def _error(op_id: int | None, code: str, message: str, status_code: int) -> list[bytes]:
    return wire.pack(
        {"ok": False, "op_id": op_id, "code": code, "message": message, "status_code": status_code}
    )
