"""SchedulerConfig: every knob of admission and retract, validated once.

The tuning knobs keep SGLang's environment names and defaults so that SGLang
tuning advice applies verbatim; :meth:`SchedulerConfig.from_env` reads them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from scheduler_svc.core.errors import ConfigError


class RetractionPolicy(StrEnum):
    """Victim order (``--retraction-policy``); :mod:`scheduler_svc.core.policy` orders by each."""

    LENGTH = "length"  # fewest outputs first (SGLang's default)
    PRIORITY = "priority"  # least important first
    COST = "cost"  # cheapest to bring back first, by the retract cost model under retract_mode


class RetractMode(StrEnum):
    """What happens to a victim's KV (``--retract-mode``)."""

    RECOMPUTE = "recompute"  # dropped and recomputed (SGLang's normal mode)
    OFFLOAD = "offload"  # parked in the host store and loaded back (SGLang's PD decode)
    AUTO = "auto"  # per victim, whichever the cost model says is cheaper


class PdRetractFallback(StrEnum):
    """PD decode: what becomes of a victim the host store cannot take."""

    ABORT = "abort"  # SGLang's
    RECOMPUTE = "recompute"  # re-prefilled through the prefill node


class ReadmitCharge(StrEnum):
    """What re-admitting a retracted request reserves for its output. Admission checks what
    it has left to generate either way (as SGLang does)."""

    REMAINING = "remaining"  # what it has left to generate (kvstack)
    FULL = "full"  # its whole max_new_tokens again (SGLang)


RETRACTION_POLICIES: tuple[str, ...] = tuple(m.value for m in RetractionPolicy)
RETRACT_MODES: tuple[str, ...] = tuple(m.value for m in RetractMode)
PD_RETRACT_FALLBACKS: tuple[str, ...] = tuple(m.value for m in PdRetractFallback)
READMIT_CHARGES: tuple[str, ...] = tuple(m.value for m in ReadmitCharge)
# Field name -> its enum: a config built with a plain string holds the member.
ENUM_FIELDS = {
    "retraction_policy": RetractionPolicy,
    "retract_mode": RetractMode,
    "pd_retract_fallback": PdRetractFallback,
    "readmit_charge": ReadmitCharge,
}


def _parse_bool(value: str) -> bool:
    # SGLang's EnvBool spellings.
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes", "y"):
        return True
    if lowered in ("false", "0", "no", "n"):
        return False
    raise ValueError(f"{value!r} is not a valid boolean value")


# field name -> (environment variable, parser)
ENV_FIELDS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "init_new_token_ratio": ("SGLANG_INIT_NEW_TOKEN_RATIO", float),
    "min_new_token_ratio_factor": ("SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR", float),
    "new_token_ratio_decay_steps": ("SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS", int),
    "retract_decode_steps": ("SGLANG_RETRACT_DECODE_STEPS", int),
    "clip_max_new_tokens": ("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", int),
    "test_retract": ("SGLANG_TEST_RETRACT", _parse_bool),
    "test_retract_interval": ("SGLANG_TEST_RETRACT_INTERVAL", int),
}


