"""memsvc's PD transfer ops: ``pd_expect``, ``pd_send``, ``pd_status`` and ``pd_forget``.

A mixin of :class:`~memsvc.handlers.MemService` (it uses the service's
transfer agent and ownership helpers). A room belongs to the session whose
request expected or sent it; ``pd_status`` and ``pd_forget`` refuse a batch
naming another session's room.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from memsvc.core.errors import InvalidArgumentError
from memsvc.sessions import NotOwnerError

if TYPE_CHECKING:
    from memsvc import protocol as p
    from memsvc.sessions import Session
    from memsvc.transfer import TransferAgent

Reply = tuple[dict[str, Any], dict[str, np.ndarray] | None]


class PdHandlers:
    """The PD transfer ops (see the module docstring); ``transfer`` is None without a PD role."""

    transfer: TransferAgent | None

    if TYPE_CHECKING:

        def _own(self, session: Session, rid: str) -> None: ...

    def _agent(self) -> TransferAgent:
        if self.transfer is None:
            raise InvalidArgumentError("this memsvc has no PD role (start it with --pd-role)")
        return self.transfer

    def _pd_expect(self, session: Session, msg: p.PdExpect) -> Reply:
        self._own(session, msg.rid)
        agent = self._agent()
        agent.expect(msg.rid, msg.room)
        agent.room(msg.room).owner = session.num
        return {}, None

    def _pd_send(self, session: Session, msg: p.PdSend) -> Reply:
        self._own(session, msg.rid)
        agent = self._agent()
        agent.send(
            msg.rid,
            msg.room,
            msg.num_tokens,
            msg.first_token,
            msg.cached_tokens,
            msg.peer_rid,
            peer=msg.peer,
            from_host=msg.from_host,
        )
        agent.room(msg.room).owner = session.num
        return {}, None

    def _pd_status(self, session: Session, msg: p.PdStatus) -> Reply:
        agent = self._agent()
        rooms = msg.rooms.tolist()
        self._own_rooms(session, agent, rooms)
        return {"rooms": [agent.report(r) for r in rooms]}, None

    def _pd_forget(self, session: Session, msg: p.PdForget) -> Reply:
        agent = self._agent()
        rooms = msg.rooms.tolist()
        self._own_rooms(session, agent, rooms)
        agent.forget(rooms)
        return {}, None

    @staticmethod
    def _own_rooms(session: Session, agent: TransferAgent, rooms: list[int]) -> None:
        found = [agent.room(r) for r in rooms]
        if any(room is not None and room.owner != session.num for room in found):
            raise NotOwnerError("a room belongs to another session's request")
