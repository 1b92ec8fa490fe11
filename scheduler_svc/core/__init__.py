"""The pure scheduler core: requests, admission budget, retract policy. No I/O.

The service shell (sockets, the loop) calls these; nothing here blocks or talks
to memsvc: the shell passes in what memsvc reported (available + evictable
tokens, prefix-match lengths) and acts on what comes back.
"""

from scheduler_svc.core.admission import (
    AddDecision,
    AddResult,
    Admission,
    PrefillAdder,
    ceil_page,
    floor_page,
    running_reservation,
)
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.errors import (
    ConfigError,
    IllegalTransitionError,
    RequestTooLargeError,
    SchedulerError,
)
from scheduler_svc.core.policy import (
    RETRACT_ABORT_MESSAGE,
    RETRACT_ABORT_STATUS,
    check_fits,
    clamp_max_new_tokens,
    decode_tokens_required,
    max_new_tokens_for_memory,
    retraction_order,
)
from scheduler_svc.core.ratio import NewTokenRatioTracker
from scheduler_svc.core.request import Req, ReqState
from scheduler_svc.core.sampling import (
    FinishAbort,
    FinishLength,
    FinishMatchedStr,
    FinishMatchedToken,
    FinishReason,
    SamplingParams,
)

__all__ = [
    "RETRACT_ABORT_MESSAGE",
    "RETRACT_ABORT_STATUS",
    "AddDecision",
    "AddResult",
    "Admission",
    "ConfigError",
    "FinishAbort",
    "FinishLength",
    "FinishMatchedStr",
    "FinishMatchedToken",
    "FinishReason",
    "IllegalTransitionError",
    "NewTokenRatioTracker",
    "PrefillAdder",
    "Req",
    "ReqState",
    "RequestTooLargeError",
    "SamplingParams",
    "SchedulerConfig",
    "SchedulerError",
    "ceil_page",
    "check_fits",
    "clamp_max_new_tokens",
    "decode_tokens_required",
    "floor_page",
    "max_new_tokens_for_memory",
    "retraction_order",
    "running_reservation",
]