def _knob(default: Any, help: str) -> Any:
    """A field that is a flag of scheduler_svc, which ``kvstack serve`` / ``up`` forward. Its
    metadata is plain data (:mod:`memsvc.settings` reads it; the core imports nothing)."""
    return field(default=default, metadata={"help": help, "forward": True})


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Admission, ratio and retract settings of one scheduler.

    ``chunked_prefill_size=None`` turns chunked prefill off; when on it must be
    at least one page, so that a chunk (floored to whole pages) is never empty.
    """

    page_size: int
    max_running_requests: int
    # The fields with a "help" are scheduler_svc's flags (memsvc.settings reads them).
    max_prefill_tokens: int = _knob(16384, "most tokens one prefill batch computes")
    chunked_prefill_size: int | None = _knob(
        None, "split long prompts into chunks of this many tokens (default: off)"
    )
    schedule_conservativeness: float = _knob(
        1.0, "scales the initial new_token_ratio (higher: admit fewer)"
    )
    retraction_policy: RetractionPolicy = _knob(  # noqa: RUF009 (a field)
        RetractionPolicy.LENGTH,
        "victim order: fewest outputs first (length, SGLang's), lowest priority "
        "(priority), or cheapest to bring back first by the retract cost model under "
        "--retract-mode (cost: re-prefill seconds, or KV copy seconds when offloading)",
    )
    enable_priority_scheduling: bool = _knob(
        False, "honour request priorities (needed by --retraction-policy priority)"
    )
    schedule_low_priority_values_first: bool = _knob(
        False, "a lower priority value is more important"
    )
    speculative: bool = False
    retract_mode: RetractMode = _knob(  # noqa: RUF009 (a field)
        RetractMode.RECOMPUTE,
        "what a retracted request's KV becomes (normal mode): dropped and "
        "re-prefilled (SGLang), parked in memsvc's host store and loaded back, or per "
        "victim the cheaper of the two by a cost model learned online. A decode node "
        "always offloads",
    )
    # PD decode node: tokens reserved per active request at preallocation (SGLang's 512).
    num_reserved_decode_tokens: int = _knob(
        512, "decode node: tokens reserved per active request when preallocating"
    )
    pd_retract_fallback: PdRetractFallback = _knob(  # noqa: RUF009 (a field)
        PdRetractFallback.ABORT,
        "decode node: a victim the host store cannot take is aborted (SGLang) or "
        "re-prefilled through the prefill node",
    )
    # Thrash guard: a request re-admitted after a retract is not a victim again for this
    # many forward passes unless nothing else can be (0: off, as in SGLang).
    retract_cooldown_steps: int = _knob(
        0,
        "thrash guard: a request re-admitted after a retract is not a victim again "
        "for this many forward passes unless nothing else can be (0: off, as in SGLang)",
    )
    readmit_charge: ReadmitCharge = _knob(  # noqa: RUF009 (a field)
        ReadmitCharge.REMAINING,
        "what re-admitting a retracted request reserves for its output: what it has "
        "left to generate, or its whole max_new_tokens again (SGLang); either way it is "
        "admitted if what it has left fits",
    )
    disable_overlap_schedule: bool = _knob(
        False,
        "run each decode step's memsvc reservation after the forward pass instead of "
        "during it (SGLang's flag; the overlap is on by default)",
    )
    # SGLang environment knobs (see ENV_FIELDS), SGLang's defaults.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    retract_decode_steps: int = 20
    clip_max_new_tokens: int = 4096
    test_retract: bool = False
    test_retract_interval: int = 3

    def __post_init__(self) -> None:
        for name, kind in ENUM_FIELDS.items():
            value = getattr(self, name)
            if not isinstance(value, kind) and value in tuple(kind):
                object.__setattr__(self, name, kind(value))
        problems = self._problems()
        if problems:
            raise ConfigError("invalid scheduler config: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        problems = []
        if self.page_size < 1:
            problems.append(f"page_size must be >= 1, got {self.page_size}")
        if self.max_running_requests < 1:
            problems.append(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            problems.append(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < self.page_size:
            problems.append(
                f"chunked_prefill_size must be None (off) or >= page_size ({self.page_size}), "
                f"got {self.chunked_prefill_size}"
            )
        if self.schedule_conservativeness < 0:
            problems.append(
                f"schedule_conservativeness must be >= 0, got {self.schedule_conservativeness}"
            )
        if self.retraction_policy not in RETRACTION_POLICIES:
            problems.append(
                f"retraction_policy must be one of {RETRACTION_POLICIES}, "
                f"got {self.retraction_policy!r}"
            )
        elif self.retraction_policy == "priority" and not self.enable_priority_scheduling:
            problems.append(
                "retraction_policy='priority' requires enable_priority_scheduling=True "
                "(requests carry no usable priority otherwise)"
            )
        if self.retract_mode not in RETRACT_MODES:
            problems.append(
                f"retract_mode must be one of {RETRACT_MODES}, got {self.retract_mode!r}"
            )
        if self.pd_retract_fallback not in PD_RETRACT_FALLBACKS:
            problems.append(
                f"pd_retract_fallback must be one of {PD_RETRACT_FALLBACKS}, "
                f"got {self.pd_retract_fallback!r}"
            )
        if self.readmit_charge not in READMIT_CHARGES:
            problems.append(
                f"readmit_charge must be one of {READMIT_CHARGES}, got {self.readmit_charge!r}"
            )
        if self.retract_cooldown_steps < 0:
            problems.append(
                f"retract_cooldown_steps must be >= 0, got {self.retract_cooldown_steps}"
            )
        if self.num_reserved_decode_tokens < 0:
            problems.append(
                f"num_reserved_decode_tokens must be >= 0, got {self.num_reserved_decode_tokens}"
            )
        if self.init_new_token_ratio < 0 or self.min_new_token_ratio_factor < 0:
            problems.append(
                "SGLANG_INIT_NEW_TOKEN_RATIO and SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR must be >= 0"
            )
        if self.new_token_ratio_decay_steps < 1:
            problems.append(
                "SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS must be >= 1, "
                f"got {self.new_token_ratio_decay_steps}"
            )
        if self.retract_decode_steps < 0:
            problems.append(
                f"SGLANG_RETRACT_DECODE_STEPS must be >= 0, got {self.retract_decode_steps}"
            )
        if self.clip_max_new_tokens < 0:
            problems.append(
                "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION must be >= 0, "
                f"got {self.clip_max_new_tokens}"
            )
        if self.test_retract_interval < 1:
            problems.append(
                f"SGLANG_TEST_RETRACT_INTERVAL must be >= 1, got {self.test_retract_interval}"
            )
        return problems

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> SchedulerConfig:
        """Build a config from ``SGLANG_*`` variables; keyword ``overrides`` win over both.

        ``environ`` defaults to ``os.environ``. A malformed value raises
        :class:`ConfigError` naming the variable (SGLang would warn and fall
        back to the default; a service refusing to start is easier to notice).
        """
        environ = os.environ if environ is None else environ
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown scheduler config fields: {unknown}")
        values: dict[str, Any] = {}
        for name, (env_name, parse) in ENV_FIELDS.items():
            raw = environ.get(env_name)
            if raw is None or name in overrides:
                continue
            try:
                values[name] = parse(raw)
            except ValueError as e:
                raise ConfigError(f"{env_name}={raw!r}: {e}") from None
        values.update(overrides)
        try:
            return cls(**values)
        except TypeError as e:  # a required field (page_size, ...) is missing
            raise ConfigError(str(e)) from None

    def is_test_retract_step(self, forward_ct: int) -> bool:
        """``SGLANG_TEST_RETRACT``: force a retract on every ``interval``-th forward."""
        return self.test_retract and forward_ct % self.test_retract_interval == 0
