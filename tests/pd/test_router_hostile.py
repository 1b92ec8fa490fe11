"""The PD router against other local clients (issue 18, defects 5 and 6).

- A message to the router is bounded in total and per frame, as on every socket.
- A rid belongs to the client that submitted it: another client re-submitting it
  does not take over its replies, and cannot abort it; the owner can.

The router is a real process; its two nodes are stand-ins that record what
the router sends them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from kvstack.stack.process import Service
from memsvc import protocol as wire
from scheduler_svc.client import GenerateClient, GenerateError, SchedulerLostError
from tests.bounds import assert_messages_bounded
from tests.pd.test_router_health import FakeNode, open_nodes, start_router

PROMPT = [5, 6, 7, 8]
SAMPLING = {"max_new_tokens": 8, "ignore_eos": True}


class RecordingNode(FakeNode):
    """Records every message; a generate stays live until an abort ends it."""

    def __init__(self, address: str, pid: int) -> None:
        self.received: list[dict[str, Any]] = []
        self._live: dict[str, tuple[bytes, int]] = {}  # rid -> (router identity, op_id)
        self.on_op: dict[str, Callable[[bytes, dict[str, Any]], None]] = {}  # a test's answers
        super().__init__(address, pid)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            identity, *frames = self._sock.recv_multipart()
            header = wire.unpack(frames)
            self.received.append(header)
            op, op_id = header.get("op"), header.get("op_id")
            if op in self.on_op:
                self.on_op[op](identity, header)
            elif op == "info":
                reply = {"ok": True, "op_id": op_id, "pid": self.pid, "num_running": 0}
                self._send(identity, {**reply, "num_waiting": 0, "progress": self.progress})
            elif op == "generate":
                self._live[header["rid"]] = (identity, op_id)
            elif op == "abort":
                live = self._live.pop(header["rid"], None)
                self._send(identity, {"ok": True, "op_id": op_id, "found": live is not None})
                if live is not None:
                    self._send(live[0], _aborted(live[1], header["rid"]))

    def _send(self, identity: bytes, header: dict[str, Any]) -> None:
        self._sock.send_multipart([identity, *wire.pack(header)])

    def seen(self, op: str, rid: str) -> list[dict[str, Any]]:
        return [h for h in list(self.received) if h.get("op") == op and h.get("rid") == rid]


def _aborted(op_id: int, rid: str) -> dict[str, Any]:
    reason = {"type": "abort", "message": "Aborted by the client.", "status_code": 499}
    meta = {"finish_reason": reason, "prompt_tokens": len(PROMPT), "completion_tokens": 0}
    return {
        "ok": True,
        "op_id": op_id,
        "type": "done",
        "rid": rid,
        "output_ids": [],
        "meta_info": meta,
    }


@pytest.fixture
def nodes(tmp_path):
    with open_nodes(tmp_path, RecordingNode) as made:
        yield made


@pytest.fixture
def router(launcher, nodes) -> Service:
    return start_router(launcher, nodes)


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_message_is_bounded_on_the_router_socket(router) -> None:
    assert_messages_bounded(
        router.address,
        {"op": "generate", "rid": "big"},
        over_bytes=[9 << 20, 9 << 20],
        pid=router.proc.pid,
        frame_over_cap=(64 << 20) + 1,
    )
    with (
        GenerateClient(router.address, timeout_s=3, resubmits=0) as client,
        pytest.raises(GenerateError, match="1 or more tokens"),
    ):
        client.generate(input_ids=[])  # still serving


def test_another_client_can_neither_take_over_nor_abort_a_rid(router, nodes) -> None:
    """Re-submitting a live rid with the same body took over its replies (the owner
    waited out its timeout), and any client could abort any rid."""
    decode = nodes["decode"]
    owner = GenerateClient(router.address, timeout_s=30, resubmits=0)
    other = GenerateClient(router.address, timeout_s=3, resubmits=0)
    results: list[Any] = []
    waiting = threading.Thread(
        target=lambda: results.append(owner.generate(PROMPT, sampling=SAMPLING, rid="r"))
    )
    try:
        waiting.start()
        _wait_for(lambda: decode.seen("generate", "r"))
        with pytest.raises(GenerateError) as taken:
            other.generate(PROMPT, sampling=SAMPLING, rid="r")
        assert not isinstance(taken.value, SchedulerLostError)
        assert taken.value.code == "duplicate_rid", taken.value
        with pytest.raises(GenerateError) as refused:
            other.abort("r")
        assert refused.value.code == "not_owner", refused.value
        assert len(decode.seen("generate", "r")) == 1 and not decode.seen("abort", "r")
        # The owner's own abort goes through, and its generate gets the aborted result.
        assert owner.abort("r") is True
        waiting.join(timeout=10)
        assert results and results[0].finish_reason["type"] == "abort", results
    finally:
        waiting.join(timeout=10)
        owner.close()
        other.close()


def test_a_restarted_decode_node_reattaches_what_it_adopted(launcher, tmp_path) -> None:
    """The decode scheduler restarts (a new pid answers the ping): the router asks it which
    live requests it adopted, sends every one the generate again, and prefills only
    the others again (the adopted one's prefill is aborted; the other's waits for the
    prefill node's answer to the old one). A client asking the router ``adopted`` is
    refused: it is a node's op."""
    with open_nodes(tmp_path, RecordingNode) as nodes:
        decode, prefill = nodes["decode"], nodes["prefill"]
        answers: dict[str, list[str]] = {"a": ["client-a"]}

        def adopted(identity: bytes, header: dict[str, Any]) -> None:
            pairs = zip(header["rids"], header["clients"], strict=True)
            rids = [rid for rid, client in pairs if client in answers.get(rid, [])]
            decode._send(identity, {"ok": True, "op_id": header["op_id"], "rids": rids})

        decode.on_op["adopted"] = adopted
        router = start_router(launcher, nodes)
        clients = {
            rid: GenerateClient(
                router.address, timeout_s=60, resubmits=0, client_id=f"client-{rid}"
            )
            for rid in ("a", "b")
        }
        results: dict[str, Any] = {}

        def generate(rid: str) -> None:
            try:
                results[rid] = clients[rid].generate(PROMPT, sampling=SAMPLING, rid=rid)
            except Exception as exc:  # said in the check at the end
                results[rid] = exc

        threads = [threading.Thread(target=generate, args=(rid,)) for rid in clients]
        try:
            for thread in threads:
                thread.start()
            _wait_for(lambda: all(prefill.seen("generate", rid) for rid in clients))
            # the router has heard the first pid (the ping after it was answered), then a new one
            _wait_for(lambda: sum(h.get("op") == "info" for h in decode.received) >= 2)
            decode.pid = 99  # restarted
            _wait_for(lambda: all(len(decode.seen("generate", rid)) == 2 for rid in clients))
            asked = [h for h in decode.received if h.get("op") == "adopted"]
            assert len(asked) == 1 and sorted(asked[0]["rids"]) == ["a", "b"], asked
            _wait_for(lambda: prefill.seen("abort", "a"))
            assert not prefill.seen("abort", "b")  # its prefill again waits for the old one
            prefilled = [h["rid"] for h in prefill.received if h.get("op") == "generate"]
            assert sorted(prefilled) == ["a", "b"], prefilled  # nothing prefilled again yet
            with GenerateClient(router.address, timeout_s=30, resubmits=0) as other:
                router_stats = other.info()["router"]
            assert router_stats["reattached"] == 1 and router_stats["redrives"] == 1
            query = {"op": "adopted", "op_id": 3, "rids": ["a"], "clients": ["client-a"]}
            reply = _raw_call(router.address, query)
            assert not reply["ok"] and reply["code"] == "bad_request", reply
            for rid in clients:  # (a client of its own: the first is in its generate)
                with GenerateClient(router.address, timeout_s=30, client_id=f"client-{rid}") as c:
                    assert c.abort(rid) is True
        finally:
            for thread in threads:
                thread.join(timeout=10)
            for client in clients.values():
                client.close()
        ends = {rid: getattr(r, "finish_reason", {"type": repr(r)}) for rid, r in results.items()}
        assert {rid: end["type"] for rid, end in ends.items()} == {"a": "abort", "b": "abort"}


def _raw_call(address: str, header: dict[str, Any]) -> dict[str, Any]:
    """One message on a socket of its own; the reply's header."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(wire.pack(header))
        assert sock.poll(10_000), f"no answer to {header['op']!r}"
        return wire.unpack(sock.recv_multipart())
    finally:
        sock.close(0)
        ctx.term()


def test_the_router_follows_a_request_that_moved_to_another_decode_node(
    router, nodes, tmp_path
) -> None:
    """A decode node that moves a request to its peer (issue 32: draining, or a retract
    victim) answers the router ``moved``: the router re-submits the generate there
    (same rid, client and room), streams from it, and sends the owner's abort there.
    Before, the first node had to relay every reply until the request ended, so a
    drained node could not stop while its moved requests decoded on."""
    decode = nodes["decode"]
    peer = RecordingNode(f"ipc://{tmp_path}/peer.sock", 3)
    with GenerateClient(router.address, timeout_s=30, resubmits=0) as owner:

        def moved(identity: bytes, header: dict[str, Any]) -> None:
            assert header.get("follow_moves") is True, header
            reply = {"ok": True, "op_id": header["op_id"], "type": "moved", "rid": header["rid"]}
            decode._send(identity, {**reply, "peer": peer.address})

        decode.on_op["generate"] = moved
        results: list[Any] = []
        waiting = threading.Thread(
            target=lambda: results.append(owner.generate(PROMPT, sampling=SAMPLING, rid="m"))
        )
        try:
            waiting.start()
            _wait_for(lambda: peer.seen("generate", "m"))
            (first,) = decode.seen("generate", "m")
            (again,) = peer.seen("generate", "m")
            for key in ("client", "bootstrap_room", "sampling"):
                assert again[key] == first[key], key
            assert owner.abort("m") is True  # to the node that holds it now
            waiting.join(timeout=10)
            assert results and results[0].finish_reason["type"] == "abort", results
            assert peer.seen("abort", "m") and not decode.seen("abort", "m")
            assert owner.info()["router"]["moves_followed"] == 1
        finally:
            waiting.join(timeout=10)
            peer.close()


def test_a_move_to_a_bad_address_fails_the_request_alone(router, nodes) -> None:
    """A decode node's ``moved`` naming something that is not a ZMQ endpoint fails that
    request (502) and nothing else; the router connects nowhere."""
    decode = nodes["decode"]

    def moved(identity: bytes, header: dict[str, Any]) -> None:
        reply = {"ok": True, "op_id": header["op_id"], "type": "moved", "rid": header["rid"]}
        decode._send(identity, {**reply, "peer": "http://elsewhere"})

    decode.on_op["generate"] = moved
    with GenerateClient(router.address, timeout_s=30, resubmits=0) as owner:
        with pytest.raises(GenerateError) as failed:
            owner.generate(PROMPT, sampling=SAMPLING, rid="b")
        assert failed.value.status_code == 502 and "bad address" in str(failed.value)
        assert owner.info()["router"]["moves_followed"] == 0
