"""A moved request's client follows it to the node it moved to (issue 32, part 2).

Both ends of a move, through the service's own intake, with stand-in engines:
the node a request moved from tells a client that follows moves (the PD router)
where it went, keeps nothing of it but that answer, and tells the same client
again if it re-submits there; the node it moved to lets only the request's own
client (with the same body) take over its replies, and no one else.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from memsvc import protocol as wire
from model_svc.tokenizer import ByteTokenizer
from scheduler_svc import protocol as p
from scheduler_svc.core import Req
from scheduler_svc.intake import fingerprint
from scheduler_svc.replies import Waiter
from scheduler_svc.service import SchedulerService

PROMPT = [5, 6, 7, 8]
SAMPLING = {"max_new_tokens": 16}
PEER = "ipc:///nonexistent/kvstack-peer.sock"


class StandInPeer:
    """The migration peer as the service sees it: its address and what it let go."""

    def __init__(self) -> None:
        self.address, self.relays, self.let_go = PEER, {}, []
        self.owner_of = None

    def finished(self, rid: str) -> None:
        self.let_go.append(rid)


def decode_service(*, draining: bool = False) -> SchedulerService:
    engine = SimpleNamespace(
        reqs={},
        draining=draining,
        migration=StandInPeer(),
        stats=SimpleNamespace(migrated_handed_off_reqs=0),
        accepted=[],
    )
    engine.accept_migrated = engine.accepted.append
    return SchedulerService(
        engine,
        "ipc:///nonexistent/kvstack-moved.sock",
        tokenizer=ByteTokenizer(),
        capacity=4096,
        page_size=4,
        max_context_len=4096,
        vocab_size=256,
        mode="decode",
    )


def generate(client: str, *, follow: bool = True, prompt=PROMPT, op_id: int = 1) -> Any:
    header = {
        "op": "generate",
        "op_id": op_id,
        "rid": "r",
        "client": client,
        "sampling": SAMPLING,
        "bootstrap_room": 11,
        "follow_moves": follow,
    }
    return p.parse_request(wire.pack(header, {"input_ids": np.asarray(prompt)}))


def replies(service: SchedulerService) -> list[tuple[bytes, dict[str, Any]]]:
    out = []
    while not service._outbox.empty():
        identity, *frames = service._outbox.get_nowait()
        out.append((identity, wire.unpack(frames)))
    return out


def answer(frames: list[bytes] | None) -> dict[str, Any] | None:
    return None if frames is None else wire.unpack(frames)


def test_a_client_that_follows_moves_is_told_where_its_request_went() -> None:
    """Before, the node relayed every moved request's replies, so it held a relay (and
    could not stop draining) until the request ended on the peer."""
    service = decode_service(draining=True)
    mine = generate("owner")
    waiter = Waiter(b"router", 1, True, time.monotonic(), 3, fingerprint(PROMPT, mine), "owner")
    waiter.follow_moves = True
    service._waiters["r"] = waiter
    asyncio.run(_moved(service, Req("r", PROMPT)))
    ((identity, told),) = replies(service)
    assert identity == b"router" and told["type"] == "moved" and told["peer"] == PEER, told
    assert told["ok"] and told["op_id"] == 1
    assert "r" not in service._waiters and not service._relays  # nothing kept but the answer
    assert service.engine.migration.let_go == ["r"]
    assert service.engine.stats.migrated_handed_off_reqs == 1
    # The same client re-submitting it here is told again; not following, it gets why.
    again = answer(service._generate(b"router2", generate("owner", op_id=7)))
    assert again["type"] == "moved" and again["peer"] == PEER and again["op_id"] == 7
    refused = answer(service._generate(b"router2", generate("owner", follow=False)))
    assert refused["code"] == "moved" and refused["status_code"] == 409, refused
    # Another client, or another body, is not told anything about it.
    other = answer(service._generate(b"x", generate("someone-else")))
    assert other["code"] == "unavailable", other  # a new request: refused while draining
    other = answer(service._generate(b"x", generate("owner", prompt=[9, 9])))
    assert other["code"] == "unavailable", other


async def _moved(service: SchedulerService, req: Req) -> None:
    service._relay(req)


def test_a_client_that_does_not_follow_moves_is_relayed() -> None:
    service = decode_service()
    service._waiters["r"] = Waiter(b"client", 1, True, time.monotonic(), 0, "print", "owner")

    async def moved() -> None:
        service._relay(Req("r", PROMPT))
        await asyncio.gather(*service._relays)

    asyncio.run(moved())  # no relay in the stand-in peer: the task ends at once
    assert (
        service.engine.migration.let_go == [] and service.engine.stats.migrated_handed_off_reqs == 0
    )
    assert replies(service) == []


def migrate_in(owner: str | None, digest: str | None) -> Any:
    header = {
        "op": "migrate_in",
        "op_id": 3,
        "rid": "r",
        "client": "node-d1",
        "sampling": SAMPLING,
        "room": 21,
    }
    if owner is not None:
        header.update(owner=owner, fingerprint=digest)
    arrays = {"input_ids": np.asarray(PROMPT), "output_ids": np.asarray([1, 2, 3])}
    return p.parse_request(wire.pack(header, arrays))


def test_only_the_requests_own_client_takes_over_a_moved_request() -> None:
    """On the node it moved to, the router's re-submission (the owner's client id and
    body, carried by ``migrate_in``) takes over its replies; another client's, or
    another body, is refused and changes nothing."""
    service = decode_service()
    digest = fingerprint(PROMPT, generate("owner"))
    assert service._migrate_in(b"d1", migrate_in("owner", digest)) is None
    assert [req.rid for req in service.engine.accepted] == ["r"]
    for intruder in (generate("someone-else"), generate("owner", prompt=[9, 9])):
        refused = answer(service._generate(b"x", intruder))
        assert refused["code"] == "duplicate_rid", refused
        assert service._waiters["r"].identity == b"d1"
    abort = p.parse_request(wire.pack({"op": "abort", "op_id": 4, "rid": "r", "client": "node-d1"}))
    assert answer(service._accept(b"d1", abort))["code"] == "not_owner"  # the owner's, now
    assert service._generate(b"router", generate("owner", op_id=9)) is None
    waiter = service._waiters["r"]
    assert (waiter.identity, waiter.op_id, waiter.sent) == (b"router", 9, 0)
    assert waiter.follow_moves


def test_a_move_from_a_node_that_names_no_owner_stays_the_senders() -> None:
    """A ``migrate_in`` without ``owner`` (a relaying sender): only the sender's client
    id may act on the request, and no re-submission attaches to it."""
    service = decode_service()
    assert service._migrate_in(b"d1", migrate_in(None, None)) is None
    refused = answer(service._generate(b"router", generate("owner")))
    assert refused["code"] == "duplicate_rid", refused
    assert service._waiters["r"].client == "node-d1"
