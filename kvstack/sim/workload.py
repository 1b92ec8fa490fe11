"""Workloads: seeded synthetic ones, or a JSONL trace.

A workload is a list of :class:`RequestSpec` sorted by arrival. Lengths are
drawn from a :class:`LengthDist` written as a short spec string:

=====================  =========================================
``256``                always 256
``uniform:64:512``     uniform integer in [64, 512]
``normal:256:64``      normal (mean, std), rounded
``lognormal:256:0.8``  lognormal with this median and sigma
``exp:128``            exponential with this mean
``choice:64,512,2048`` one of these, equally likely
=====================  =========================================

Every length is at least 1. Arrivals: Poisson at ``rate`` requests/s, or all
at t=0 when ``rate`` is None (a burst: the pool is under pressure at once).

A trace is one JSON object per line: ``{"arrival": s, "input_len": n,
"output_len": m}`` and optionally ``"max_new_tokens"`` (default
``output_len``). ``output_len`` is what the request really generates (the
last token is EOS when it is below ``max_new_tokens``); ``max_new_tokens`` is
what the scheduler reserves for, so ``max_new_tokens > output_len`` is the
case where the new-token ratio matters.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstack.sim.worker import VOCAB


@dataclass(frozen=True, slots=True)
class RequestSpec:
    rid: str
    arrival: float  # simulated seconds
    input_len: int
    output_len: int  # tokens actually generated (EOS included when it ends early)
    max_new_tokens: int

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1 or self.arrival < 0:
            raise ValueError(f"request {self.rid}: need input_len, output_len >= 1, arrival >= 0")
        if self.max_new_tokens < self.output_len:
            raise ValueError(f"request {self.rid}: max_new_tokens < output_len")

    @property
    def stops_early(self) -> bool:
        return self.output_len < self.max_new_tokens


@dataclass(frozen=True, slots=True)
class LengthDist:
    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        kind, _, rest = spec.partition(":")
        if not rest:
            return cls("const", (float(kind),))
        sep = "," if kind == "choice" else ":"
        params = tuple(float(p) for p in rest.split(sep))
        arity = {"uniform": 2, "normal": 2, "lognormal": 2, "exp": 1}
        if kind != "choice" and arity.get(kind) != len(params):
            raise ValueError(f"bad length distribution {spec!r} (see kvstack.sim.workload)")
        return cls(kind, params)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        p = self.params
        if self.kind == "const":
            values = np.full(n, p[0])
        elif self.kind == "uniform":
            values = rng.integers(int(p[0]), int(p[1]) + 1, size=n)
        elif self.kind == "normal":
            values = rng.normal(p[0], p[1], size=n)
        elif self.kind == "lognormal":
            values = rng.lognormal(math.log(p[0]), p[1], size=n)
        elif self.kind == "exp":
            values = rng.exponential(p[0], size=n)
        else:
            values = rng.choice(np.array(p), size=n)
        return np.maximum(np.rint(values), 1).astype(np.int64)


def synthetic(
    num_requests: int,
    *,
    input_len: str = "uniform:128:1024",
    output_len: str = "uniform:32:512",
    rate: float | None = None,
    max_new_factor: float = 1.0,
    seed: int = 0,
) -> list[RequestSpec]:
    """``num_requests`` seeded requests; ``max_new_tokens = ceil(output_len × max_new_factor)``."""
    if max_new_factor < 1:
        raise ValueError("max_new_factor must be >= 1 (a request cannot outrun its limit)")
    rng = np.random.default_rng(seed)
    inputs = LengthDist.parse(input_len).sample(rng, num_requests)
    outputs = LengthDist.parse(output_len).sample(rng, num_requests)
    if rate is None:
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / rate, size=num_requests))
    return [
        RequestSpec(f"r{i}", float(t), int(n), int(m), math.ceil(int(m) * max_new_factor - 1e-9))
        for i, (t, n, m) in enumerate(zip(arrivals, inputs, outputs, strict=True))
    ]


def load_trace(path: str | Path) -> list[RequestSpec]:
    """Read a JSONL trace (blank lines and ``#`` comments skipped), sorted by arrival."""
    specs = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            obj = json.loads(line)
            output_len = int(obj["output_len"])
            specs.append(
                RequestSpec(
                    str(obj.get("rid", f"t{lineno}")),
                    float(obj["arrival"]),
                    int(obj["input_len"]),
                    output_len,
                    int(obj.get("max_new_tokens", output_len)),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: {exc}") from None
    return sorted(specs, key=lambda s: s.arrival)


def prompt_tokens(spec: RequestSpec, seed: int = 0, shared_prefix: Iterable[int] = ()) -> list[int]:
    """The prompt of ``spec``: ``shared_prefix`` then tokens seeded by (seed, rid)."""
    prefix = list(shared_prefix)[: spec.input_len]
    rng = np.random.default_rng([seed, _rid_key(spec.rid)])
    rest = rng.integers(0, VOCAB, size=spec.input_len - len(prefix))
    return prefix + rest.tolist()


def _rid_key(rid: str) -> int:
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little")
