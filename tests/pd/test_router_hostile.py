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
from typing import Any

import pytest

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
        super().__init__(address, pid)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            identity, *frames = self._sock.recv_multipart()
            header = wire.unpack(frames)
            self.received.append(header)
            op, op_id = header.get("op"), header.get("op_id")
            if op == "info":
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
