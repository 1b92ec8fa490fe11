"""The PD router as health checks and clients see it (issue 18, defects 2 and 4).

- A wedged stack is reported unhealthy. Each scheduler says in its ``info``
  whether it has work and for how long it has made no progress with it; the
  router calls the stack wedged when no node with work has progressed for
  ``--stall-timeout`` seconds, and its ``info`` then answers with an error,
  which is what ``kvstack status`` (and ``GET /health``) check.
- A request the router refuses is refused under its own op_id, so the client
  raises the error at once.

The router is a real process; its two nodes are stand-ins that report
whatever the test says.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvstack.stack.process import Service
from kvstack.up.health import check
from memsvc import protocol as wire
from scheduler_svc.client import GenerateClient, GenerateError, SchedulerLostError
from scheduler_svc.stall import StallWatch, wedged

STALL_TIMEOUT_S = 5.0


def test_stall_watch_counts_only_steps_that_did_nothing_with_work_waiting() -> None:
    watch = StallWatch()
    assert watch.report(0.0) == {"busy": False, "stalled_s": 0.0}
    watch.step_begins(1.0)
    watch.step_ends(1.0, progressed=False, busy=True)
    watch.step_begins(3.0)
    watch.step_ends(3.0, progressed=False, busy=True)
    assert watch.stalled_s(11.0) == 10.0
    watch.step_begins(11.0)  # a long step (a forward pass) is running: the clock stops
    assert watch.stalled_s(60.0) == 10.0
    watch.step_ends(61.0, progressed=True, busy=True)
    assert watch.stalled_s(70.0) == 0.0
    watch.step_ends(71.0, progressed=False, busy=False)  # idle is not stalled
    assert watch.report(99.0) == {"busy": False, "stalled_s": 0.0}


def test_wedged_needs_every_node_with_work_stalled() -> None:
    stalled, moving = {"busy": True, "stalled_s": 9.0}, {"busy": True, "stalled_s": 0.0}
    idle = {"busy": False, "stalled_s": 0.0}
    assert wedged({"decode": stalled, "prefill": moving}, 5.0) is None
    assert wedged({"decode": idle, "prefill": idle}, 5.0) is None
    assert wedged({"decode": {"busy": True, "stalled_s": 4.0}, "prefill": None}, 5.0) is None
    why = wedged({"decode": idle, "prefill": stalled}, 5.0)
    assert why is not None and "prefill node for 9s" in why
    assert "decode" in (wedged({"decode": stalled, "prefill": stalled}, 5.0) or "")


class FakeNode:
    """A scheduler stand-in: answers ``info`` with :attr:`progress`, ignores the rest."""

    def __init__(self, address: str, pid: int) -> None:
        self.address, self.pid = address, pid
        self.progress: dict[str, Any] = {"busy": False, "stalled_s": 0.0}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"fake-{pid}")
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            identity, *frames = self._sock.recv_multipart()
            header = wire.unpack(frames)
            if header.get("op") != "info":
                continue
            info = {"ok": True, "op_id": header["op_id"], "pid": self.pid, "num_running": 0}
            reply = {**info, "num_waiting": 1, "progress": dict(self.progress)}
            self._sock.send_multipart([identity, *wire.pack(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(0)
        self._ctx.term()


@contextlib.contextmanager
def open_nodes(tmp_path, node_class: type[FakeNode] = FakeNode) -> Iterator[dict[str, Any]]:
    """A stand-in prefill node and decode node (pids 1 and 2), closed on the way out."""
    made: dict[str, FakeNode] = {}
    try:
        for pid, name in enumerate(("prefill", "decode"), start=1):
            made[name] = node_class(f"ipc://{tmp_path}/{name}.sock", pid)
        yield made
    finally:
        for node in made.values():
            with contextlib.suppress(Exception):
                node.close()


def start_router(launcher, nodes: dict[str, FakeNode], *args: str) -> Service:
    """A real router in front of the stand-in ``nodes``."""
    return launcher.start(
        "scheduler_svc.pd.router",
        "--prefill",
        nodes["prefill"].address,
        "--decode",
        nodes["decode"].address,
        *args,
    )


@pytest.fixture
def nodes(tmp_path) -> Iterator[dict[str, FakeNode]]:
    with open_nodes(tmp_path) as made:
        yield made


@pytest.fixture
def router(launcher, nodes) -> Service:
    return start_router(launcher, nodes, "--stall-timeout", str(STALL_TIMEOUT_S))


def test_status_reports_a_wedged_stack_unhealthy(router, nodes) -> None:
    healthy, detail = check("router", router.address, 5.0)
    assert healthy, detail
    # The prefill node's queue waits behind something that never moves; the decode node
    # waits for that prefill: neither has progressed for longer than the timeout.
    nodes["prefill"].progress = {"busy": True, "stalled_s": 40.0}
    nodes["decode"].progress = {"busy": True, "stalled_s": 38.0}
    healthy, detail = check("router", router.address, 5.0)
    assert not healthy and "wedged" in detail, detail
    assert "prefill node for 40s" in detail and "decode node for 38s" in detail
    # The decode node decodes again: waiting on the prefill node is no wedge then.
    nodes["decode"].progress = {"busy": True, "stalled_s": 0.0}
    healthy, detail = check("router", router.address, 5.0)
    assert healthy, detail


def test_a_refused_request_comes_back_under_its_op_id(router) -> None:
    with GenerateClient(router.address, timeout_s=3, resubmits=1) as client:
        started = time.monotonic()
        with pytest.raises(GenerateError) as refused:
            client.generate(input_ids=[])
        assert time.monotonic() - started < 2.5
        assert not isinstance(refused.value, SchedulerLostError)
        assert refused.value.status_code == 400 and "1 or more tokens" in str(refused.value)
