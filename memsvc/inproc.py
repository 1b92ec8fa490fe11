"""memsvc in process: the real client and service code, no socket in between.

:class:`InProcessMem` is a memsvc client (the same op definitions and reply
checking as :class:`~memsvc.client.AsyncMemClient`) wired straight to a
:class:`~memsvc.handlers.MemService`. Every op is still packed, handled and
unpacked exactly as over the wire, so the caller cannot tell the difference;
only the transport is gone. The simulator (:mod:`kvstack.sim`) and the engine
tests use it.
"""

from __future__ import annotations

from typing import Any

from memsvc import protocol as wire
from memsvc.client import Call, ClientSession, MemClientBase
from memsvc.handlers import MemService, ServiceConfig


class InProcessMem(MemClientBase):
    """An asyncio memsvc client whose every op is handled by ``service`` in this process.

    A subclass that must see what each op did overrides :meth:`observe`.
    """

    def __init__(self, service: MemService, name: str = "scheduler") -> None:
        self._service = service
        # Nothing expires leases in process (no reaper runs): the longest memsvc takes.
        lease_s = ServiceConfig.max_lease_s
        self._state = ClientSession("inproc://memsvc", "scheduler", name, lease_s, 1.0, 0, None)

    @property
    def service(self) -> MemService:
        """The service every op goes to."""
        return self._service

    @classmethod
    async def connect(
        cls, service: MemService, name: str = "scheduler", **kwargs: Any
    ) -> InProcessMem:
        """A client with an open session (``hello`` done), like ``AsyncMemClient.connect``."""
        client = cls(service, name, **kwargs)
        await client._invoke(client._state.hello_call())
        return client

    async def _invoke(self, call: Call) -> Any:
        _, frames = self._state.frames(call)
        header = wire.unpack(self._service.handle(frames))
        result = self._state.finish(call, header)
        self.observe(call.op, call.fields, result)
        return result

    def observe(self, op: str, fields: dict[str, Any], result: Any) -> None:
        """Called after each op that succeeded, with its header fields and parsed result.

        Does nothing here; it must not change the service's state.
        """
