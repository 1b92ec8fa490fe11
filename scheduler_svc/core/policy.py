"""Retract and intake policy: victim order, the decode-step estimate, the intake clamp.

The admission budget (:class:`PrefillAdder`) lives in ``admission.py`` and is
re-exported here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from http import HTTPStatus

from scheduler_svc.core.admission import (
    AddDecision,
    AddResult,
    PrefillAdder,
    ceil_page,
    floor_page,
    running_reservation,
)
from scheduler_svc.core.config import RetractionPolicy, SchedulerConfig
from scheduler_svc.core.errors import RequestTooLargeError
from scheduler_svc.core.request import Req
from scheduler_svc.core.retract_cost import RetractCostModel

__all__ = [
    "RETRACT_ABORT_MESSAGE",
    "RETRACT_ABORT_STATUS",
    "AddDecision",
    "AddResult",
    "PrefillAdder",
    "ceil_page",
    "check_fits",
    "clamp_max_new_tokens",
    "decode_tokens_required",
    "floor_page",
    "max_new_tokens_for_memory",
    "retraction_order",
    "running_reservation",
]

RETRACT_ABORT_MESSAGE = (
    "Out of memory even after retracting all other requests in the decode batch. "
    "Aborting the last request."
)
RETRACT_ABORT_STATUS = int(HTTPStatus.INTERNAL_SERVER_ERROR)  # 500


def decode_tokens_required(kv_lens: Iterable[int], page_size: int) -> int:
    """Free slots the next decode step needs: a page per request whose next token opens one.

    The same formula as memsvc's: the token goes to position ``kv_len``, which
    starts a new page exactly when ``kv_len % page_size == 0``.
    """
    return page_size * sum(1 for kv_len in kv_lens if kv_len % page_size == 0)


def retraction_order(
    reqs: Sequence[Req],
    config: SchedulerConfig,
    step: int | None = None,
    cost: RetractCostModel | None = None,
) -> list[int]:
    """Indices of ``reqs`` from most worth keeping to least; victims are popped from the end.

    With ``config.retract_cooldown_steps`` and the current forward pass
    ``step``, requests re-admitted less than that many passes ago come first
    (kept), whatever the policy: they are victims only if nothing else is left.

    - speculative decoding: batch order (a speculative batch can only be trimmed at its tail);
    - ``length``: most generated tokens kept first; among equals, the shorter prompt is kept
      (so the first victim has the fewest outputs and, among those, the longest prompt);
    - ``priority``: most important kept first, ``None`` least important of all, then as
      ``length``. By default a lower value is less important; with
      ``schedule_low_priority_values_first`` a higher value is;
    - ``cost``: most expensive to bring back kept first, by ``cost`` (the engine's
      learned :class:`RetractCostModel`; its priors if None) under
      ``config.retract_mode``: re-prefill seconds when recomputing, copy seconds
      (so bytes) when offloading, the cheaper of the two under ``auto``; ties as
      ``length``. Cheap victims free less memory, so a retract may take more of them.

    Sorting is stable, so fully tied requests keep their batch order.
    """
    order = _policy_order(reqs, config, cost)
    cooldown = config.retract_cooldown_steps
    if not cooldown or step is None or config.speculative:
        return order
    cooling = {
        i for i in order if reqs[i].readmit_step >= 0 and step - reqs[i].readmit_step < cooldown
    }
    return [i for i in order if i in cooling] + [i for i in order if i not in cooling]


def _length_key(req: Req) -> tuple[int, int]:
    return (len(req.output_ids), -len(req.origin_input_ids))


def _policy_order(
    reqs: Sequence[Req], config: SchedulerConfig, cost: RetractCostModel | None
) -> list[int]:
    if config.speculative:
        return list(range(len(reqs)))
    return _ORDERS[config.retraction_policy](reqs, config, cost)


def _by_length(
    reqs: Sequence[Req], config: SchedulerConfig, cost: RetractCostModel | None
) -> list[int]:
    return sorted(range(len(reqs)), key=lambda i: _length_key(reqs[i]), reverse=True)


def _by_cost(
    reqs: Sequence[Req], config: SchedulerConfig, cost: RetractCostModel | None
) -> list[int]:
    model = cost or RetractCostModel(bytes_per_token=1, page_size=config.page_size)
    mode = config.retract_mode
    return sorted(
        range(len(reqs)),
        key=lambda i: (model.readmit_s(reqs[i], mode), *_length_key(reqs[i])),
        reverse=True,
    )


def _by_priority(
    reqs: Sequence[Req], config: SchedulerConfig, cost: RetractCostModel | None
) -> list[int]:
    # Importance grows with the key; None sorts below every real priority.
    sign = 1 if config.schedule_low_priority_values_first else -1
    none_priority = sys.maxsize if config.schedule_low_priority_values_first else -sys.maxsize - 1

    def key(i: int) -> tuple[int, int, int]:
        req = reqs[i]
        priority = none_priority if req.priority is None else req.priority
        return (priority * -sign, *_length_key(req))

    return sorted(range(len(reqs)), key=key, reverse=True)


# One victim order per policy; a policy without one fails at import, not at a retract.
_ORDERS: dict[
    RetractionPolicy,
    Callable[[Sequence[Req], SchedulerConfig, RetractCostModel | None], list[int]],
] = {
    RetractionPolicy.LENGTH: _by_length,
    RetractionPolicy.PRIORITY: _by_priority,
    RetractionPolicy.COST: _by_cost,
}
if set(_ORDERS) != set(RetractionPolicy):
    raise TypeError(f"no victim order for {sorted(set(RetractionPolicy) - set(_ORDERS))}")


def max_new_tokens_for_memory(input_len: int, capacity: int, page_size: int) -> int:
    """The most output one request may ask for so that, alone, it is always admissible.

    ``capacity − ceil_page(input) − page_size − 1``: admission charges
    ``ceil_page(input) + page_size + max_new`` and needs it strictly below the
    free budget, which is at most ``capacity``. May be negative.
    """
    return capacity - ceil_page(input_len, page_size) - page_size - 1


def check_fits(input_len: int, capacity: int, page_size: int) -> None:
    """Reject at intake a prompt that could never produce a token in this pool.

    Raises :class:`RequestTooLargeError` (status 400) when
    ``max_new_tokens_for_memory(...) < 1``, i.e. when even an empty pool
    could not admit the prompt with room for one generated token.
    """
    if input_len < 1:
        raise ValueError(f"input_len must be >= 1, got {input_len}")
    if max_new_tokens_for_memory(input_len, capacity, page_size) < 1:
        needed = ceil_page(input_len, page_size) + page_size + 2
        raise RequestTooLargeError(
            f"Request prompt exceeds the KV memory budget: input_len={input_len} tokens, "
            f"KV pool capacity={capacity} tokens (a prompt of this length needs at least "
            f"{needed}: its pages, one page of headroom and one token of output)"
        )


def clamp_max_new_tokens(input_len: int, max_new_tokens: int, capacity: int, page_size: int) -> int:
    """Intake clamp (SGLang's ``init_req_max_new_tokens`` memory term, 0.5.23 form).

    ``max(0, min(max_new_tokens, capacity − ceil_page(input) − page_size − 1))``,
    which keeps "retract until one request is left" always sufficient. Never
    below 0; after :func:`check_fits` has passed the memory term is at least
    1, so a request that asked for tokens keeps at least one.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    return max(0, min(max_new_tokens, max_new_tokens_for_memory(input_len, capacity, page_size)))
