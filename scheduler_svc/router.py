"""``python -m scheduler_svc.router``: the PD front, with the normal-mode generate API.

A client talks to the router exactly as to a normal-mode scheduler. For each
``generate`` the router derives a bootstrap room from the rid and sends the
request to both nodes: the prefill scheduler computes the prompt's KV and first token and
memsvc-P writes them into the pages memsvc-D preallocated; the decode
scheduler streams the output, which the router relays::

    client ──generate──► router ──(room)──► scheduler-P ──► memsvc-P ══KV══► memsvc-D
                           ▲      └─(room)─► scheduler-D ◄────────────────────┘
                           └────── chunk / done ───────────┘

A decode node that must re-prefill a victim (``--pd-retract-fallback
recompute``) asks through the router (a ``rebootstrap`` reply), which sends
the prefill node ``origin + output[:-1]`` under a fresh room. If the prefill
node rejects a request, or stops answering for ``--prefill-timeout`` seconds,
the decode side is aborted and the client gets the prefill node's error.

Faults (see README "Fault tolerance"): the bootstrap room is derived from the
rid, so a client that re-submits through a restarted router pairs the two
nodes' halves of its request again (each node attaches a live rid or answers
a finished one from its result cache); a re-submission to this router takes
over the live request's replies (the decode node restarts the stream at
offset 0). A scheduler restarted at the same address (a new pid answers the
router's ping) is caught up: the prefill one gets the prefill requests its
predecessor had not answered, the decode one every live request again from
the start (whose prompt the prefill node prefills again). A prefill request
left without a use (its decode side ended first) is aborted on the prefill
node, so nothing stays held there. Undecodable replies are dropped; a
``malformed`` error for a generate (damaged on the way) sends it again.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from memsvc import protocol as wire
from memsvc.cli import add_service_args, setup_logging, write_ready_file
from memsvc.server import (
    check_listen_address,
    default_listen_address,
    remove_endpoint,
    serve_tasks,
)
from scheduler_svc import protocol as p
from scheduler_svc.engine import _seed_from_rid

log = logging.getLogger("scheduler_svc.router")

PING_INTERVAL_S = 1.0
MAX_DECODE_RESENDS = 3  # a generate the decode node calls malformed (damaged on the way)
ROOM_BITS = 62  # decode-node re-bootstrap rooms start at 1 << 62


def room_for(key: str) -> int:
    """The bootstrap room of a rid: a restarted router pairs the nodes again."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - ROOM_BITS)


@dataclass
class Flight:
    """One client request in flight through both nodes."""

    identity: bytes
    op_id: int
    rid: str
    header: dict[str, Any]  # the generate as the decode node got it
    arrays: dict[str, Any] | None = None
    fingerprint: str = ""  # input + sampling + priority: a re-submission must match it
    prompt_len: int | None = None
    decode_op: int = 0
    # prefill requests not answered yet: op -> (header, arrays), to re-send or abort
    prefill_ops: dict[int, tuple[dict[str, Any], Any]] = field(default_factory=dict)
    prefill_rids: list[str] = field(default_factory=list)  # its names on the prefill node
    current: int | None = None  # the prefill op whose KV the decode node still waits for
    commit_mark: int = 0  # a decode chunk past this many tokens: that KV arrived
    seen: int = 0  # output tokens the decode node has streamed
    prefill_error: dict[str, Any] | None = None
    resends: int = 0
    redrives: int = 0  # started over on a restarted decode scheduler
    redrive_pending: bool = False  # prefill again once the prefill node answers the last one


