"""memsvc-P -> memsvc-D KV transfer, both backends, between real processes."""

from __future__ import annotations

import os
import signal
import time

import msgpack
import numpy as np
import pytest
import zmq

from memsvc.client import MemClient
from memsvc.core.backends import attach
from memsvc.core.errors import InvalidArgumentError
from memsvc.movers import CHUNK_PAGES, NixlMover, pack_frames
from memsvc.sessions import NotOwnerError
from memsvc.transfer import KVPoll, Room, TransferAgent
from tests.helpers import small_layout

BACKENDS = ["zmq", "nixl"]


def pd_pair(memsvc_factory, tmp_path, backend: str, *extra: str):
    listen = f"ipc://{tmp_path}/transfer.sock"
    common = ["--transfer-backend", backend, "--transfer-timeout", "2", *extra]
    decode = memsvc_factory("--pd-role", "decode", "--transfer-listen", listen, *common, name="d")
    prefill = memsvc_factory("--pd-role", "prefill", "--transfer-peer", listen, *common, name="p")
    return prefill, decode


def wait_state(client: MemClient, room: int, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        (report,) = client.pd_status([room])
        if report["state"] in (KVPoll.SUCCESS, KVPoll.FAILED) or time.monotonic() > deadline:
            return report
        time.sleep(0.01)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_pages_arrive_intact_in_the_decode_pool(memsvc_factory, tmp_path, backend):
    prefill, decode = pd_pair(memsvc_factory, tmp_path, backend)
    num_tokens = 37  # not a whole number of pages: the last page goes whole
    with MemClient(prefill.address) as p, MemClient(decode.address) as d:
        p_kv, d_kv = attach(p.handle), attach(d.handle)
        try:
            d.alloc_row("r")
            d_slots = d.alloc_extend([("r", num_tokens)]).slots
            p.alloc_row("other")  # so P's pages differ from D's
            p.alloc_extend([("other", 9)])
            p.alloc_row("r")
            p_slots = p.alloc_extend([("r", num_tokens)]).slots
            assert not np.array_equal(p_slots, d_slots)
            ps = p.layout.page_size
            rng = np.random.default_rng(0)
            for slot in p_slots:
                p_kv.kv[slot // ps, :, :, slot % ps] = rng.standard_normal(
                    p_kv.kv.shape[2:3] + p_kv.kv.shape[4:]
                )
            p.pd_send("r", 7, num_tokens, first_token=42, cached_tokens=3)
            time.sleep(0.05)  # the decode side does not expect the room yet: P keeps asking
            d.pd_expect("r", 7)
            report = wait_state(d, 7)
            assert report["state"] == KVPoll.SUCCESS, report
            assert (report["first_token"], report["cached_tokens"]) == (42, 3)
            assert wait_state(p, 7)["state"] == KVPoll.SUCCESS
            # A re-sent prefill for a room that already has its KV succeeds at once and
            # leaves the decode side's room as it is (it is not reopened).
            p.pd_forget([7])
            p.pd_send("r", 7, num_tokens, first_token=42, cached_tokens=3)
            assert wait_state(p, 7)["state"] == KVPoll.SUCCESS
            assert d.pd_status([7])[0]["state"] == KVPoll.SUCCESS
            for ps_slot, pd_slot in zip(p_slots, d_slots, strict=True):
                np.testing.assert_array_equal(
                    d_kv.kv[pd_slot // ps, :, :, pd_slot % ps],
                    p_kv.kv[ps_slot // ps, :, :, ps_slot % ps],
                )
            stats = d.stats()["transfer"]
            assert stats["backend"] == backend and stats["success"] == 1
            p.pd_forget([7])
            d.pd_forget([7])
            p.release("r", is_insert=False)
            p.free_row("other")
            d.free_row("r")
            p.check(idle=True)
            d.check(idle=True)
        finally:
            p_kv.close()
            d_kv.close()


def test_mismatched_token_counts_fail_both_sides(memsvc_factory, tmp_path):
    prefill, decode = pd_pair(memsvc_factory, tmp_path, "zmq")
    with MemClient(prefill.address) as p, MemClient(decode.address) as d:
        d.alloc_row("r")
        d.alloc_extend([("r", 12)])
        d.pd_expect("r", 5)
        p.alloc_row("r")
        p.alloc_extend([("r", 16)])
        p.pd_send("r", 5, 16, first_token=1)
        assert "expects 12 tokens" in wait_state(p, 5)["why"]
        report = wait_state(d, 5)
        assert report["state"] == KVPoll.FAILED and "gave up" in report["why"]
        for client in (p, d):
            client.pd_forget([5])
            client.free_row("r")
            client.check(idle=True)


def test_decode_side_fails_rooms_when_the_prefill_memsvc_dies(memsvc_factory, tmp_path):
    prefill, decode = pd_pair(memsvc_factory, tmp_path, "zmq")
    with MemClient(decode.address) as d:
        d.alloc_row("r")
        d.alloc_extend([("r", 8)])
        d.pd_expect("r", 9)
        time.sleep(0.3)
        prefill.stop()  # SIGTERM: it says nothing more
        report = wait_state(d, 9, timeout=20)
        assert report["state"] == KVPoll.FAILED
        assert "prefill node unreachable" in report["why"]
        d.pd_forget([9])
        d.free_row("r")
        d.check(idle=True)


def test_rooms_are_guarded(memsvc_factory, tmp_path):
    prefill, decode = pd_pair(memsvc_factory, tmp_path, "zmq")
    with MemClient(decode.address) as d, MemClient(decode.address) as other:
        d.alloc_row("r")
        d.alloc_extend([("r", 8)])
        d.pd_expect("r", 3)
        with pytest.raises(InvalidArgumentError, match="already in use"):
            d.pd_expect("r", 3)
        with pytest.raises(NotOwnerError):
            other.pd_forget([3])
        with pytest.raises(InvalidArgumentError, match="no decode node to send to"):
            d.pd_send("r", 4, 8, first_token=0)  # a decode node sends only where told
        d.pd_forget([3])
        d.free_row("r")
        d.check(idle=True)
    with MemClient(prefill.address) as p:
        p.alloc_row("x")
        with pytest.raises(InvalidArgumentError):
            p.pd_send("x", 1, 4, first_token=0)  # holds no KV
        p.free_row("x")


def test_a_room_the_decode_side_never_expects_fails_by_its_deadline(memsvc_factory, tmp_path):
    """memsvc-D answers "not_ready" for a room it never expects (its scheduler re-bootstrapped
    the request under another room): the send fails at SGLang's bootstrap deadline, however
    many "not_ready" came back, instead of holding the pages for ever (issue 18)."""
    deadline = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "2"}
    listen = f"ipc://{tmp_path}/transfer.sock"
    common = ["--transfer-backend", "zmq", "--transfer-timeout", "2"]
    memsvc_factory("--pd-role", "decode", "--transfer-listen", listen, *common, name="d")
    prefill = memsvc_factory(
        "--pd-role", "prefill", "--transfer-peer", listen, *common, name="p", env=deadline
    )
    with MemClient(prefill.address) as p:
        p.alloc_row("r")
        p.alloc_extend([("r", 8)])
        started = time.monotonic()
        p.pd_send("r", 21, 8, first_token=1)
        report = wait_state(p, 21, timeout=15)
        assert report["state"] == KVPoll.FAILED, report
        assert "did not expect" in report["why"] and "2" in report["why"], report
        assert time.monotonic() - started < 10
        p.pd_forget([21])
        p.free_row("r")
        p.check(idle=True)


def test_the_transfer_listener_bounds_each_message(tmp_path, make_pool) -> None:
    """Issue 18, defect 5, on the PD transfer socket: a frame larger than a data chunk
    drops its sender unread, and a message with more frames than any has is dropped."""
    pool = make_pool(small_layout(page_size=4, num_pages=16, max_running_requests=4))
    agent = TransferAgent(
        pool, role="decode", backend="zmq", epoch="e", listen=f"ipc://{tmp_path}/t.sock"
    )
    ctx = zmq.Context()
    try:
        listener, _sender = agent.open(ctx)  # the receiver first
        chunk_bytes = CHUNK_PAGES * pool.layout.bytes_per_page
        assert chunk_bytes < listener.getsockopt(zmq.MAXMSGSIZE) < chunk_bytes + (4 << 20)
        peer = ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(agent.listen)
        query = pack_frames({"t": "query", "room": 5, "rid": "r"})
        for frames, answered in [([*query, *[b"x"] * 20], False), (query, True)]:
            peer.send_multipart(frames)
            deadline = time.monotonic() + (5 if answered else 1)
            while time.monotonic() < deadline and not peer.poll(0):
                if listener.poll(20):
                    agent.on_readable(listener)
            assert bool(peer.poll(0)) == answered
        assert msgpack.unpackb(peer.recv_multipart()[0])["t"] == "not_ready"
        peer.close(0)
        pool.check_integrity(idle=True)
    finally:
        agent.close()
        ctx.term()


# -- teardown (issue 26, item 12) ------------------------------------------------------------


def threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def test_closing_the_nixl_mover_releases_nixl_with_a_transfer_in_flight(
    make_pool, monkeypatch
) -> None:
    """memsvc closes its mover before it unmaps the pool and exits: NIXL's agent (its
    progress thread, UCX's async thread) must be gone by then, not left to the
    interpreter's exit, where UCX's teardown ran after its libraries' (SIGSEGV)."""
    pytest.importorskip("nixl_cu12", reason="the nixl transfer backend needs the nixl-cu12 wheel")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # what the movers set, undone after the test
    layout = small_layout(page_size=4, num_pages=16, max_running_requests=4)
    source, dest = make_pool(layout), make_pool(layout)
    before = threads()
    sender, receiver = NixlMover(source, "sender"), NixlMover(dest, "receiver")
    assert threads() - before, "NIXL runs threads of its own"
    pages = np.arange(1, 5)
    room = Room(1, "r", pages, 16, KVPoll.TRANSFERRING, created=time.monotonic())
    sender.start(room, receiver.describe(), pages, peer=None)  # never polled to its end
    sender.close()
    receiver.close()
    assert not threads() - before, "NIXL's threads outlived the movers' close"
    source.check_integrity(idle=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigterm_after_a_transfer_exits_zero_and_unlinks_the_pools(
    memsvc_factory, tmp_path, backend
):
    prefill, decode = pd_pair(memsvc_factory, tmp_path, backend)
    with MemClient(prefill.address) as p, MemClient(decode.address) as d:
        d.alloc_row("r")
        d.alloc_extend([("r", 8)])
        p.alloc_row("r")
        p.alloc_extend([("r", 8)])
        p.pd_send("r", 3, 8, first_token=1)
        d.pd_expect("r", 3)
        assert wait_state(d, 3)["state"] == KVPoll.SUCCESS
    for service in (prefill, decode):
        assert service.stop(signal.SIGTERM) == 0, service.log()[-2000:]
        assert service.leaked_segments == [], service.name
        assert "memsvc stopped" in service.log()


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time so far (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_nixl_pair_leaves_the_cores_alone(memsvc_factory, tmp_path):
    """NIXL's progress thread spins with no pause: with it, each memsvc of a pair took a
    whole core, idle or not. After a transfer (UCX connected both ways) and with a room
    expected but not sent (memsvc-D lets UCX progress each millisecond), both stay far
    below a core."""
    prefill, decode = pd_pair(memsvc_factory, tmp_path, "nixl")
    window_s = 2.0
    with MemClient(prefill.address) as p, MemClient(decode.address) as d:
        for rid in ("sent", "waiting"):
            d.alloc_row(rid)
            d.alloc_extend([(rid, 8)])
        p.alloc_row("sent")
        p.alloc_extend([("sent", 8)])
        p.pd_send("sent", 1, 8, first_token=1, cached_tokens=0)
        d.pd_expect("sent", 1)
        assert wait_state(d, 1)["state"] == KVPoll.SUCCESS
        assert wait_state(p, 1)["state"] == KVPoll.SUCCESS
        for expecting in (False, True):
            if expecting:
                d.pd_expect("waiting", 2)  # the decode side now waits for pages
            before = {s.name: cpu_seconds(s.proc.pid) for s in (prefill, decode)}
            time.sleep(window_s)
            used = {s.name: cpu_seconds(s.proc.pid) - before[s.name] for s in (prefill, decode)}
            # A spinning thread gets a core, or a good share of one on a busy machine.
            assert all(cpu < 0.25 * window_s for cpu in used.values()), (
                f"memsvc CPU seconds in {window_s:g} s idle, decode side expecting a room: "
                f"{expecting}: {used}"
            )
        d.pd_forget([1, 2])  # the room still waiting is dropped
        p.pd_forget([1])
        p.release("sent", is_insert=False)
        d.free_row("sent")
        d.free_row("waiting")
        p.check(idle=True)
        d.check(idle=True)
