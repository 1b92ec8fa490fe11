"""What both PD engines share: polling their transfer rooms, and ending a request locally."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memsvc.transfer import KVPoll
from scheduler_svc.core import Req

if TYPE_CHECKING:
    from scheduler_svc.engine import Engine

TRANSFER_POLL_S = 0.002  # loop wake-up while transfers are in flight


def transfer_failed_message(req: Req, room: int, why: str) -> str:
    return (
        f"Decode transfer failed for request rank=0 req.rid={req.rid} "
        f"bootstrap_room={room} with exception {why}"
    )


async def settled_rooms(mem: Any, rooms: list[int]) -> list[dict[str, Any]]:
    """The reports of ``rooms`` whose transfer ended (Success or Failed); memsvc forgets those."""
    reports = await mem.pd_status(rooms)
    done = [r for r in reports if r["state"] in (KVPoll.SUCCESS, KVPoll.FAILED)]
    if done:
        await mem.pd_forget([r["room"] for r in done])
    return done


def abort_locally(engine: Engine, req: Req, message: str, status_code: int) -> None:
    """memsvc failed while ``req`` was being aborted: it ends all the same.

    The step's recovery (a new session; the old one's KV is reclaimed) then
    reports it like any request that finished in a failed step, instead of
    bringing it back.
    """
    if not req.is_finished:
        req.abort(message, status_code)
        engine.stats.aborted_reqs += 1