class Router:
    def __init__(
        self, listen: str, prefill: str, decode: str, *, prefill_timeout_s: float = 10.0
    ) -> None:
        self.listen, self.prefill_address, self.decode_address = listen, prefill, decode
        self.prefill_timeout_s = prefill_timeout_s
        self._ops = itertools.count(1)
        self._flights: dict[str, Flight] = {}  # live requests by rid
        self._by_decode_op: dict[int, Flight] = {}
        self._by_prefill_op: dict[int, Flight] = {}
        self._pending: dict[int, asyncio.Future] = {}  # abort / info round trips
        self._prefill_seen = time.monotonic()
        self._pids: dict[str, int | None] = {"prefill": None, "decode": None}  # who answers
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.stats = {
            "requests": 0,
            "rebootstraps": 0,
            "prefill_errors": 0,
            "resubmits": 0,  # a client sent a live rid again
            "prefill_resends": 0,  # re-sent to a restarted prefill scheduler
            "redrives": 0,  # started over on a restarted decode scheduler
        }

    async def run(self, ready_file: str | None = None) -> None:
        ctx = zmq.asyncio.Context()
        self.front = ctx.socket(zmq.ROUTER)
        self.decode = ctx.socket(zmq.DEALER)
        self.prefill = ctx.socket(zmq.DEALER)

        def announce() -> None:
            write_ready_file(ready_file, self.listen)
            print(f"router listening on {self.listen}", flush=True)

        try:
            for sock in (self.front, self.decode, self.prefill):
                sock.setsockopt(zmq.LINGER, 0)
            self.front.bind(self.listen)
            self.decode.connect(self.decode_address)
            self.prefill.connect(self.prefill_address)
            loops = [
                self._from_clients(),
                self._from_decode(),
                self._from_prefill(),
                self._watch_prefill(),
                self._watch_decode(),
            ]
            await serve_tasks(loops, self._stop, announce)
        finally:
            for sock in (self.front, self.decode, self.prefill):
                sock.close(0)
            ctx.term()
            remove_endpoint(self.listen, ready_file)

    # -- clients -----------------------------------------------------------------------

    async def _from_clients(self) -> None:
        while True:
            frames = await self.front.recv_multipart()
            if len(frames) < 2:
                continue
            identity, payload = frames[0], frames[1:]
            op_id = None
            try:
                msg = p.parse_request(payload)
                op_id = msg.op_id
                if msg.op == "generate":
                    await self._generate(identity, msg)
                elif msg.op == "abort":
                    self._spawn(self._abort(identity, msg))
                else:
                    self._spawn(self._info(identity, msg))
            except wire.ProtocolError as exc:
                await self._reply(identity, _error(op_id, exc.code, exc.message, 400))

    async def _generate(self, identity: bytes, msg: p.Generate) -> None:
        fingerprint = _fingerprint(msg)
        live = self._flights.get(msg.rid)
        if live is not None:
            if live.fingerprint != fingerprint:
                message = f"request {msg.rid!r} is already running"
                await self._reply(identity, _error(msg.op_id, "duplicate_rid", message, 400))
                return
            if (live.identity, live.op_id) == (identity, msg.op_id):
                return  # the same message twice
            # Re-submitted (the client lost its connection or heard nothing for a while):
            # the decode node attaches it to the live request and restarts the stream.
            self.stats["resubmits"] += 1
            live.identity, live.op_id = identity, msg.op_id
            live.header["stream"] = msg.stream
            await self._send_decode(live)
            return
        room = room_for(msg.rid)
        header = {
            "op": "generate",
            "rid": msg.rid,
            "sampling": msg.sampling.model_dump(),
            "stream": msg.stream,
            "priority": msg.priority,
            "bootstrap_room": room,
        }
        arrays = None
        if msg.input_ids is not None:
            arrays = {"input_ids": msg.input_ids}
        else:
            header["text"] = msg.text
        prompt_len = msg.input_ids.size if msg.input_ids is not None else None
        flight = Flight(identity, msg.op_id, msg.rid, header, arrays, fingerprint, prompt_len)
        self._flights[msg.rid] = flight
        self.stats["requests"] += 1
        await self._send_decode(flight)
        await self._send_prefill(flight, {**header, "stream": False}, arrays)

    async def _send_decode(self, flight: Flight) -> None:
        """(Re-)send the generate to the decode node; replies to an earlier one are dropped."""
        self._by_decode_op.pop(flight.decode_op, None)
        flight.decode_op = next(self._ops)
        self._by_decode_op[flight.decode_op] = flight
        frames = wire.pack({**flight.header, "op_id": flight.decode_op}, flight.arrays)
        await self.decode.send_multipart(frames)

    async def _send_prefill(
        self, flight: Flight, header: dict, arrays: dict | None, commit_mark: int = 0
    ) -> None:
        """Send a prefill request; the decode node now waits for its KV."""
        op = next(self._ops)
        flight.prefill_ops[op] = (header, arrays)
        if header["rid"] not in flight.prefill_rids:
            flight.prefill_rids.append(header["rid"])
        flight.current, flight.commit_mark = op, commit_mark
        self._by_prefill_op[op] = flight
        await self.prefill.send_multipart(wire.pack({**header, "op_id": op}, arrays))

    async def _end(self, flight: Flight, *, cleanup: bool = True) -> None:
        """The decode side ended ``flight``: forget it; abort what the prefill node still runs."""
        self._by_decode_op.pop(flight.decode_op, None)
        if self._flights.get(flight.rid) is flight:
            del self._flights[flight.rid]
        left = self._drop_prefill_ops(flight)
        if cleanup:
            await self._abort_on_prefill(left)

    def _drop_prefill_ops(self, flight: Flight) -> list[str]:
        """Stop waiting for the prefill node's replies to ``flight``; their rids."""
        rids = [header["rid"] for header, _ in flight.prefill_ops.values()]
        for op in flight.prefill_ops:
            self._by_prefill_op.pop(op, None)
        flight.prefill_ops.clear()
        flight.current = None
        return list(dict.fromkeys(rids))

    async def _abort_on_prefill(self, rids: list[str]) -> None:
        for rid in rids:
            await self.prefill.send_multipart(
                wire.pack({"op": "abort", "rid": rid, "op_id": next(self._ops)})
            )

    async def _abort(self, identity: bytes, msg: p.Abort) -> None:
        found = await self._call(self.decode, {"op": "abort", "rid": msg.rid})
        await self._abort_on_prefill(self._prefill_rids(msg.rid))
        reply = {"ok": True, "op_id": msg.op_id, "found": bool(found and found.get("found"))}
        await self._reply(identity, wire.pack(reply))

    def _prefill_rids(self, rid: str) -> list[str]:
        """``rid`` and the names its re-bootstraps ran under on the prefill node."""
        flight = self._flights.get(rid)
        return list(dict.fromkeys([rid, *(flight.prefill_rids if flight else [])]))

    async def _info(self, identity: bytes, msg: p.Info) -> None:
        decode = await self._call(self.decode, {"op": "info"})
        prefill = await self._call(self.prefill, {"op": "info"}, timeout=2.0)
        if decode is None:
            reply = _error(msg.op_id, "unavailable", "the decode node does not answer", 503)
        else:
            info = {k: v for k, v in decode.items() if k not in ("op_id", "ok")}
            router = {**self.stats, "flights": len(self._flights)}
            info.update(mode="pd", prefill=prefill, router=router)
            reply = wire.pack({"ok": True, "op_id": msg.op_id, **info})
        await self._reply(identity, reply)

    async def _call(
        self, sock: zmq.asyncio.Socket, header: dict, timeout: float = 10.0
    ) -> dict | None:
        op = next(self._ops)
        future = asyncio.get_running_loop().create_future()
        self._pending[op] = future
        try:
            await sock.send_multipart(wire.pack({**header, "op_id": op}))
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            return None
        finally:
            self._pending.pop(op, None)

    def _spawn(self, coro) -> None:
        """Run ``coro`` beside the loops (kept referenced until it ends)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reply(self, identity: bytes, frames: list[bytes]) -> None:
        await self.front.send_multipart([identity, *frames])

    # -- nodes -------------------------------------------------------------------------

    async def _from_decode(self) -> None:
        while True:
            header = _unpack(await self.decode.recv_multipart(), "decode")
            if header is None:
                continue
            op = header.get("op_id")
            if op in self._pending:
                if not self._pending[op].done():
                    self._pending[op].set_result(header)
                continue
            flight = self._by_decode_op.get(op)
            if flight is None:
                continue
            kind = header.get("type")
            if kind == "rebootstrap":
                await self._rebootstrap(flight, header)
                continue
            ok = header.get("ok")
            if not ok and header.get("code") == "malformed" and flight.resends < MAX_DECODE_RESENDS:
                flight.resends += 1  # the generate was damaged on the way: send it again
                await self._send_decode(flight)
                continue
            if kind == "chunk":
                end = int(header.get("offset", 0)) + len(header.get("token_ids") or ())
                flight.seen = max(flight.seen, end)
                if end > flight.commit_mark:
                    flight.current = None  # decoding past it: the KV it waited for arrived
            if kind == "done" or not ok:
                await self._end(flight, cleanup=header.get("code") != "duplicate_rid")
                if flight.prefill_error is not None and _is_abort(header):
                    header = flight.prefill_error  # say why the prefill side failed
            await self._reply(flight.identity, wire.pack({**header, "op_id": flight.op_id}))

    async def _rebootstrap(self, flight: Flight, header: dict) -> None:
        """The decode node re-prefills a victim through us: origin + output[:-1], one token.

        The prefill node samples under the request's own seed (the rid's, if it
        set none), so a request whose first token is sampled again gets the same.
        """
        self.stats["rebootstraps"] += 1
        room = int(header["room"])
        sampling = {**flight.header["sampling"], "max_new_tokens": 1, "ignore_eos": True}
        sampling["seed"] = sampling.get("seed") or _seed_from_rid(flight.rid)
        request = {
            "op": "generate",
            "rid": f"{flight.rid}:rb{room}",
            "sampling": sampling,
            "stream": False,
            "priority": flight.header.get("priority"),
            "bootstrap_room": room,
            "bootstrap_rid": flight.rid,
        }
        ids = np.asarray(header["input_ids"], dtype=wire.ARRAY_DTYPE)
        outputs = ids.size + 1 - flight.prompt_len if flight.prompt_len else 0
        await self._send_prefill(flight, request, {"input_ids": ids}, max(flight.seen, outputs))

    async def _from_prefill(self) -> None:
        while True:
            header = _unpack(await self.prefill.recv_multipart(), "prefill")
            if header is None:
                continue
            self._prefill_seen = time.monotonic()
            op = header.get("op_id")
            if op in self._pending:
                if not self._pending[op].done():
                    self._pending[op].set_result(header)
                continue
            if header.get("type") == "chunk":
                continue
            flight = self._by_prefill_op.pop(op, None)
            if flight is None:
                continue
            flight.prefill_ops.pop(op, None)
            if flight.redrive_pending:
                if not flight.prefill_ops:
                    await self._prefill_again(flight)
                continue
            if op != flight.current:
                continue  # superseded (re-sent or re-bootstrapped since): only the latest counts
            flight.current = None
            if not header.get("ok") or _is_abort(header):
                await self._prefill_failed(flight, header)

    async def _prefill_failed(self, flight: Flight, header: dict) -> None:
        """Tell the client why (once the decode side has ended the request)."""
        self.stats["prefill_errors"] += 1
        if header.get("ok"):  # a done that ended in an abort: pass its reason on
            reason = header["meta_info"]["finish_reason"]
            header = {
                "ok": False,
                "code": "prefill_failed",
                "message": reason.get("message", ""),
                "status_code": reason.get("status_code", 500),
            }
        flight.prefill_error = header
        await self.decode.send_multipart(
            wire.pack({"op": "abort", "rid": flight.rid, "op_id": next(self._ops)})
        )

    async def _watch_prefill(self) -> None:
        """Ping the prefill node; if it stays silent, fail what waits on it."""
        while True:
            await asyncio.sleep(PING_INTERVAL_S)
            self._spawn(self._ping("prefill", self.prefill, self._prefill_restarted))
            silent = time.monotonic() - self._prefill_seen
            if silent < self.prefill_timeout_s:
                continue
            for flight in list(self._flights.values()):
                if flight.current is not None and flight.prefill_error is None:
                    why = f"prefill node unreachable for {silent:.0f}s"
                    await self._prefill_failed(
                        flight, _error_header("prefill_unreachable", why, 500)
                    )

    # -- restarts of the nodes' schedulers ------------------------------------------------

    async def _watch_decode(self) -> None:
        while True:
            await asyncio.sleep(PING_INTERVAL_S)
            self._spawn(self._ping("decode", self.decode, self._decode_restarted))

    async def _ping(self, node: str, sock: zmq.asyncio.Socket, on_restart) -> None:
        """``info``; a new scheduler process answering (a new pid) means the old one died.

        (By the pid it reports rather than by the socket: a proxy in between
        would hide the disconnect.) The restarted scheduler serves only after
        ending its predecessor's memsvc session, so the old attempt's KV and
        transfer rooms are gone by then.
        """
        info = await self._call(sock, {"op": "info"}, timeout=PING_INTERVAL_S)
        pid = info.get("pid") if info and info.get("ok") else None
        if pid is None:
            return
        known, self._pids[node] = self._pids[node], pid
        if known is not None and known != pid:
            await on_restart()

    async def _prefill_restarted(self) -> None:
        """The prefill scheduler was restarted: the new one gets what the old had not answered.

        Same rid and room: the decode side still waits for that room. (The
        successor ended its predecessor's memsvc session first, which cancelled
        the transfers that session had started: those requests fail with 500.)
        """
        resent = 0
        for flight in list(self._flights.values()):
            current = flight.prefill_ops.get(flight.current) if flight.current else None
            mark = flight.commit_mark
            self._drop_prefill_ops(flight)
            if flight.redrive_pending:
                await self._prefill_again(flight)
            elif current is not None:
                await self._send_prefill(flight, *current, commit_mark=mark)
            else:
                continue
            resent += 1
        self.stats["prefill_resends"] += resent
        log.warning("prefill scheduler restarted: %d requests sent to it again", resent)

    async def _decode_restarted(self) -> None:
        """The decode scheduler was restarted, and every request it ran is gone: start over.

        Each live request goes to the new decode scheduler again (under its own
        room; the stream restarts at offset 0 and clients drop what they already
        have), and its prompt is prefilled again under a new name on the prefill
        node, once that node has answered the prefill it still runs for the
        room (that one may deliver to the new decode scheduler instead, or fail:
        either way the new prefill follows). Re-bootstraps for the old
        scheduler's rooms are aborted.
        """
        flights = list(self._flights.values())
        for flight in flights:
            room = flight.header["bootstrap_room"]
            stale = [op for op, (h, _) in flight.prefill_ops.items() if h["bootstrap_room"] != room]
            await self._abort_on_prefill([flight.prefill_ops[op][0]["rid"] for op in stale])
            for op in stale:
                del flight.prefill_ops[op]
                self._by_prefill_op.pop(op, None)
            flight.redrives += 1
            flight.prefill_error = None
            flight.current = None
            await self._send_decode(flight)
            if flight.prefill_ops:
                flight.redrive_pending = True  # prefill again once they are answered
            else:
                await self._prefill_again(flight)
        self.stats["redrives"] += len(flights)
        log.warning("decode scheduler restarted: %d requests started over", len(flights))

    async def _prefill_again(self, flight: Flight) -> None:
        """The prompt once more, under a new name on the prefill node (its first token seeded)."""
        flight.redrive_pending = False
        sampling = dict(flight.header["sampling"])
        sampling["seed"] = sampling.get("seed") or _seed_from_rid(flight.rid)
        request = {
            **flight.header,
            "sampling": sampling,
            "stream": False,
            "rid": f"{flight.rid}:rd{flight.redrives}",
            "bootstrap_rid": flight.rid,
        }
        await self._send_prefill(flight, request, flight.arrays, commit_mark=flight.seen)


def _unpack(frames: list[bytes], peer: str) -> dict[str, Any] | None:
    """A reply's header, or None for one damaged on the way (dropped, as if lost)."""
    try:
        return wire.unpack(frames)
    except wire.ProtocolError as exc:
        log.warning("dropped an undecodable reply from the %s node: %s", peer, exc.message)
        return None


