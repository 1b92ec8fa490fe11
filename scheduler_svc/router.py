"""``python -m scheduler_svc.router``: the PD front, with the normal-mode generate API.

A client talks to the router exactly as to a normal-mode scheduler. For each
``generate`` the router picks a bootstrap room and sends the request to both
nodes: the prefill scheduler computes the prompt's KV and first token and
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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from memsvc import protocol as wire
from memsvc.cli import add_service_args, setup_logging, write_ready_file
from memsvc.server import check_listen_address, default_listen_address
from scheduler_svc import protocol as p

log = logging.getLogger("scheduler_svc.router")

PING_INTERVAL_S = 1.0


@dataclass
class Flight:
    """One client request in flight through both nodes."""

    identity: bytes
    op_id: int
    rid: str
    header: dict[str, Any]  # the generate as the decode node got it
    prefill_ops: set[int] = field(default_factory=set)
    prefill_error: dict[str, Any] | None = None
    prefill_done: bool = False


class Router:
    def __init__(
        self, listen: str, prefill: str, decode: str, *, prefill_timeout_s: float = 10.0
    ) -> None:
        self.listen, self.prefill_address, self.decode_address = listen, prefill, decode
        self.prefill_timeout_s = prefill_timeout_s
        self._ops = itertools.count(1)
        self._rooms = itertools.count(secrets.randbelow(1 << 40) << 16)
        self._by_decode_op: dict[int, Flight] = {}
        self._by_prefill_op: dict[int, Flight] = {}
        self._pending: dict[int, asyncio.Future] = {}  # abort / info round trips
        self._prefill_seen = time.monotonic()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.stats = {"requests": 0, "rebootstraps": 0, "prefill_errors": 0}

    async def run(self, ready_file: str | None = None) -> None:
        ctx = zmq.asyncio.Context()
        self.front = ctx.socket(zmq.ROUTER)
        self.decode = ctx.socket(zmq.DEALER)
        self.prefill = ctx.socket(zmq.DEALER)
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task] = []
        try:
            for sock in (self.front, self.decode, self.prefill):
                sock.setsockopt(zmq.LINGER, 0)
            self.front.bind(self.listen)
            self.decode.connect(self.decode_address)
            self.prefill.connect(self.prefill_address)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stop.set)
            tasks = [
                asyncio.create_task(self._from_clients()),
                asyncio.create_task(self._from_decode()),
                asyncio.create_task(self._from_prefill()),
                asyncio.create_task(self._watch_prefill()),
            ]
            write_ready_file(ready_file, self.listen)
            print(f"router listening on {self.listen}", flush=True)
            stop = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait([*tasks, stop], return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            for task in done:
                if task is not stop and task.exception():
                    raise task.exception()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            for sock in (self.front, self.decode, self.prefill):
                sock.close(0)
            ctx.term()
            if self.listen.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.listen[len("ipc://") :])
            if ready_file:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(ready_file)

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
        room = next(self._rooms)
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
        flight = Flight(identity, msg.op_id, msg.rid, header)
        self.stats["requests"] += 1
        decode_op = next(self._ops)
        self._by_decode_op[decode_op] = flight
        await self.decode.send_multipart(wire.pack({**header, "op_id": decode_op}, arrays))
        await self._send_prefill(flight, {**header, "stream": False}, arrays)

    async def _send_prefill(self, flight: Flight, header: dict, arrays: dict | None) -> None:
        op = next(self._ops)
        flight.prefill_ops.add(op)
        self._by_prefill_op[op] = flight
        await self.prefill.send_multipart(wire.pack({**header, "op_id": op}, arrays))

    async def _abort(self, identity: bytes, msg: p.Abort) -> None:
        found = await self._call(self.decode, {"op": "abort", "rid": msg.rid})
        for rid in self._prefill_rids(msg.rid):
            await self.prefill.send_multipart(
                wire.pack({"op": "abort", "rid": rid, "op_id": next(self._ops)})
            )
        reply = {"ok": True, "op_id": msg.op_id, "found": bool(found and found.get("found"))}
        await self._reply(identity, wire.pack(reply))

    def _prefill_rids(self, rid: str) -> list[str]:
        """``rid`` and the names its re-bootstraps ran under on the prefill node."""
        names = [rid]
        for flight in self._by_decode_op.values():
            if flight.rid == rid:
                names += [f"{rid}:rb{room}" for room in flight.header.get("rebootstrap_rooms", ())]
        return names

    async def _info(self, identity: bytes, msg: p.Info) -> None:
        decode = await self._call(self.decode, {"op": "info"})
        prefill = await self._call(self.prefill, {"op": "info"}, timeout=2.0)
        if decode is None:
            reply = _error(msg.op_id, "unavailable", "the decode node does not answer", 503)
        else:
            info = {k: v for k, v in decode.items() if k not in ("op_id", "ok")}
            info.update(mode="pd", prefill=prefill, router=dict(self.stats))
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
            header = wire.unpack(await self.decode.recv_multipart())
            op = header.get("op_id")
            if op in self._pending:
                self._pending[op].set_result(header)
                continue
            flight = self._by_decode_op.get(op)
            if flight is None:
                continue
            kind = header.get("type")
            if kind == "rebootstrap":
                await self._rebootstrap(flight, header)
                continue
            final = kind == "done" or not header.get("ok")
            if final:
                del self._by_decode_op[op]
                for prefill_op in flight.prefill_ops:
                    self._by_prefill_op.pop(prefill_op, None)
                if flight.prefill_error is not None and _is_abort(header):
                    header = flight.prefill_error  # say why the prefill side failed
            await self._reply(flight.identity, wire.pack({**header, "op_id": flight.op_id}))

    async def _rebootstrap(self, flight: Flight, header: dict) -> None:
        """The decode node re-prefills a victim through us: origin + output[:-1], one token."""
        self.stats["rebootstraps"] += 1
        room = int(header["room"])
        flight.header.setdefault("rebootstrap_rooms", []).append(room)
        sampling = {**flight.header["sampling"], "max_new_tokens": 1, "ignore_eos": True}
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
        await self._send_prefill(flight, request, {"input_ids": ids})

    async def _from_prefill(self) -> None:
        while True:
            header = wire.unpack(await self.prefill.recv_multipart())
            self._prefill_seen = time.monotonic()
            op = header.get("op_id")
            if op in self._pending:
                self._pending[op].set_result(header)
                continue
            flight = self._by_prefill_op.pop(op, None)
            if flight is None or header.get("type") == "chunk":
                continue
            flight.prefill_ops.discard(op)
            flight.prefill_done = True
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
            self._spawn(self._call(self.prefill, {"op": "info"}, timeout=PING_INTERVAL_S))
            silent = time.monotonic() - self._prefill_seen
            if silent < self.prefill_timeout_s:
                continue
            for flight in list(self._by_decode_op.values()):
                if flight.prefill_ops and flight.prefill_error is None:
                    why = f"prefill node unreachable for {silent:.0f}s"
                    await self._prefill_failed(
                        flight, _error_header("prefill_unreachable", why, 500)
                    )


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
