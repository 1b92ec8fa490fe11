"""``python -m scheduler_svc.pd.router``: the PD front, with the normal-mode generate API.

A client talks to the router exactly as to a normal-mode scheduler (but for
``return_logprob``, refused with 400: the first token's logprobs would be on
the prefill node; ``flush_cache`` goes to both nodes). For each
``generate`` the router derives a bootstrap room from the rid and sends the
request to both nodes: the prefill scheduler computes the prompt's KV and first token and
memsvc-P writes them into the pages memsvc-D preallocated; the decode
scheduler streams the output, which the router relays (the nodes' replies:
:mod:`scheduler_svc.pd.node_replies`)::

    client ──generate──► router ──(room)──► scheduler-P ──► memsvc-P ══KV══► memsvc-D
                           ▲      └─(room)─► scheduler-D ◄────────────────────┘
                           └────── chunk / done ───────────┘

A decode node that must re-prefill a victim (``--pd-retract-fallback
recompute``, or after memsvc-D lost its KV) asks through the router (a
``rebootstrap`` reply), which sends the prefill node ``origin + output[:-1]``
under a fresh room and aborts what the prefill node still ran for the old
one (the decode node no longer expects it). If the prefill
node rejects a request, or stops answering for ``--prefill-timeout`` seconds,
the decode side is aborted and the client gets the prefill node's error.

Faults (see docs/faults.md): the bootstrap room is derived from the
rid, so a client that re-submits through a restarted router pairs the two
nodes' halves of its request again (each node attaches a live rid or answers
a finished one from its result cache); a re-submission to this router takes
over the live request's replies (the decode node restarts the stream at
offset 0), if it comes from the client that submitted it (the ``client`` id of
its messages); another client's gets ``duplicate_rid``, and its abort
``not_owner``. The router passes that id on to both nodes, which check it
too. A scheduler restarted at the same address (a new pid answers the
router's ping) is caught up (:mod:`scheduler_svc.pd.node_watch`): the prefill one
gets the prefill requests its predecessor had not answered, the decode one
every live request again; those it adopted with their KV decode on, the rest
start over (their prompt prefilled again). A prefill request left without a use (its decode side
ended first) is aborted on the prefill node, so nothing stays held there.
Undecodable replies are dropped; a ``malformed`` error for a generate
(damaged on the way) sends it again.

A decode node with ``--migrate-to`` may move a request to its peer decode node
with its KV (:mod:`scheduler_svc.pd.migrate`). The router asks to follow moves
(``follow_moves``; ``--relay-moves``: the node relays instead): the node
answers ``moved`` with the peer's address, and the router re-submits the
generate there (the peer attaches it to the moved request; the stream restarts
at offset 0), then streams, aborts and watches the request there.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import sys
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from memsvc import protocol as wire
from memsvc.cli import add_service_args, setup_logging, write_ready_file
from memsvc.curve import CurveKeys, add_curve_arguments, curve_from_args, make_client, secure_server
from memsvc.lifeline import die_with_parent
from memsvc.limits import recv_bounded_async
from memsvc.server import (
    check_listen_address,
    default_listen_address,
    remove_endpoint,
    serve_tasks,
)
from memsvc.settings import add_arguments, add_config_argument, from_args, parse_args, setting
from scheduler_svc import protocol as p
from scheduler_svc.pd.flight import (
    Flight,
    error_header,
    fingerprint,
    room_for,
)
from scheduler_svc.pd.node_replies import NodeReplies
from scheduler_svc.pd.node_watch import NodeWatch
from scheduler_svc.replies import error_reply
from scheduler_svc.stall import wedged

log = logging.getLogger("scheduler_svc.pd.router")

STALL_TIMEOUT_S = 30.0  # no node with work progressed this long: the stack is wedged


class Router:
    def __init__(
        self,
        listen: str,
        prefill: str,
        decode: str,
        *,
        prefill_timeout_s: float = 10.0,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        follow_moves: bool = True,
        curve: CurveKeys | None = None,
    ) -> None:
        self.listen, self.prefill_address, self.decode_address = listen, prefill, decode
        # decode nodes by address: the one new requests go to, and those they moved to
        self.decode_nodes: dict[str, zmq.asyncio.Socket] = {}
        self.curve = curve or CurveKeys()  # server: the client socket; client: the nodes
        self.prefill_timeout_s = prefill_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.follow_moves = follow_moves
        self._ops = itertools.count(1)
        self.flights: dict[str, Flight] = {}  # live requests by rid
        self.by_decode_op: dict[int, Flight] = {}
        self.by_prefill_op: dict[int, Flight] = {}
        self._pending: dict[int, asyncio.Future] = {}  # abort / info round trips
        self.prefill_seen = time.monotonic()
        self.replies = NodeReplies(self)
        self.watch = NodeWatch(self)
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.stats = {
            "requests": 0,
            "rebootstraps": 0,
            "prefill_errors": 0,
            "resubmits": 0,  # a client sent a live rid again
            "prefill_resends": 0,  # re-sent to a restarted prefill scheduler
            "redrives": 0,  # started over on a restarted decode scheduler
            "reattached": 0,  # adopted by a restarted decode scheduler: decoding on
            "moves_followed": 0,  # moved to another decode node: re-submitted there
        }

    async def run(self, ready_file: str | None = None) -> None:
        self.ctx = ctx = zmq.asyncio.Context()
        self.front = ctx.socket(zmq.ROUTER)
        self.prefill = ctx.socket(zmq.DEALER)

        def announce() -> None:
            write_ready_file(ready_file, self.listen)
            print(f"router listening on {self.listen}", flush=True)

        auth = None
        try:
            for sock in (self.front, self.prefill):
                sock.setsockopt(zmq.LINGER, 0)
            p.MESSAGE_LIMIT.apply(self.front)
            make_client(self.prefill, self.curve.client)
            auth = secure_server(ctx, self.front, self.curve.server)
            self.front.bind(self.listen)
            self.decode = self.decode_node(self.decode_address, spawn=False)
            self.prefill.connect(self.prefill_address)
            loops = [
                self._from_clients(),
                self.replies.from_decode(self.decode_address, self.decode),
                self.replies.from_prefill(),
                self.watch.watch_prefill(),
                self.watch.watch_decode(),
            ]
            await serve_tasks(loops, self._stop, announce)
        finally:
            for sock in (self.front, self.prefill, *self.decode_nodes.values()):
                sock.close(0)
            if auth is not None:
                auth.stop()
            ctx.term()
            remove_endpoint(self.listen, ready_file)

    # -- clients -----------------------------------------------------------------------

    async def _from_clients(self) -> None:
        while True:
            inbound = await recv_bounded_async(self.front, p.MESSAGE_LIMIT, keep=2)
            if len(inbound.frames) < 2:
                continue
            identity, payload = inbound.frames[0], inbound.frames[1:]
            try:
                if inbound.too_large is not None:
                    raise inbound.too_large  # only its header was kept
                msg = p.parse_request(payload)
                if msg.op == "generate":
                    await self._generate(identity, msg)
                elif msg.op == "abort":
                    self.spawn(self._abort(identity, msg))
                elif msg.op == "flush_cache":
                    self.spawn(self._flush_cache(identity, msg))
                elif msg.op == "info":
                    self.spawn(self._info(identity, msg))
                else:  # a node's op (migrate_in, adopted): not the router's
                    message = f"the router does not serve {msg.op!r}"
                    await self.reply(identity, error_reply(msg.op_id, "bad_request", message, 400))
            except wire.ProtocolError as exc:
                # Echo the op_id even of an invalid message: the client matches by it.
                op_id = wire.best_effort_op_id(payload)
                await self.reply(identity, error_reply(op_id, exc.code, exc.message, 400))

    async def _generate(self, identity: bytes, msg: p.Generate) -> None:
        if msg.return_logprob:
            message = "return_logprob is not supported in PD (prefill/decode) mode"
            await self.reply(identity, error_reply(msg.op_id, "bad_request", message, 400))
            return
        key = fingerprint(msg)
        live = self.flights.get(msg.rid)
        if live is not None:
            if (live.client, live.fingerprint) != (msg.client, key):
                whose = "" if live.client == msg.client else " for another client"
                message = f"request {msg.rid!r} is already running{whose}"
                await self.reply(identity, error_reply(msg.op_id, "duplicate_rid", message, 400))
                return
            if (live.identity, live.op_id) == (identity, msg.op_id):
                return  # the same message twice
            # Re-submitted (the client lost its connection or heard nothing for a while):
            # the decode node attaches it to the live request and restarts the stream.
            self.stats["resubmits"] += 1
            live.identity, live.op_id = identity, msg.op_id
            live.header["stream"] = msg.stream
            await self.send_decode(live)
            return
        room = room_for(msg.rid)
        header = {
            "op": "generate",
            "rid": msg.rid,
            "client": msg.client,  # the nodes check it too: a restarted router passes it on
            "sampling": msg.sampling.model_dump(),
            "stream": msg.stream,
            "priority": msg.priority,
            "bootstrap_room": room,
            "follow_moves": self.follow_moves,  # a move: re-submitted to the peer
        }
        # both nodes put its KV in its namespace (a re-bootstrap's prefill keeps it too)
        for name in ("cache_salt", "extra_key"):
            if getattr(msg, name) is not None:
                header[name] = getattr(msg, name)
        arrays = None
        if msg.input_ids is not None:
            arrays = {"input_ids": msg.input_ids}
        else:
            header["text"] = msg.text
        prompt_len = msg.input_ids.size if msg.input_ids is not None else None
        flight = Flight(identity, msg.op_id, msg.rid, header, arrays, key, prompt_len)
        flight.decode_address = self.decode_address
        self.flights[msg.rid] = flight
        self.stats["requests"] += 1
        await self.send_decode(flight)
        await self.send_prefill(flight, {**header, "stream": False}, arrays)

    async def send_decode(self, flight: Flight) -> None:
        """(Re-)send the generate to its decode node; replies to an earlier one are dropped."""
        self.by_decode_op.pop(flight.decode_op, None)
        flight.decode_op = self.next_op()
        self.by_decode_op[flight.decode_op] = flight
        frames = wire.pack({**flight.header, "op_id": flight.decode_op}, flight.arrays)
        await self.decode_of(flight).send_multipart(frames)

    def decode_of(self, flight: Flight) -> zmq.asyncio.Socket:
        """The socket to the decode node that holds ``flight`` now."""
        return self.decode_nodes[flight.decode_address or self.decode_address]

    def decode_node(self, address: str, *, spawn: bool = True) -> zmq.asyncio.Socket:
        """The socket to the decode node at ``address``, connected (with its replies read,
        unless ``spawn`` is False: the caller reads them) on first use."""
        sock = self.decode_nodes.get(address)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            make_client(sock, self.curve.client)
            sock.connect(address)
            self.decode_nodes[address] = sock
            if spawn:
                self.spawn(self.replies.from_decode(address, sock))
        return sock

    async def send_prefill(
        self, flight: Flight, header: dict, arrays: dict | None, commit_mark: int = 0
    ) -> None:
        """Send a prefill request; the decode node now waits for its KV."""
        op = self.next_op()
        flight.prefill_ops[op] = (header, arrays)
        if header["rid"] not in flight.prefill_rids:
            flight.prefill_rids.append(header["rid"])
        flight.current, flight.commit_mark = op, commit_mark
        flight.prefill_sent = time.monotonic()
        self.by_prefill_op[op] = flight
        await self.prefill.send_multipart(wire.pack({**header, "op_id": op}, arrays))

    async def end(self, flight: Flight, *, cleanup: bool = True) -> None:
        """The decode side ended ``flight``: forget it; abort what the prefill node still runs."""
        self.by_decode_op.pop(flight.decode_op, None)
        if self.flights.get(flight.rid) is flight:
            del self.flights[flight.rid]
        left = self.drop_prefill_ops(flight)
        if cleanup:
            await self.abort_on_prefill(left, flight.client)

    def drop_prefill_ops(self, flight: Flight) -> list[str]:
        """Stop waiting for the prefill node's replies to ``flight``; their rids."""
        rids = [header["rid"] for header, _ in flight.prefill_ops.values()]
        for op in flight.prefill_ops:
            self.by_prefill_op.pop(op, None)
        flight.prefill_ops.clear()
        flight.current = None
        return list(dict.fromkeys(rids))

    async def abort_on_prefill(self, rids: list[str], client: str) -> None:
        """Abort ``rids`` on the prefill node, as ``client`` (who owns them there)."""
        for rid in rids:
            await self.prefill.send_multipart(
                wire.pack({"op": "abort", "rid": rid, "client": client, "op_id": self.next_op()})
            )

    async def _abort(self, identity: bytes, msg: p.Abort) -> None:
        flight = self.flights.get(msg.rid)
        if flight is not None and flight.client != msg.client:
            message = f"request {msg.rid!r} belongs to another client"
            await self.reply(identity, error_reply(msg.op_id, "not_owner", message, 403))
            return
        node = self.decode if flight is None else self.decode_of(flight)
        found = await self.call(node, {"op": "abort", "rid": msg.rid, "client": msg.client})
        await self.abort_on_prefill(self._prefill_rids(msg.rid), msg.client)
        if found is not None and not found.get("ok"):  # the node knows the owner (a new router)
            await self.reply(identity, wire.pack({**found, "op_id": msg.op_id}))
            return
        reply = {"ok": True, "op_id": msg.op_id, "found": bool(found and found.get("found"))}
        await self.reply(identity, wire.pack(reply))

    async def _flush_cache(self, identity: bytes, msg: p.FlushCache) -> None:
        """SGLang's flush_cache on both nodes: flushed only if both flushed."""
        flushed, messages = True, []
        nodes = [("prefill", self.prefill)]
        for address, sock in self.decode_nodes.items():  # the moves' peers too
            nodes.append(("decode" if address == self.decode_address else address, sock))
        for name, sock in nodes:
            keys = {k: getattr(msg, k) for k in ("cache_salt", "extra_key")}
            reply = await self.call(
                sock, {"op": "flush_cache", **{k: v for k, v in keys.items() if v is not None}}
            )
            if reply is None or not reply.get("ok"):
                why = "no answer" if reply is None else reply.get("message", "")
                flushed, text = False, f"Cache not flushed: {why}"
            else:
                flushed = flushed and bool(reply.get("flushed"))
                text = str(reply.get("message", ""))
            messages.append(f"{name}: {text}")
        reply = {"ok": True, "op_id": msg.op_id, "flushed": flushed, "message": "; ".join(messages)}
        await self.reply(identity, wire.pack(reply))

    def _prefill_rids(self, rid: str) -> list[str]:
        """``rid`` and the names its re-bootstraps ran under on the prefill node."""
        flight = self.flights.get(rid)
        return list(dict.fromkeys([rid, *(flight.prefill_rids if flight else [])]))

    async def _info(self, identity: bytes, msg: p.Info) -> None:
        """The decode node's info, with the prefill node's and the router's.

        A wedged stack (see :func:`scheduler_svc.stall.wedged`) answers it as an
        error (503, code ``wedged``) that still carries the info: health checks
        (``kvstack status``, ``GET /health``) then report it unhealthy.
        """
        decode = await self.call(self.decode, {"op": "info"})
        prefill = await self.call(self.prefill, {"op": "info"}, timeout=2.0)
        router = {**self.stats, "flights": len(self.flights), "decode_nodes": [*self.decode_nodes]}
        if decode is None:  # (a drained decode node stopped): the router's own figures
            error = error_header("unavailable", "the decode node does not answer", 503)
            reply = {**error, "op_id": msg.op_id, "mode": "pd", "prefill": prefill}
            await self.reply(identity, wire.pack({**reply, "router": router}))
            return
        info = {k: v for k, v in decode.items() if k not in ("op_id", "ok")}
        info.update(mode="pd", prefill=prefill, router=router)
        progress = {"decode": decode.get("progress"), "prefill": (prefill or {}).get("progress")}
        why = wedged(progress, self.stall_timeout_s)
        status = {"ok": True} if why is None else error_header("wedged", why, 503)
        await self.reply(identity, wire.pack({**info, **status, "op_id": msg.op_id}))

    async def call(
        self, sock: zmq.asyncio.Socket, header: dict, timeout: float = 10.0
    ) -> dict | None:
        op = self.next_op()
        future = asyncio.get_running_loop().create_future()
        self._pending[op] = future
        try:
            await sock.send_multipart(wire.pack({**header, "op_id": op}))
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            return None
        finally:
            self._pending.pop(op, None)

    def next_op(self) -> int:
        """A fresh op_id for a message to a node."""
        return next(self._ops)

    def answered(self, header: dict) -> bool:
        """Whether a node's ``header`` answers one of :meth:`call`'s round trips (handed to it)."""
        future = self._pending.get(header.get("op_id"))
        if future is None:
            return False
        if not future.done():
            future.set_result(header)
        return True

    def spawn(self, coro) -> None:
        """Run ``coro`` beside the loops (kept referenced until it ends)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reply(self, identity: bytes, frames: list[bytes]) -> None:
        await self.front.send_multipart([identity, *frames])


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """The router's settings; its flags are declared here (:mod:`memsvc.settings`)."""

    prefill: str = setting(help="the prefill scheduler's address")
    decode: str = setting(help="the decode scheduler's address")
    prefill_timeout: float = setting(
        10.0, "seconds of silence from the prefill scheduler before its requests fail", forward=True
    )
    relay_moves: bool = setting(
        False,
        "have a decode node relay the replies of a request it moved to its peer "
        "(--migrate-to), as for any client that does not follow moves; by default the "
        "router re-submits the request to that peer and streams from there, and the first "
        "node holds nothing of it",
        forward=True,
    )
    stall_timeout: float = setting(
        STALL_TIMEOUT_S,
        "seconds in which no node with queued work makes progress before the router's info "
        "(and so `kvstack status` and GET /health) calls the stack wedged",
        forward=True,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scheduler_svc.pd.router",
        description="kvstack PD router: the normal-mode generate API in front of a prefill "
        "and a decode scheduler (scheduler_svc --mode prefill / --mode decode).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_argument(parser)
    add_arguments(parser, RouterConfig)
    add_service_args(parser, ready_fields="address, pid")
    add_curve_arguments(parser, connects_to="the two schedulers (--prefill, --decode)")
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # when started by a launcher: SIGTERM once it is gone
    args = parse_args(build_parser(), argv)
    setup_logging(args)
    listen = args.listen or default_listen_address("router")
    try:
        check_listen_address(listen, allow_remote=args.allow_remote)
        curve = curve_from_args(args)
    except Exception as exc:
        print(f"router: error: {exc}", file=sys.stderr)
        return 2
    config = from_args(RouterConfig, args)
    router = Router(
        listen,
        config.prefill,
        config.decode,
        prefill_timeout_s=config.prefill_timeout,
        stall_timeout_s=config.stall_timeout,
        follow_moves=not config.relay_moves,
        curve=curve,
    )
    asyncio.run(router.run(args.ready_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
