"""What a PD stack over NIXL listens on: loopback only, UCX included (issue 26, item 11).

Every TCP socket a process of the stack listens on is read from the kernel's
tables (``/proc/PID/net/tcp*``, matched to the process by the socket inodes
among its ``/proc/PID/fd``), so a listener no flag names (UCX's) is counted too.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

import pytest

from memsvc.movers import UCX_DEVICES_ENV, NixlMover
from scheduler_svc.client import GenerateClient

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/net/tcp").exists(), reason="needs Linux's /proc/PID/net/tcp"
)
POOL = ["--page-size", "4", "--num-pages", "256", "--max-context-len", "256", "--metrics-port", "0"]
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            link = os.readlink(f"{fd_dir}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    return inodes


def kernel_address(hex_address: str) -> str:
    """``/proc/net/tcp*``'s ``0100007F`` (IPv4) or 32 hex digits (IPv6) as text.

    The kernel prints each 32-bit word of the address in host byte order.
    """
    raw = bytes.fromhex(hex_address)
    native = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, native)


def listening_tcp(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on."""
    mine = socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as lines:
            next(lines)  # the header
            for line in lines:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == LISTEN and inode in mine:
                    address, port = local.rsplit(":", 1)
                    found.append((kernel_address(address), int(port, 16)))
    return found


def test_listening_tcp_sees_a_plain_socket() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert ("127.0.0.1", sock.getsockname()[1]) in listening_tcp(os.getpid())
    assert kernel_address("0100007F") == "127.0.0.1"
    assert kernel_address("00000000000000000000000001000000") == "::1"


@pytest.mark.slow
def test_a_pd_stack_over_nixl_listens_on_loopback_only(launcher, checkpoint) -> None:
    pytest.importorskip("nixl_cu12", reason="the nixl transfer backend needs the nixl-cu12 wheel")
    up = launcher.start_pd_stack(checkpoint, POOL, ["--metrics-port", "0"], transfer_backend="nixl")
    with GenerateClient(up["router"].address, timeout_s=120) as client:  # a transfer happens
        out = client.generate([1, 2, 3, 4, 5, 6, 7, 8, 9], sampling={"max_new_tokens": 4})
    assert len(out.output_ids) == 4
    listeners = {name: listening_tcp(service.proc.pid) for name, service in up.items()}
    # UCX listens on each network device it may use: one at least, on loopback.
    assert listeners["memsvc-p"] and listeners["memsvc-d"], listeners
    remote = {
        name: [(host, port) for host, port in found if not ipaddress.ip_address(host).is_loopback]
        for name, found in listeners.items()
    }
    assert remote == {name: [] for name in up}, listeners


def test_ucx_is_confined_to_loopback_unless_allowed(monkeypatch, caplog, make_pool) -> None:
    pytest.importorskip("nixl_cu12", reason="the nixl transfer backend needs the nixl-cu12 wheel")
    monkeypatch.setenv(UCX_DEVICES_ENV, "eth0")  # the user's choice: kept only with --allow-remote
    pool = make_pool()
    NixlMover(pool, "remote-ok", allow_remote=True).close()
    assert os.environ[UCX_DEVICES_ENV] == "eth0"
    NixlMover(pool, "loopback", allow_remote=False).close()
    assert os.environ[UCX_DEVICES_ENV] == "lo"
    assert "UCX_NET_DEVICES=eth0 replaced by lo" in caplog.text
