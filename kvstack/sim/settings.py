"""What one simulation runs with (:class:`SimSpec`), and ``--set`` / ``--sweep`` on it.

A setting ``key=value`` goes, by key, to the first of:

1. the pool (:data:`POOL_KEYS`: ``pool_tokens``, ``page_size``, ..., and a
   hybrid model's ``sliding_window``, ``swa_layers``, ``num_layers``,
   ``swa_full_tokens_ratio``);
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

POOL_KEYS = (
    "pool_tokens",
    "page_size",
    "max_running_requests",
    "host_store_tokens",
    "sliding_window",
    "swa_layers",
    "num_layers",
)
FLOAT_POOL_KEYS = ("swa_full_tokens_ratio",)
DEFAULT_SWA_FULL_TOKENS_RATIO = 0.8  # SGLang's --swa-full-tokens-ratio


@dataclass(frozen=True)
class SimSpec:
    """The stack under simulation: pool geometry, scheduler overrides, costs, checks.

    ``host_store_tokens`` (None: as many as the pool) sizes memsvc's host
    store, which offload-mode retracts need. ``check_tokens`` makes the
    worker verify KV slots and the runner verify every output (slower).

    A hybrid (sliding-window) model: ``sliding_window`` W > 0 makes
    ``swa_layers`` of its ``num_layers`` layers windowed (the rest full
    attention), and memsvc's pool two pools, as ``memsvc --layer-types`` does:
    ``pool_tokens`` is then the bytes of that many tokens of every layer, split
    into a full and an SWA pool by ``swa_full_tokens_ratio`` (SGLang's sizing);
    the engine budgets both with SGLang's SWA rules.
    """

    pool_tokens: int = 200_000
    page_size: int = 16
    max_running_requests: int = 256
    host_store_tokens: int | None = None
    sliding_window: int = 0
    swa_layers: int = 5
    num_layers: int = 6
    swa_full_tokens_ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO
    config: dict[str, Any] = field(default_factory=dict)
    cost: CostModel = field(default_factory=CostModel)
    check_tokens: bool = False
    keep_outputs: bool = False

    @property
    def is_hybrid(self) -> bool:
        return self.sliding_window > 0

    def layer_types(self) -> tuple[str, ...]:
        """The simulated model's ``layer_types``: its full layers first, then the windowed."""
        if not 1 <= self.swa_layers <= self.num_layers:
            raise ValueError(
                f"swa_layers={self.swa_layers}: must be 1 to num_layers ({self.num_layers})"
            )
        full = self.num_layers - self.swa_layers
        return ("full_attention",) * full + ("sliding_attention",) * self.swa_layers

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
        if key in FLOAT_POOL_KEYS:
            return replace(spec, **{key: float(raw)})
        if key in config_field_names():
            return replace(spec, config={**spec.config, key: parse_config_value(key, raw)})
        if key in CostModel.field_names():
            return replace(spec, cost=spec.cost.with_values({key: raw}))
    except ValueError as exc:
        raise ValueError(f"{key}={raw}: {exc}") from None
    known = [*POOL_KEYS, *FLOAT_POOL_KEYS, *config_field_names(), *CostModel.field_names()]
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
