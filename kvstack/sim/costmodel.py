"""How long the simulated worker takes: prefill, decode steps and KV copies.

The defaults are fitted to ``bench/model_step.py`` on this project's 2-core
CPU with the bundled tiny model (4 layers, 2 KV heads of 64, float32):

- prefill of one n-token prompt: 15.0k / 10.8k / 5.6k tokens/s at n = 512 /
  2048 / 8192. Attention makes a token cost more the more context it sees, so
  a prefill of ``k`` new tokens after a ``p``-token prefix is modelled as
  ``k / prefill_tok_per_s + prefill_s_per_token_context × Σ_{j<k} (p + j)``;
  a least-squares fit (relative error) gives 16.6k tokens/s and 2.93e-8 s
  (14.8k / 11.1k / 5.5k tokens/s back at the three points).
- decode step of a batch of b: 4.3 / 14.3 / 50.8 ms at b = 1 / 16 / 64
  (contexts of about 256 tokens), interpolated piecewise-linearly and
  extrapolated along the last segment; ``decode_s_per_context_token`` (0 by
  default: not measured) adds a term in the batch's total context.
- KV copies (offload / load): ``bytes_per_token`` (4096 for the tiny model)
  at ``copy_bytes_per_s`` (5 GB/s, a host memcpy; measure yours with
  ``bench/offload_bw.py``, or give PCIe figures for a GPU).

Any field can be replaced from a JSON file (``--cost FILE``) or a flag, e.g.
for a GPU: ``{"prefill_tok_per_s": 2e4, "decode_points": [[1, 0.012], [256, 0.03]]}``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

DecodePoints = tuple[tuple[int, float], ...]  # (batch size, seconds per step), ascending


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_tok_per_s: float = 16_600.0
    prefill_s_per_token_context: float = 2.93e-8
    decode_points: DecodePoints = ((1, 4.3e-3), (16, 14.3e-3), (64, 50.8e-3))
    decode_s_per_context_token: float = 0.0
    forward_overhead_s: float = 0.0  # per forward pass (prefill or decode), e.g. a launch
    copy_bytes_per_s: float = 5e9
    bytes_per_token: int = 4096
    memsvc_op_s: float = 0.0  # per memsvc round trip (0: in-process ops are free)

    def __post_init__(self) -> None:
        points = tuple((int(b), float(s)) for b, s in self.decode_points)
        object.__setattr__(self, "decode_points", points)
        problems = []
        if not points or any(b < 1 or s < 0 for b, s in points):
            problems.append("decode_points must be non-empty (batch >= 1, seconds >= 0)")
        elif any(b2 <= b1 for (b1, _), (b2, _) in itertools.pairwise(points)):
            problems.append("decode_points batch sizes must be strictly ascending")
        if self.prefill_tok_per_s <= 0 or self.copy_bytes_per_s <= 0:
            problems.append("prefill_tok_per_s and copy_bytes_per_s must be > 0")
        for name in (
            "prefill_s_per_token_context",
            "decode_s_per_context_token",
            "forward_overhead_s",
            "memsvc_op_s",
            "bytes_per_token",
        ):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0")
        if problems:
            raise ValueError("invalid cost model: " + "; ".join(problems))

    # -- costs -----------------------------------------------------------------

    def prefill_seconds(self, items: Sequence[tuple[int, int]]) -> float:
        """One extend pass over ``(prefix_len, extend_len)`` items."""
        seconds = self.forward_overhead_s
        for prefix_len, extend_len in items:
            context = extend_len * prefix_len + extend_len * (extend_len - 1) / 2
            seconds += (
                extend_len / self.prefill_tok_per_s + self.prefill_s_per_token_context * context
            )
        return seconds

    def decode_seconds(self, batch_size: int, total_context: int = 0) -> float:
        """One decode step of ``batch_size`` requests holding ``total_context`` tokens."""
        return (
            self.forward_overhead_s
            + _interpolate(self.decode_points, batch_size)
            + self.decode_s_per_context_token * total_context
        )

    def copy_seconds(self, num_tokens: int) -> float:
        """Offloading or loading ``num_tokens`` tokens of KV."""
        return num_tokens * self.bytes_per_token / self.copy_bytes_per_s

    # -- building --------------------------------------------------------------

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def with_values(self, values: Mapping[str, Any]) -> CostModel:
        """A copy with ``values`` replaced (strings parsed); unknown names raise ValueError."""
        unknown = sorted(set(values) - set(self.field_names()))
        if unknown:
            raise ValueError(f"unknown cost model fields {unknown}; known: {self.field_names()}")
        return replace(self, **{k: _coerce(k, v) for k, v in values.items()})

    @classmethod
    def from_json(cls, path: str | Path, base: CostModel | None = None) -> CostModel:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a cost model file holds one JSON object")
        return (base or cls()).with_values(data)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def parse_decode_points(text: str) -> DecodePoints:
    """``"1:4.3,16:14.3,64:50.8"`` (batch:milliseconds) -> ((1, 0.0043), ...)."""
    points = []
    for part in text.split(","):
        batch, _, ms = part.partition(":")
        if not ms:
            raise ValueError(f"decode point {part!r} is not BATCH:MS")
        points.append((int(batch), float(ms) / 1000.0))
    return tuple(points)


def _coerce(name: str, value: Any) -> Any:
    if name == "decode_points":
        return parse_decode_points(value) if isinstance(value, str) else value
    if name == "bytes_per_token":
        return int(value)
    return float(value)


def _interpolate(points: DecodePoints, x: int) -> float:
    """Piecewise-linear through ``points``, extended along the first/last segment."""
    if len(points) == 1:
        return points[0][1]
    segments = list(itertools.pairwise(points))
    (x0, y0), (x1, y1) = next((seg for seg in segments if x <= seg[1][0]), segments[-1])
    slope = (y1 - y0) / (x1 - x0)
    return max(y0 + slope * (x - x0), 0.0)


@dataclass(slots=True)
class SimClock:
    """Simulated seconds, where they went, and the last charge of each kind."""

    now: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    copy_s: float = 0.0
    memsvc_s: float = 0.0
    last_s: dict[str, float] = field(default_factory=dict)

    def charge(self, kind: str, seconds: float) -> None:
        """Advance the clock by ``seconds`` of ``kind`` (prefill, decode, copy, memsvc)."""
        self.now += seconds
        setattr(self, f"{kind}_s", getattr(self, f"{kind}_s") + seconds)
        self.last_s[kind] = seconds

    def wait_until(self, t: float) -> None:
        """Idle until ``t`` (the next arrival); never goes back."""
        self.now = max(self.now, t)
