"""The normal-mode engine: one :meth:`Engine.step` is one turn of the loop, prefill first."""

from __future__ import annotations

from scheduler_svc.engine.decode_round import DecodeRound
from scheduler_svc.engine.prefill_round import PrefillRound


class Engine(PrefillRound, DecodeRound):
    """SGLang's scheduling loop over memsvc and model_svc (see :mod:`scheduler_svc.engine`)."""

    async def step(self) -> bool:
        """One iteration; False when there was nothing to do."""
        await self._apply_commands()
        if await self._prefill_round():
            await self.commit_journal()  # a first token, a resume: recorded before the next step
            return True
        if self.running:
            await self._decode_round()
            return True
        if not self.waiting and self.chunked is None:
            self.ratio.reset()
        return False
