"""memsvc as a real process: clients in this and in child processes, faults, security."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import numpy as np
import pytest
import zmq

from memsvc import protocol as p
from memsvc.client import (
    AsyncMemClient,
    CurveClientKeys,
    EpochChangedError,
    MemClient,
    PeerDeadError,
    RetractTarget,
)
from memsvc.core.backends.shm import list_segments
from memsvc.core.errors import UnknownRequestError
from memsvc.sessions import NotOwnerError
from tests.bounds import assert_messages_bounded
from tests.procs import REPO, start_memsvc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )


def test_ops_from_this_process_and_zero_copy_from_a_worker(memsvc) -> None:
    with MemClient(memsvc.address) as mem:
        assert mem.epoch == memsvc.epoch and mem.layout.page_size == 4
        row = mem.alloc_row("r1")
        assert mem.match_prefix("r1", [5, 6, 7]) == 0
        extend = mem.alloc_extend([("r1", 6)])
        assert extend.fits and extend.slots.size == 6
        assert mem.sizes.available == 256 - 8
        step = mem.decode_step([row])
        assert step.fits and step.slots.tolist() == [int(extend.slots[-1]) + 1]
        # a worker process attaches the pool by the hello handle and writes KV in place
        worker = run_child(
            """
            import sys
            from memsvc.client import MemClient
            with MemClient(sys.argv[1], role="worker") as mem, mem.attach() as pool:
                kv = pool.kv_torch()
                table = pool.req_to_token_torch()
                for pos in range(7):
                    slot = int(table[int(sys.argv[2]), pos])
                    kv[slot // 4, :, :, slot % 4] = pos + 0.5
                print("wrote")
            """,
            memsvc.address,
            str(row),
        )
        assert worker.returncode == 0 and "wrote" in worker.stdout, worker.stderr
        with mem.attach() as pool:
            slots = pool.req_to_token[row, :7]
            values = pool.kv[slots // 4, 0, 0, slots % 4, 0, 0]
            assert values.tolist() == [pos + 0.5 for pos in range(7)]
        assert mem.cache_unfinished("r1", [5, 6, 7, 8, 9, 10, 11]) == 4
        assert mem.offload("r1") > 0
        mem.free_row("r1")
        mem.alloc_row("r1")
        assert mem.load("r1").slots.size == 7
        mem.release("r1", [5, 6, 7, 8, 9, 10, 11], is_insert=True)
        with pytest.raises(UnknownRequestError):
            mem.free_row("r1")
        with pytest.raises(UnknownRequestError):
            mem.decode_step([row])
        mem.check(idle=True)
        stats = mem.stats()
        assert stats["counters"]["op.alloc_row.ok"] == 2 and stats["sessions"] == 1
        assert stats["counters"]["op.goodbye.ok"] == 1  # the worker said goodbye


def test_sigkilled_client_lease_expires_and_its_pages_come_back(memsvc) -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
            import sys, time
            from memsvc.client import MemClient
            mem = MemClient(sys.argv[1], lease_s=1.0, heartbeat=True)
            for i in range(3):
                mem.alloc_row(f"c{i}")
                mem.alloc_extend([(f"c{i}", 20)])
            mem.cache_unfinished("c0", list(range(20)))
            mem.offload("c1")
            print("holding", flush=True)
            time.sleep(60)
            """
            ),
            memsvc.address,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert child.stdout.readline().strip() == "holding"
        with MemClient(memsvc.address) as mem:
            held = mem.stats()
            assert held["open_requests"] == 3 and held["host_store_entries"] == 1
            time.sleep(1.5)  # heartbeats keep the lease alive while the child lives
            assert mem.stats()["open_requests"] == 3
            child.send_signal(signal.SIGKILL)
            child.wait()
            deadline = time.monotonic() + 10
            while mem.stats()["open_requests"] and time.monotonic() < deadline:
                time.sleep(0.1)
            stats = mem.stats()
            assert stats["open_requests"] == 0 and stats["host_store_entries"] == 0
            assert stats["counters"]["sessions_expired"] == 1
            mem.check(idle=True)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_restart_gives_a_new_epoch_and_clients_learn_it(tmp_path) -> None:
    first = start_memsvc(tmp_path)
    try:
        mem = MemClient(first.address, timeout_s=1.0, retries=1, heartbeat=False)
        mem.alloc_row("r")
        assert first.stop() == 0
        with pytest.raises(PeerDeadError):
            mem.stats()  # nobody there: an error, not a hang
        second = start_memsvc(tmp_path)
        try:
            assert second.epoch != first.epoch
            with pytest.raises(EpochChangedError) as info:
                mem.alloc_extend([("r", 4)])
            assert info.value.new_epoch == second.epoch
            mem.reconnect()
            assert mem.epoch == second.epoch
            assert mem.stats()["open_requests"] == 0  # the new pool is empty
            mem.check(idle=True)
            mem.close()
        finally:
            assert second.stop() == 0
    finally:
        first.stop()


