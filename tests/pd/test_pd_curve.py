"""A PD stack with CURVE on every socket (``Launcher(curve=...)``), end to end.

The router, both schedulers, both workers, both memsvc and memsvc-D's
transfer listener serve with the stack's keys; a generate through the router
with the client keys gets its tokens (its KV crossed the authenticated
transfer socket), and every one of those sockets refuses a peer without keys
and one with a key it does not accept.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import zmq.auth

from kvstack.stack.launch import Launcher
from kvstack.up.health import check
from memsvc.client import MemClient
from memsvc.curve import CurveClientKeys, KeyFolder
from scheduler_svc.client import GenerateClient
from tests.pd.test_transfer_auth import TransferPeer
from tests.procs import at_once

POOL = ["--page-size", "4", "--num-pages", "256", "--max-context-len", "1024"]
KINDS = {"memsvc": "memsvc", "model_svc": "model_svc", "scheduler": "scheduler_svc"}


def transfer_reply(address: str, curve: CurveClientKeys | None) -> dict | None:
    """A query to memsvc-D's transfer listener with ``curve``'s keys; its reply within 1 s."""
    peer = TransferPeer(address, curve)
    try:
        peer.send({"t": "query", "room": 1, "rid": "anything"})
        return peer.reply(1.0)
    finally:
        peer.close()


@pytest.fixture
def keys(tmp_path: Path) -> KeyFolder:
    return KeyFolder.ensure(tmp_path / "keys")


@pytest.fixture
def curve_launcher(tmp_path: Path, keys: KeyFolder) -> Iterator[Launcher]:
    with Launcher(tmp_path, curve=keys) as started:
        yield started
    assert not started.leaked_segments, f"services left shm segments: {started.leaked_segments}"


def test_pd_stack_with_curve_serves_and_refuses_strangers(
    curve_launcher: Launcher, keys: KeyFolder, checkpoint, tmp_path: Path
) -> None:
    up = curve_launcher.start_pd_stack(
        checkpoint, POOL, ["--num-reserved-decode-tokens", "8"], transfer_backend="zmq"
    )
    client = keys.client_keys()
    with GenerateClient(up["router"].address, timeout_s=60, curve=client) as generate:
        result = generate.generate(
            list(range(3, 30)), sampling={"max_new_tokens": 12, "ignore_eos": True}
        )
    assert len(result.output_ids) == 12
    with MemClient(up["memsvc-d"].address, curve=client) as mem:
        assert mem.stats()["transfer"]["success"] >= 1  # the prompt's KV came over CURVE

    _, stranger_secret = zmq.auth.create_certificates(tmp_path, "stranger")
    stranger = CurveClientKeys.from_files(keys.server_public, stranger_secret)
    kinds = {name: "router" if name == "router" else KINDS[name.rsplit("-", 1)[0]] for name in up}
    # Each refusal waits out its 1 s timeout: the 16 probes go together (at_once).
    transfer = f"ipc://{tmp_path}/transfer.sock"
    strangers = [(name, curve) for name in up for curve in (None, stranger)]
    refused = at_once(
        [partial(check, kinds[name], up[name].address, 1.0, curve) for name, curve in strangers]
        + [partial(transfer_reply, transfer, curve) for curve in (None, stranger)]
    )
    checks, replies = refused[: len(strangers)], refused[len(strangers) :]
    for (name, _), (healthy, detail) in zip(strangers, checks, strict=True):
        assert not healthy, f"{name} answered a client without the stack's keys: {detail}"
    assert replies == [None, None]  # not even "not_ready": nothing got through
    for name, service in up.items():
        assert check(kinds[name], service.address, 10.0, client)[0], name

    peer = TransferPeer(transfer, client)
    try:
        peer.send({"t": "query", "room": 1, "rid": "anything"})
        assert peer.reply()["t"] == "not_ready"  # the stack's key is heard
    finally:
        peer.close()