def _fingerprint(msg: p.Generate) -> str:
    """What makes two submissions of one rid the same request."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(msg.input_ids.tobytes() if msg.input_ids is not None else msg.text.encode())
    digest.update(msg.sampling.model_dump_json().encode())
    digest.update(repr(msg.priority).encode())
    return digest.hexdigest()


def _is_abort(header: dict) -> bool:
    reason = (header.get("meta_info") or {}).get("finish_reason") or {}
    return header.get("type") == "done" and reason.get("type") == "abort"


def _error_header(code: str, message: str, status_code: int) -> dict[str, Any]:
    return {"ok": False, "code": code, "message": message, "status_code": status_code}


def _error(op_id: int | None, code: str, message: str, status_code: int) -> list[bytes]:
    return wire.pack({**_error_header(code, message, status_code), "op_id": op_id})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scheduler_svc.router",
        description="kvstack PD router: the normal-mode generate API in front of a prefill "
        "and a decode scheduler (scheduler_svc --mode prefill / --mode decode).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--prefill", required=True, help="the prefill scheduler's address")
    parser.add_argument("--decode", required=True, help="the decode scheduler's address")
    parser.add_argument(
        "--prefill-timeout",
        type=float,
        default=10.0,
        help="seconds of silence from the prefill scheduler before its requests fail",
    )
    add_service_args(parser, ready_fields="address, pid")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args)
    listen = args.listen or default_listen_address("router")
    try:
        check_listen_address(listen, allow_remote=args.allow_remote)
    except Exception as exc:
        print(f"router: error: {exc}", file=sys.stderr)
        return 2
    router = Router(listen, args.prefill, args.decode, prefill_timeout_s=args.prefill_timeout)
    asyncio.run(router.run(args.ready_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