def test_duplicate_messages_are_applied_once(memsvc) -> None:
    with MemClient(memsvc.address) as mem:
        mem.alloc_row("r")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(memsvc.address)
        try:
            frames = p.pack(
                {"op": "alloc_extend", "op_id": 10_000, "session": mem.session, "rids": ["r"]},
                {"num_tokens": np.array([4])},
            )
            for _ in range(3):
                sock.send_multipart(frames)
            replies = [p.unpack(sock.recv_multipart()) for _ in range(3)]
        finally:
            sock.close(0)
            ctx.term()
        assert all(r["ok"] for r in replies)
        assert len({tuple(r["slots"].tolist()) for r in replies}) == 1
        assert mem.stats()["held"] == 4
        mem.free_row("r")
        mem.check(idle=True)


def test_sessions_cannot_touch_each_others_requests(memsvc) -> None:
    with MemClient(memsvc.address) as alice, MemClient(memsvc.address) as bob:
        alice.alloc_row("a")
        with pytest.raises(NotOwnerError):
            bob.alloc_row("a")
        with pytest.raises(NotOwnerError):
            bob.free_row("a")
        alice.free_row("a")
        bob.alloc_row("a")  # free again: anyone may open it
        bob.free_row("a")
        alice.check(idle=True)


def test_async_client_with_heartbeats_outlives_its_lease(memsvc) -> None:
    async def scenario() -> None:
        async with await AsyncMemClient.connect(memsvc.address, lease_s=0.6) as mem:
            row = await mem.alloc_row("a")
            assert (await mem.alloc_extend([("a", 4)])).fits
            await asyncio.sleep(1.5)  # > lease: heartbeats keep the session
            step = await mem.decode_step([row])
            assert step.fits
            reply = await mem.retract([row], [RetractTarget.HOST_ENTRY])
            assert reply.retracted == [] and not reply.last_does_not_fit
            await mem.free_row("a")
            await mem.check(idle=True)

    asyncio.run(scenario())


def test_oversized_messages(memsvc_factory) -> None:
    svc = memsvc_factory("--max-message-bytes", "4096")
    with MemClient(svc.address, timeout_s=1.0, retries=0) as mem:
        mem.alloc_row("r")
        with pytest.raises(Exception, match="exceeds the limit") as info:
            mem.match_prefix("r", np.arange(1000))
        assert info.value.code == "too_large"
        # far past the hard limit ZMQ drops the sender; the service keeps serving others
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(svc.address)
        sock.send_multipart([b"\x00" * 100_000])
        sock.close(0)
        ctx.term()
        assert mem.stats()["open_requests"] == 1
        mem.free_row("r")
        mem.check(idle=True)


def test_a_message_is_bounded_in_frames_and_bytes_not_only_per_frame(memsvc_factory) -> None:
    """Issue 18, defect 5: memsvc limited each frame, not each message."""
    svc = memsvc_factory("--max-message-bytes", "4096")
    assert_messages_bounded(svc.address, {"op": "heartbeat"}, over_bytes=[2000] * 40)
    with MemClient(svc.address, timeout_s=2.0) as mem:
        mem.check(idle=True)


def test_sigterm_exits_zero_and_removes_shm_and_socket(tmp_path) -> None:
    svc = start_memsvc(tmp_path)
    mine = [n for n in list_segments() if n.startswith(f"kvstack-{svc.proc.pid}-")]
    assert len(mine) == 2
    with MemClient(svc.address) as mem:
        mem.alloc_row("r")
        mem.alloc_extend([("r", 8)])
        assert svc.stop(signal.SIGTERM) == 0
    assert svc.leaked_segments == []  # memsvc unlinked them itself, not the launcher
    assert not [n for n in list_segments() if n.startswith(f"kvstack-{svc.proc.pid}-")]
    assert not (tmp_path / "memsvc.sock").exists()
    assert "memsvc stopped" in svc.log()


