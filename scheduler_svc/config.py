"""``SchedulerServiceConfig``: every setting of ``python -m scheduler_svc``, declared once.

The admission and retract knobs are :class:`SchedulerConfig`'s (the pure
core's, which declares their flags on its fields); the rest are the process's
own: its peers, fault tolerance, metrics. The core config needs memsvc's page
size and row count, known once connected, so this one keeps the knobs' values
(``scheduling``) and :meth:`SchedulerServiceConfig.scheduler_config` builds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from memsvc.config import MetricsConfig
from memsvc.settings import setting
from scheduler_svc.core.config import RetractMode, SchedulerConfig
from scheduler_svc.protocol import RESULT_CACHE_BYTES, RESULT_CACHE_SIZE

FAULTS = "fault tolerance"


@dataclass(frozen=True, kw_only=True)
class SchedulerServiceConfig:
    mode: str = setting(
        "normal",
        "normal: one node; prefill / decode: one side of a PD pair behind "
        "`python -m scheduler_svc.pd.router` (memsvc needs the matching --pd-role)",
        choices=("normal", "prefill", "decode"),
    )
    memsvc: str = setting(help="memsvc address")
    worker: str = setting(help="model_svc address")
    page_size: int | None = setting(None, "expected page size; refuse to start if memsvc's differs")
    max_running_requests: int | None = setting(
        None, "most requests decoding at once (default: memsvc's row count)"
    )
    scheduling: Mapping[str, Any] = field(
        default_factory=dict, metadata={"part": SchedulerConfig, "partial": True}
    )
    checkpoint: str | None = setting(
        None,
        "checkpoint folder whose tokenizer.json to use for text input (default: the "
        "byte-level tokenizer); info names it, so that a front decodes alike",
    )
    served_model_name: str | None = setting(
        None,
        "the model_name label of the sglang:* metrics (default: --checkpoint, or 'default' "
        "without one)",
    )
    result_cache_bytes: int = setting(
        RESULT_CACHE_BYTES,
        "bytes of finished results (as msgpack) kept to answer a re-submitted rid, and at "
        f"most {RESULT_CACHE_SIZE} results; the oldest go first, the newest is always kept",
    )
    migrate_to: str | None = setting(
        None,
        "decode mode: another decode node's scheduler (its listen address). A request "
        "retracted to this node's host store that cannot resume here moves there with its "
        "KV when that node has room, instead of waiting here (its replies are relayed)",
    )
    migrate_policy: str = setting(
        "cost",
        "decode mode with --migrate-to: cost: a retracted request moves when sending its KV "
        "(bytes over the move rate seen so far) takes less time than waiting here until "
        "the running requests' ends free room for it (decode steps of their "
        "max_new_tokens left); always: whenever the peer has room",
        choices=("cost", "always"),
    )
    migrate_in_timeout: float = setting(
        30.0,
        "decode mode: seconds a request another decode node moved here waits for its KV "
        "before it ends (504) and its pages are freed",
        group=FAULTS,
    )
    metrics: MetricsConfig = field(default_factory=MetricsConfig, metadata={"part": MetricsConfig})
    memsvc_timeout: float = setting(
        5.0,
        "seconds memsvc has to answer one op (tried 3 times) before it counts as dead",
        group=FAULTS,
        forward=True,
    )
    memsvc_lease: float = setting(
        10.0,
        "memsvc session lease: memsvc reclaims our KV this long after we go silent",
        group=FAULTS,
        forward=True,
    )
    worker_timeout: float = setting(
        60.0,
        "seconds model_svc has to answer one forward call (tried twice) before it counts as "
        "dead (a worker that exits is noticed at once)",
        group=FAULTS,
        forward=True,
    )
    recovery_timeout: float = setting(
        120.0,
        "how long to wait for a dead memsvc or model_svc to come back before failing the "
        "live requests",
        group=FAULTS,
        forward=True,
    )
    memsvc_session_file: str | None = setting(
        None,
        "keep our memsvc session id here; a restarted scheduler ends the session its dead "
        "predecessor left, so memsvc reclaims that KV at once",
        group=FAULTS,
    )

    def scheduler_config(self, page_size: int, memsvc_rows: int) -> SchedulerConfig:
        """The core's config for memsvc's pool: ``SGLANG_*`` from the environment, then the
        flags. A decode node always offloads (its victims' KV has nowhere else to go)."""
        knobs = dict(self.scheduling)
        if self.mode == "decode":
            knobs["retract_mode"] = RetractMode.OFFLOAD
        return SchedulerConfig.from_env(
            page_size=page_size,
            max_running_requests=self.max_running_requests or memsvc_rows,
            **knobs,
        )
