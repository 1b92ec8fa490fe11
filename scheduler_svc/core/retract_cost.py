"""Per-victim choice between recompute and offload (``--retract-mode auto``).

Bringing a retracted request back costs either a re-prefill of what the
prefix tree no longer holds, or two copies of its KV (out to the host store
now, back in on re-admission). Both rates are learned online from what this
scheduler observes; until it has seen any, the defaults below (the bundled
model on one CPU core, ``bench/model_step.py`` / ``bench/offload_bw.py``)
apply::

    recompute_s = (seq_len − likely_hit) / prefill_tokens_per_s
    likely_hit  = hit_fraction × floor_page(prompt)   (learned from re-admitted victims)
    offload_s   = 2 × kv_bytes / copy_bytes_per_s        (only if the host store has room)

A PD decode node with a peer (``--migrate-to``) weighs a third way for a victim
already in its host store: moving it to the peer, against waiting here until
the running requests' ends free room for it (``migrate_beats_waiting``)::

    move_s = kv_bytes / move_bytes_per_s                   (learned from committed moves)
    wait_s = decode_step_s × steps until enough running requests end (their
             max_new_tokens; their growth until then is charged)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from scheduler_svc.core.admission import floor_page
from scheduler_svc.core.request import Req

# Weight of a new observation in the running averages.
EMA_WEIGHT = 0.2


def _ema(old: float, new: float) -> float:
    return old + EMA_WEIGHT * (new - old)


@dataclass
class RetractCostModel:
    bytes_per_token: int
    page_size: int
    prefill_tokens_per_s: float = 10_000.0
    copy_bytes_per_s: float = 4e9
    # How much of a recomputed victim's prompt the prefix tree still holds when it
    # comes back. The prompt is published to the tree after its prefill, but the
    # pressure that caused the retract may evict it first: half until observed.
    hit_fraction: float = 0.5
    prefill_observed: bool = False
    # Moving a request's KV to another decode node (zmq or NIXL), and a decode pass.
    move_bytes_per_s: float = 1e9
    decode_step_s: float = 0.05

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = _ema(self.prefill_tokens_per_s, tokens / seconds)
            self.prefill_observed = True

    def recompute_s_per_token(self) -> float | None:
        """Prefill seconds per token once a prefill was measured (memsvc's hierarchical
        cache weighs a load against it); None before, the prior being a guess."""
        return 1.0 / self.prefill_tokens_per_s if self.prefill_observed else None

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.copy_bytes_per_s = _ema(self.copy_bytes_per_s, nbytes / seconds)

    def observe_move(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.move_bytes_per_s = _ema(self.move_bytes_per_s, nbytes / seconds)

    def observe_decode_step(self, seconds: float) -> None:
        if seconds > 0:
            self.decode_step_s = _ema(self.decode_step_s, seconds)

    def move_s(self, req: Req) -> float:
        return self.kv_bytes(req) / self.move_bytes_per_s

    def wait_s(self, need: int, allocatable: int, running: list[tuple[int, int]]) -> float:
        """Seconds until ``need`` KV slots are allocatable here, from ``allocatable`` now,
        if no request arrives: ``running`` holds (steps left, slots freed at its end)
        per running request; each step until its end it takes one more slot. inf if
        their ends never free enough."""
        if allocatable >= need:
            return 0.0
        still = len(running)  # running after ``steps``: each grew by one slot a step
        freed = 0
        for steps, ending in itertools.groupby(sorted(running), key=lambda item: item[0]):
            for _, slots in ending:
                freed += slots
                still -= 1
            if allocatable + freed - steps * still >= need:
                return steps * self.decode_step_s
        return math.inf

    def migrate_beats_waiting(
        self, req: Req, need: int, allocatable: int, running: list[tuple[int, int]]
    ) -> bool:
        """Whether moving ``req`` (in the host store) to another node now brings it back
        sooner than waiting here for ``need`` slots."""
        return self.move_s(req) < self.wait_s(need, allocatable, running)

    def observe_readmit(self, prompt_len: int, prefix_len: int) -> None:
        """A recomputed victim is back: ``prefix_len`` of its tokens hit the tree."""
        aligned = floor_page(prompt_len, self.page_size)
        if aligned > 0:
            self.hit_fraction = _ema(self.hit_fraction, min(prefix_len, aligned) / aligned)

    def kv_bytes(self, req: Req) -> int:
        """What an offload of ``req`` now moves: the KV of all but its last token."""
        return max(req.seq_len - 1, 0) * self.bytes_per_token

    def recompute_s(self, req: Req) -> float:
        likely_hit = self.hit_fraction * floor_page(len(req.origin_input_ids), self.page_size)
        return max(req.seq_len - likely_hit, 1) / self.prefill_tokens_per_s

    def offload_s(self, req: Req) -> float:
        return 2 * self.kv_bytes(req) / self.copy_bytes_per_s

    def readmit_s(self, req: Req, mode: str) -> float:
        """What retracting ``req`` now costs to undo under retract ``mode``, in seconds.

        ``auto`` takes the cheaper way regardless of the host store's room
        (which only the retract itself knows); does not change the model.
        """
        if mode == "recompute":
            return self.recompute_s(req)
        if mode == "offload":
            return self.offload_s(req)
        return min(self.recompute_s(req), self.offload_s(req))

    def choose_offload(self, victims: list[Req], host_free_bytes: int) -> list[bool]:
        """Per victim (in the order they would be retracted), whether to offload it.

        A victim is offloaded when that is cheaper and the host store still
        has room after the victims before it that were offloaded.
        """
        room = host_free_bytes
        choices = []
        for req in victims:
            need = self.kv_bytes(req)
            offload = need <= room and self.offload_s(req) < self.recompute_s(req)
            if offload:
                room -= need
            choices.append(offload)
        return choices