def test_repeated_sigterms_still_remove_shm(tmp_path) -> None:
    """A parent-death signal may come several times (the child passes to each exiting
    thread of its parent in turn), perhaps after the launcher's own SIGTERM: one arriving
    while memsvc stops must not kill it before it has unlinked its shared memory."""
    svc = start_memsvc(tmp_path)
    assert len([n for n in list_segments() if n.startswith(f"kvstack-{svc.proc.pid}-")]) == 2
    deadline = time.monotonic() + 30
    while svc.proc.poll() is None and time.monotonic() < deadline:
        os.kill(svc.proc.pid, signal.SIGTERM)
        time.sleep(0.001)
    code = svc.stop()  # may be -SIGTERM: one that came after the cleanup
    assert svc.leaked_segments == [], f"exit code {code}:\n{svc.log()}"


LAYOUT = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8"]


def test_the_layout_is_required(tmp_path) -> None:
    """memsvc knows no model: no default geometry (the tiny model's used to be one)."""
    out = subprocess.run(
        [sys.executable, "-m", "memsvc", "--num-layers", "1", "--head-dim", "8"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert out.returncode == 2
    assert "the following arguments are required: --num-kv-heads" in out.stderr


def test_refuses_non_loopback_unless_asked(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "memsvc", *LAYOUT, "--listen", f"tcp://0.0.0.0:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert out.returncode == 2 and "non-loopback" in out.stderr


def test_metrics_endpoint(memsvc_factory) -> None:
    svc = memsvc_factory("--metrics-port", "0")
    with MemClient(svc.address) as mem:
        mem.alloc_row("r")
        mem.alloc_extend([("r", 8)])
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=10)
            .read()
            .decode()
        )
        assert 'memsvc_tokens{state="held"} 8.0' in text
        assert 'memsvc_ops_total{op="alloc_extend",result="ok"} 1.0' in text
        assert "memsvc_op_seconds_bucket" in text and "memsvc_host_store_bytes" in text
        mem.free_row("r")
        mem.check(idle=True)


@pytest.fixture
def curve_keys(tmp_path):
    import zmq.auth

    server_dir, clients_dir, strangers = (tmp_path / d for d in ("server", "clients", "others"))
    for folder in (server_dir, clients_dir, strangers):
        folder.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(server_dir, "server")
    _client_public, client_secret = zmq.auth.create_certificates(clients_dir, "client")
    _, stranger_secret = zmq.auth.create_certificates(strangers, "stranger")
    return {
        "server_secret": server_secret,
        "server_public": server_public,
        "clients_dir": clients_dir,
        "client_secret": client_secret,
        "stranger_secret": stranger_secret,
    }


def test_curve_authenticates_clients(memsvc_factory, curve_keys) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    svc = memsvc_factory(
        "--curve-secret-key",
        str(curve_keys["server_secret"]),
        "--curve-clients",
        str(curve_keys["clients_dir"]),
        address=address,
    )
    keys = CurveClientKeys.from_files(
        str(curve_keys["server_public"]), str(curve_keys["client_secret"])
    )
    with MemClient(svc.address, curve=keys) as mem:
        mem.alloc_row("r")
        mem.free_row("r")
        mem.check(idle=True)
    stranger = CurveClientKeys.from_files(
        str(curve_keys["server_public"]), str(curve_keys["stranger_secret"])
    )
    for curve in (stranger, None):  # unknown key, or no encryption at all: nothing comes back
        with pytest.raises(PeerDeadError):
            MemClient(svc.address, curve=curve, timeout_s=0.5, retries=0, heartbeat=False)


def test_plain_tcp_on_loopback(memsvc_factory) -> None:
    svc = memsvc_factory(address=f"tcp://127.0.0.1:{free_port()}")
    with MemClient(svc.address) as mem:
        assert mem.stats()["capacity"] == 256
        mem.check(idle=True)
