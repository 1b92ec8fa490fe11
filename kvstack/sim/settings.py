"""What one simulation runs with (:class:`SimSpec`), and ``--set`` / ``--sweep`` on it.

A setting ``key=value`` goes, by key, to the first of:

1. the pool (:data:`POOL_KEYS`: ``pool_tokens``, ``page_size``, ...);
2. any :class:`~scheduler_svc.core.SchedulerConfig` field
   (``schedule_conservativeness``, ``retraction_policy``, ``retract_mode``
   once the config has it, ...), its value parsed after the field's default;
3. any :class:`~kvstack.sim.costmodel.CostModel` field.

Nothing here names a scheduler field, so a field added to ``SchedulerConfig``
can be set and swept as soon as it exists. Sweeps are the cartesian
product of every ``--sweep`` key's values, in the order given.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from kvstack.sim.costmodel import CostModel
from scheduler_svc.core import SchedulerConfig

POOL_KEYS = ("pool_tokens", "page_size", "max_running_requests", "host_store_tokens")


@dataclass(frozen=True)
class SimSpec:
    """The stack under simulation: pool geometry, scheduler overrides, costs, checks.

    ``host_store_tokens`` (None: as many as the pool) sizes memsvc's host
    store, which offload-mode retracts need. ``check_tokens`` makes the
    worker verify KV slots and the runner verify every output (slower).
    """

    pool_tokens: int = 200_000
    page_size: int = 16
    max_running_requests: int = 256
    host_store_tokens: int | None = None
    config: dict[str, Any] = field(default_factory=dict)
    cost: CostModel = field(default_factory=CostModel)
    check_tokens: bool = False
    keep_outputs: bool = False

    def scheduler_config(self) -> SchedulerConfig:
        """The engine's config; ``SGLANG_*`` variables are ignored, so runs are reproducible."""
        return SchedulerConfig.from_env(
            {},
            page_size=self.page_size,
            max_running_requests=self.max_running_requests,
            **self.config,
        )


def config_field_names() -> list[str]:
    return [f.name for f in fields(SchedulerConfig)]


def parse_config_value(name: str, raw: Any) -> Any:
    """Parse ``raw`` (a string from the command line) as SchedulerConfig field ``name``.

    The field's default says what type it has: a bool default takes
    true/false, an int or float default a number, a None default an int,
    a float or ``none``, anything else (``Literal`` strings) the string.
    """
    if not isinstance(raw, str):
        return raw
    default = next(f.default for f in fields(SchedulerConfig) if f.name == name)
    text = raw.strip()
    if text.lower() in ("none", "null"):
        return None
    if isinstance(default, bool):
        return _parse_bool(text)
    if isinstance(default, int) or default is MISSING:
        return int(text)
    if isinstance(default, float):
        return float(text)
    if default is None:
        for parse in (int, float):
            try:
                return parse(text)
            except ValueError:
                pass
    return text


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes", "y", "on"):
        return True
    if lowered in ("false", "0", "no", "n", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean")


def apply_setting(spec: SimSpec, key: str, raw: Any) -> SimSpec:
    """``spec`` with ``key`` set to ``raw``; ValueError for an unknown key or bad value."""
    try:
        if key in POOL_KEYS:
            value = None if str(raw).lower() == "none" else int(raw)
            return replace(spec, **{key: value})
        if key in config_field_names():
            return replace(spec, config={**spec.config, key: parse_config_value(key, raw)})
        if key in CostModel.field_names():
            return replace(spec, cost=spec.cost.with_values({key: raw}))
    except ValueError as exc:
        raise ValueError(f"{key}={raw}: {exc}") from None
    known = [*POOL_KEYS, *config_field_names(), *CostModel.field_names()]
    raise ValueError(f"unknown setting {key!r}; known: {', '.join(known)}")


def parse_assignment(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """``key=v1,v2,...`` -> (key, [v1, v2, ...])."""
    key, values = parse_assignment(text)
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not items:
        raise ValueError(f"sweep {text!r} has no values")
    return key, items


def expand_sweeps(
    base: SimSpec, sweeps: Sequence[tuple[str, Sequence[str]]]
) -> list[tuple[dict[str, str], SimSpec]]:
    """One ``(settings, spec)`` per combination; ``[({}, base)]`` with no sweep.

    Every combination is built (so validated) before anything runs: a typo
    in the last value fails at once, not after the first runs.
    """
    keys = [key for key, _ in sweeps]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a key is swept twice: {keys}")
    runs = []
    for combo in itertools.product(*(values for _, values in sweeps)):
        settings = dict(zip(keys, combo, strict=True))
        spec = base
        for key, value in settings.items():
            spec = apply_setting(spec, key, value)
        spec.scheduler_config()  # validate now (raises ConfigError)
        runs.append((settings, spec))
    return runs


def label(settings: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in settings.items()) or "base"
