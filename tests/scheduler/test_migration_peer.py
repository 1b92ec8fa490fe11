"""MigrationPeer's decisions (scheduler_svc.pd.migrate), against a stand-in peer.

When a peer may take a moved request (its budget, its queues, its transfer
socket; each move spends from the budget it reported), that its figures are
asked in the background (a step never waits on the peer), that a peer which
does not answer is left alone for a while, and what counts as the peer
refusing a move before it was committed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from scheduler_svc.pd import migrate
from scheduler_svc.pd.migrate import MigrationPeer, Relay


class StubClient:
    """The peer's scheduler: ``info`` answers (or raises) as told, counting the calls."""

    def __init__(self, info: dict[str, Any] | None) -> None:
        self.reply, self.calls = info, 0

    async def info(self) -> dict[str, Any]:
        self.calls += 1
        if self.reply is None:
            raise TimeoutError("no answer")
        return dict(self.reply)

    def close_call(self, op_id: int) -> None:
        pass

    async def close(self) -> None:
        pass


def peer_with(info: dict[str, Any] | None) -> MigrationPeer:
    peer = MigrationPeer.__new__(MigrationPeer)  # no socket: the stand-in answers
    peer.address, peer.relays = "ipc://peer", {}
    peer._info, peer._info_at, peer._budget = None, 0.0, 0
    peer._next_ask, peer._asking = 0.0, None
    peer.client = StubClient(info)
    return peer


async def with_figures(peer: MigrationPeer) -> None:
    """The first room_for only starts the ask (it returns None: no figures yet); let it end."""
    assert await peer.room_for(1) is None
    ask = peer.refresh()
    if ask is not None:
        await ask


INFO = {
    "mode": "decode",
    "transfer_listen": "ipc://xfer",
    "prealloc_budget": 100,
    "queues": {"prealloc": 0, "retracted": 0},
}


def test_a_move_spends_the_budget_the_peer_reported() -> None:
    peer = peer_with(INFO)

    async def go() -> list[str | None]:
        await with_figures(peer)
        return [await peer.room_for(n) for n in (60, 50, 40)]

    assert asyncio.run(go()) == ["ipc://xfer", None, "ipc://xfer"]  # 60, then 40 of 100
    assert peer.client.calls == 1  # asked once within INFO_EVERY_S


@pytest.mark.parametrize(
    "change",
    [
        {"mode": "normal"},
        {"transfer_listen": None},
        {"draining": True},
        {"queues": {"prealloc": 1, "retracted": 0}},
        {"queues": {"prealloc": 0, "retracted": 2}},
        {"prealloc_budget": 10},
    ],
)
def test_a_peer_that_cannot_take_it_now_gets_nothing(change: dict[str, Any]) -> None:
    peer = peer_with({**INFO, **change})

    async def go() -> str | None:
        await with_figures(peer)
        return await peer.room_for(20)

    assert asyncio.run(go()) is None
    assert peer._info is not None  # it was told, and said no


def test_a_silent_peer_is_left_alone_for_a_while(monkeypatch) -> None:
    monkeypatch.setattr(migrate, "INFO_EVERY_S", 0.0)
    peer = peer_with(None)

    async def go() -> list[str | None]:
        out = []
        for _ in range(5):
            out.append(await peer.room_for(1))
            await asyncio.sleep(0.01)  # the ask fails meanwhile
        return out

    assert asyncio.run(go()) == [None] * 5
    assert peer.client.calls == 1  # not asked again before PEER_DOWN_WAIT_S


class SlowClient(StubClient):
    """A peer whose info takes ``delay_s`` to answer."""

    def __init__(self, info: dict[str, Any], delay_s: float) -> None:
        super().__init__(info)
        self.delay_s = delay_s

    async def info(self) -> dict[str, Any]:
        await asyncio.sleep(self.delay_s)
        return await super().info()


def test_a_slow_peer_never_holds_up_the_step() -> None:
    """room_for returns at once while the peer takes its time; the figures, once they
    came, are acted on, and stale ones are not."""
    peer = peer_with(INFO)
    peer.client = SlowClient(INFO, 0.3)

    async def go() -> tuple[list[str | None], float, str | None, str | None]:
        started = time.monotonic()
        early = [await peer.room_for(1) for _ in range(3)]
        waited = time.monotonic() - started
        await asyncio.sleep(0.5)  # the answer is in
        fresh = await peer.room_for(1)
        peer._info_at -= migrate.INFO_STALE_S + 1  # as if no answer came since
        stale = await peer.room_for(1)
        await peer.close()
        return early, waited, fresh, stale

    early, waited, fresh, stale = asyncio.run(go())
    assert early == [None] * 3 and waited < 0.1, waited
    assert fresh == "ipc://xfer" and stale is None


ABORTED = {"type": "abort", "message": "KV did not arrive"}


def test_what_the_peer_said_before_the_commit_decides_a_refusal() -> None:
    peer = peer_with(INFO)
    for rid, replies, want in [
        ("a", [], None),
        ("b", [{"ok": True, "type": "chunk"}], None),
        ("c", [{"ok": False, "code": "duplicate_rid", "message": "already here"}], "already"),
        ("d", [None], "dropped"),
        ("e", [{"ok": True, "type": "done", "meta_info": {"finish_reason": ABORTED}}], "arrive"),
    ]:
        queue: asyncio.Queue = asyncio.Queue()
        for reply in replies:
            queue.put_nowait(reply)
        peer.relays[rid] = Relay(rid, 1, queue, [7])
        why = peer.refused(rid)
        assert (why is None) if want is None else (want in why), (rid, why)
        assert peer.relays[rid].held == replies  # kept for the relay, in order
