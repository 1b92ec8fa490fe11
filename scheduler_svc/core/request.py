"""Req: one generation request and its checked state machine.

::

    WAITING ──start_prefill──► PREFILLING ──start_decode──► RUNNING ──┐
       │                        │  ▲  continue_prefill (next chunk)  │ reset_for_retract
       │                        └──┘                                 ▼
       │       RETRACTED ──start_prefill (re-prefill origin + output)──► PREFILLING
       │       RETRACTED ──resume (KV loaded back from the host store)─► RUNNING
       │       PREFILLING ──unschedule (admitted, but got no KV)──► WAITING | RETRACTED
       ├── commit_transfer (PD decode: the prompt's KV arrived) ──────► RUNNING
       └── abort ──► ABORTED        PREFILLING | RUNNING ──check_finished──► FINISHED

Token regions of one prefill round (``fill_ids = origin_input_ids + output_ids``)::

    | prefix: KV exists (tree hit or earlier chunks) | extend: computed this round | rest |
    0                                       prefix_len              prefix_len + extend_len
    kv_len = prefix_len until complete_extend(), then prefix_len + extend_len

While RUNNING, ``kv_len == len(fill_ids) - 1``: the last sampled token's KV is
written by the next decode step, which is why it opens a new page when
``kv_len % page_size == 0``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from scheduler_svc.core.errors import IllegalTransitionError
from scheduler_svc.core.sampling import FinishAbort, FinishReason, SamplingParams


@dataclass(slots=True)
class LogprobState:
    """What a ``return_logprob`` request computed (SGLang's ``req.logprob``).

    ``input_vals[j]``: until the prefill completes, the logprob of prompt token
    ``logprob_start_len + j + 1`` (the last one: of the first output token);
    then SGLang's shape, ``[None] + ...[:-1]``. ``output_vals`` and
    ``output_tops`` run parallel to ``output_ids`` and survive a retract.
    """

    input_vals: list[float | None] = field(default_factory=list)
    input_tops: list[Any] = field(default_factory=list)
    input_done: bool = False
    output_vals: list[float | None] = field(default_factory=list)
    output_tops: list[Any] = field(default_factory=list)


class ReqState(IntEnum):
    """Ordered: anything at or after FINISHED is terminal."""

    WAITING = 0
    PREFILLING = 1
    RUNNING = 2
    RETRACTED = 3
    FINISHED = 4
    ABORTED = 5


_S = ReqState
TRANSITIONS: dict[ReqState, frozenset[ReqState]] = {
    # WAITING -> RETRACTED: arrived from another decode node (arrive_migrated).
    _S.WAITING: frozenset({_S.PREFILLING, _S.RUNNING, _S.RETRACTED, _S.ABORTED}),
    # PREFILLING -> RETRACTED: pause-retract takes the in-progress chunk too.
    # PREFILLING -> WAITING | RETRACTED: unschedule, before any KV was allocated.
    _S.PREFILLING: frozenset(
        {_S.WAITING, _S.PREFILLING, _S.RUNNING, _S.RETRACTED, _S.FINISHED, _S.ABORTED}
    ),
    _S.RUNNING: frozenset({_S.RETRACTED, _S.FINISHED, _S.ABORTED}),
    _S.RETRACTED: frozenset({_S.PREFILLING, _S.RUNNING, _S.ABORTED}),
    _S.FINISHED: frozenset(),
    _S.ABORTED: frozenset(),
}


@dataclass(slots=True, eq=False)
class Req:
    """A request as the scheduler sees it. Change state only through the methods.

    ``row`` is the request's req_to_token row in memsvc, ``None`` while it
    holds none. The service reads it before ``reset_for_retract`` (which
    forgets it) to release the KV. ``output_ids`` survive a retract: streamed
    text is never re-sent and the re-prefill recomputes them.
    """

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    priority: int | None = None
    output_ids: list[int] = field(default_factory=list)
    # PD mode: the room that pairs this request's prefill and decode sides.
    bootstrap_room: int | None = None
    bootstrap_rid: str | None = None  # the decode side's rid, if not ``rid`` (re-bootstrap)
    bootstrap_peer: str | None = None  # the decode memsvc's transfer socket, if not memsvc's
    # The cache namespace its KV is shared in (memsvc.namespace.namespace_of of its
    # cache_salt and extra_key, computed once at intake; "" the default). Kept through
    # retract, recovery and the PD hand-off: every memsvc row it opens is in it.
    namespace: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    # SGLang's logprobs: ``logprob_start_len`` resolved (-1 became len(origin_input_ids):
    # output logprobs only); ``logprob`` holds what was computed.
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    # Decodes output ids for the stop-string check (the service sets it when ``stop``).
    stop_decoder: Callable[[list[int]], str] | None = None

    state: ReqState = field(default=ReqState.WAITING, init=False)
    row: int | None = field(default=None, init=False)
    # Per-attempt prefill bookkeeping (cleared by reset_for_retract).
    prefix_len: int = field(default=0, init=False)
    extend_len: int = field(default=0, init=False)
    kv_len: int = field(default=0, init=False)
    is_chunked: bool = field(default=False, init=False)
    extend_in_flight: bool = field(default=False, init=False)
    already_computed: int = field(default=0, init=False)
    # Retracted with its KV (all but the last token) parked in memsvc's host store.
    host_copy: bool = field(default=False, init=False)
    # Running: memsvc already holds the slot of its next decode position (the overlap
    # schedule reserved it while the last step ran). Cleared by a retract.
    slot_reserved: bool = field(default=False, init=False)
    # PD decode: moved here from another decode node, which relays its replies.
    moved_in: bool = field(default=False, init=False)
    # Sticky accounting.
    retraction_count: int = field(default=0, init=False)
    retracted_stain: bool = field(default=False, init=False)
    # Forward pass at which a retracted request was last re-admitted (-1: never retracted).
    readmit_step: int = field(default=-1, init=False)
    cached_tokens: int = field(default=0, init=False)
    # Hierarchical cache: where that hit came from (SGLang's cached_tokens_details,
    # {"device": .., "host": .., "storage": .., "storage_backend": ..}); None when the
    # hierarchy is off.
    cached_tokens_details: dict[str, int | str] | None = field(default=None, init=False)
    finish_reason: FinishReason | None = field(default=None, init=False)
    logprob: LogprobState = field(init=False)
    # Time stamps (time.monotonic()).
    queue_entry_time: float = field(default=0.0, init=False)
    first_scheduled_time: float | None = field(default=None, init=False)
    first_token_time: float | None = field(default=None, init=False)
    retract_time: float | None = field(default=None, init=False)
    finish_time: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.origin_input_ids:
            raise ValueError(f"request {self.rid!r} has an empty prompt")
        self.origin_input_ids = list(self.origin_input_ids)
        self.output_ids = list(self.output_ids)
        self.queue_entry_time = self.arrival_time
        self.logprob = LogprobState()

    # -- derived ---------------------------------------------------------------

    @property
    def fill_ids(self) -> list[int]:
        """What a (re-)prefill computes: the prompt plus everything generated so far."""
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def wants_input_logprobs(self) -> bool:
        """The prompt's logprobs are asked for and not computed yet."""
        return (
            self.return_logprob
            and 0 <= self.logprob_start_len < len(self.origin_input_ids)
            and not self.logprob.input_done
        )

    @property
    def max_prefix_len(self) -> int:
        """How much of the prompt a prefix match may cover: at most up to
        ``logprob_start_len`` while the prompt's logprobs are still to compute
        (a cached position has no logits), as SGLang."""
        limit = len(self.fill_ids) - 1
        if self.wants_input_logprobs:
            limit = min(limit, self.logprob_start_len)
        return limit

    def record_input_logprobs(self, prefix_len: int, data: dict[str, Any] | None) -> None:
        """The extend that computed positions ``prefix_len..`` of this round gave ``data``
        (the worker's entry for positions from ``max(logprob_start_len, prefix_len)``)."""
        if not self.wants_input_logprobs or data is None:
            return
        self.logprob.input_vals.extend(data["logprobs"])
        if self.top_logprobs_num > 0:
            self.logprob.input_tops.extend(
                None if top is None else [list(pair) for pair in zip(*top, strict=True)]
                for top in data.get("top") or []
            )

    def finish_input_logprobs(self) -> None:
        """The prefill is complete: SGLang's shape (first None, the sampling one dropped)."""
        if not self.wants_input_logprobs:
            return
        state = self.logprob
        num = len(self.origin_input_ids) - self.logprob_start_len
        state.input_vals = [None, *state.input_vals[: num - 1]]
        if self.top_logprobs_num > 0:
            state.input_tops = [None, *state.input_tops[: num - 1]]
        state.input_done = True

    def record_output_logprob(self, logprob: float | None, top: Any) -> None:
        """The logprob (and top-k, ``[[logprob, id], ...]``) of the token just appended."""
        if not self.return_logprob:
            return
        self.logprob.output_vals.append(logprob)
        if self.top_logprobs_num > 0:
            self.logprob.output_tops.append(top)

    @property
    def is_finished(self) -> bool:
        return self.state >= ReqState.FINISHED

    @property
    def is_retracted(self) -> bool:
        return self.state is ReqState.RETRACTED

    @property
    def prefill_done(self) -> bool:
        """The whole of ``fill_ids`` (as it was at admission) has KV."""
        return self.state is ReqState.PREFILLING and not (self.extend_in_flight or self.is_chunked)

    # -- transitions -----------------------------------------------------------

    def _move(self, target: ReqState, why: str = "") -> None:
        if target not in TRANSITIONS[self.state]:
            detail = f": {why}" if why else ""
            raise IllegalTransitionError(
                f"request {self.rid!r}: {self.state.name} -> {target.name} is not allowed{detail}"
            )
        self.state = target

    def _require(self, condition: bool, target: ReqState, why: str) -> None:
        if not condition:
            raise IllegalTransitionError(
                f"request {self.rid!r}: {self.state.name} -> {target.name}: {why}"
            )

    def start_prefill(self, row: int, prefix_len: int, extend_len: int) -> None:
        """Admitted: compute ``extend_len`` tokens after a ``prefix_len`` cache hit.

        ``cached_tokens`` counts the hit only on the first attempt: after a
        retract the hit is mostly the request's own earlier KV, and counting
        it again would inflate the cache-hit rate.
        """
        target = ReqState.PREFILLING
        self._require(self.state in (ReqState.WAITING, ReqState.RETRACTED), target, "not queued")
        self._check_round(prefix_len, extend_len, target)
        self._require(row >= 0, target, f"bad row {row}")
        self._move(target)
        self.row = row
        if not self.retracted_stain:
            self.cached_tokens += prefix_len - self.already_computed
        self._begin_round(prefix_len, extend_len)
        if self.first_scheduled_time is None:
            self.first_scheduled_time = time.monotonic()

    def record_cache_tiers(self, details: dict[str, int | str]) -> None:
        """Where :meth:`start_prefill`'s prefix hit came from, per cache tier.

        Counted like ``cached_tokens``: on the first attempt only (and so on
        its first chunk only, the one a prefix match starts).
        """
        if not self.retracted_stain and self.cached_tokens_details is None:
            self.cached_tokens_details = dict(details)

    def unschedule(self) -> None:
        """Undo :meth:`start_prefill`: the pool had no room for its round after all.

        Only for the round ``start_prefill`` began, before its forward pass
        (a later chunk's earlier chunks hold KV: that is a retract). Back to
        WAITING, or RETRACTED for a retracted request, with the row and the
        round forgotten and the cache hit ``start_prefill`` counted taken back.
        """
        target = ReqState.RETRACTED if self.retracted_stain else ReqState.WAITING
        self._require(
            self.state is ReqState.PREFILLING and self.extend_in_flight,
            target,
            "no prefill round in flight",
        )
        self._move(target)
        if not self.retracted_stain:
            self.cached_tokens -= self.prefix_len
            self.cached_tokens_details = None
        self.row = None
        self.prefix_len = self.extend_len = self.kv_len = self.already_computed = 0
        self.is_chunked = self.extend_in_flight = False

    def continue_prefill(self, extend_len: int) -> None:
        """Schedule the next chunk of a chunked prefill, right after the last one."""
        target = ReqState.PREFILLING
        self._require(self.state is target and self.is_chunked, target, "no chunk in progress")
        self._require(not self.extend_in_flight, target, "previous chunk not completed")
        self._check_round(self.kv_len, extend_len, target)
        self._move(target)
        self._begin_round(self.kv_len, extend_len)

    def _check_round(self, prefix_len: int, extend_len: int, target: ReqState) -> None:
        self._require(
            prefix_len >= 0 and extend_len >= 0 and prefix_len + extend_len <= self.seq_len,
            target,
            f"prefix {prefix_len} + extend {extend_len} outside fill_ids of {self.seq_len}",
        )

    def _begin_round(self, prefix_len: int, extend_len: int) -> None:
        self.prefix_len = prefix_len
        self.extend_len = extend_len
        self.kv_len = prefix_len
        self.already_computed = prefix_len + extend_len
        self.is_chunked = prefix_len + extend_len < self.seq_len
        self.extend_in_flight = True

    def complete_extend(self) -> bool:
        """The round's forward pass wrote its KV. Returns whether the prefill is done."""
        self._require(
            self.state is ReqState.PREFILLING and self.extend_in_flight,
            ReqState.PREFILLING,
            "no extend in flight",
        )
        self.extend_in_flight = False
        self.kv_len = self.prefix_len + self.extend_len
        return not self.is_chunked

    def append_token(self, token_id: int) -> None:
        """Append a sampled token: after the final prefill round, or after a decode step.

        A decode step wrote the KV of the previous last token, so ``kv_len``
        grows by one; a prefill already counted its tokens.
        """
        if self.state is ReqState.RUNNING:
            self._require(self.kv_len == self.seq_len - 1, self.state, "decode KV out of step")
            self.kv_len += 1
        else:
            self._require(
                self.prefill_done and self.kv_len == self.seq_len,
                ReqState.RUNNING,
                "can append a token only after the final prefill round or a decode step",
            )
        self.output_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def start_decode(self) -> None:
        """Join the running decode batch once the prefill has sampled its token."""
        target = ReqState.RUNNING
        self._require(
            self.prefill_done and self.kv_len == self.seq_len - 1,
            target,
            "prefill not complete or no token sampled yet",
        )
        self._move(target)

    def resume(self, row: int) -> None:
        """The retracted KV (all but the last token) is back in ``row``: decode on.

        From the host store, or (PD) re-prefilled by the prefill node.
        """
        target = ReqState.RUNNING
        self._require(self.is_retracted and bool(self.output_ids), target, "nothing to resume")
        self._move(target)
        self.row = row
        self.kv_len = self.seq_len - 1
        self.host_copy = False

    def arrive_migrated(self, retractions: int, cached_tokens: int) -> None:
        """Moved here from another decode node with what it generated there: it waits for
        its KV (all but its last token) as a request retracted here would, then
        resumes (:meth:`resume`)."""
        target = ReqState.RETRACTED
        self._require(
            self.state is ReqState.WAITING and bool(self.output_ids), target, "nothing to migrate"
        )
        self._move(target)
        self.moved_in = True
        self.retraction_count, self.retracted_stain = retractions, True
        self.cached_tokens = cached_tokens
        self.first_scheduled_time = self.first_token_time = time.monotonic()

    def commit_transfer(self, row: int, first_token: int, cached_tokens: int = 0) -> None:
        """PD decode: the prompt's KV arrived in ``row`` with the token the prefill sampled."""
        target = ReqState.RUNNING
        self._require(
            self.state is ReqState.WAITING and not self.output_ids, target, "not awaiting a prefill"
        )
        self._move(target)
        self.row = row
        self.kv_len = len(self.origin_input_ids)
        self.cached_tokens = cached_tokens
        self.output_ids.append(first_token)
        if self.first_scheduled_time is None:
            self.first_scheduled_time = time.monotonic()
        self.first_token_time = time.monotonic()

    def reset_for_retract(self) -> None:
        """Retracted: forget the attempt, keep what was generated.

        Kept: ``output_ids``, sampling params, priority, ``cached_tokens``,
        time stamps. Cleared: the row, prefix/extend/KV lengths, the chunk
        state. ``retraction_count`` grows and ``retracted_stain`` sticks.
        """
        target = ReqState.RETRACTED
        self._require(self.state is not ReqState.WAITING, target, "never admitted")
        self._move(target)
        if not self.logprob.input_done:  # the prefill did not finish: computed again
            self.logprob.input_vals, self.logprob.input_tops = [], []
        self.row = None
        self.prefix_len = self.extend_len = self.kv_len = self.already_computed = 0
        self.is_chunked = self.extend_in_flight = self.slot_reserved = False
        self.retraction_count += 1
        self.retracted_stain = True
        # Re-queued: the waiting clock restarts (SGLang's set_wait_queue_entry_time).
        self.retract_time = self.queue_entry_time = time.monotonic()

    def check_finished(self, eos_token_ids: Collection[int] = ()) -> bool:
        """After ``append_token``: finish on ``max_new_tokens`` or a stop/EOS token
        (:meth:`SamplingParams.finish_reason`). Returns whether the request is finished.
        """
        if self.is_finished:
            return True
        self._require(bool(self.output_ids), ReqState.FINISHED, "no token generated yet")
        reason = self.sampling_params.finish_reason(
            self.output_ids, eos_token_ids, self.stop_decoder
        )
        if reason is not None:
            self._finish(reason)
        return reason is not None

    def suppressed_token_ids(self, eos_token_ids: Collection[int]) -> list[int]:
        """What the next token may not be: EOS and the stop ids, before ``min_new_tokens``."""
        return self.sampling_params.suppressed_token_ids(len(self.output_ids), eos_token_ids)

    def _finish(self, reason: FinishReason) -> None:
        self._move(ReqState.FINISHED)
        self.finish_reason = reason
        self.finish_time = time.monotonic()

    def abort(self, message: str, status_code: int) -> None:
        """End the request with an error. ``row`` is kept so the service can release it."""
        self._move(ReqState.ABORTED)
        self.finish_reason = FinishAbort(message, status_code)
        self.is_chunked = self.extend_in_flight = False
        self.finish_time = time.monotonic()
