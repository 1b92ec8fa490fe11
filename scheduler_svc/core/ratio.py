"""NewTokenRatioTracker: how much of their remaining output running requests reserve.

Admission charges each running request ``ratio × min(max_new − generated,
clip)``. The ratio starts at ``init``, decays linearly to ``min`` over
``decay_steps`` clean decode steps (the batch turned out to need less than
feared), is raised back after a retract to what the surviving batch actually
needs, and returns to ``init`` when the scheduler is idle::

    init = min(SGLANG_INIT_NEW_TOKEN_RATIO × schedule_conservativeness, 1)
    min  = min(init × SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR, 1)
    decay per clean decode step = (init − min) / SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
    after a retract: min(1, (Σ len(output_ids) + SGLANG_RETRACT_DECODE_STEPS × n)
                            / (Σ max_new_tokens + 1))      over the n requests kept

The after-retract value is assigned as is, with no lower clamp (SGLang 0.5.23):
it may sit below ``min`` until the next decay step lifts it back to ``min``.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import Req


class NewTokenRatioTracker:
    def __init__(
        self,
        init_ratio: float,
        min_ratio_factor: float,
        decay_steps: int,
        retract_decode_steps: int,
        schedule_conservativeness: float = 1.0,
    ) -> None:
        if decay_steps < 1:
            raise ValueError(f"decay_steps must be >= 1, got {decay_steps}")
        self.init_ratio = min(init_ratio * schedule_conservativeness, 1.0)
        self.min_ratio = min(self.init_ratio * min_ratio_factor, 1.0)
        self.decay = (self.init_ratio - self.min_ratio) / decay_steps
        self.retract_decode_steps = retract_decode_steps
        self.current = self.init_ratio

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> NewTokenRatioTracker:
        return cls(
            init_ratio=config.init_new_token_ratio,
            min_ratio_factor=config.min_new_token_ratio_factor,
            decay_steps=config.new_token_ratio_decay_steps,
            retract_decode_steps=config.retract_decode_steps,
            schedule_conservativeness=config.schedule_conservativeness,
        )

    def decay_step(self) -> float:
        """A decode step ran without retracting: lower the ratio one notch, not below ``min``."""
        self.current = max(self.current - self.decay, self.min_ratio)
        return self.current

    def reset(self) -> None:
        """The scheduler is fully idle: start again from ``init``."""
        self.current = self.init_ratio

    def estimate_after_retract(self, kept: Iterable[Req]) -> float:
        """The ratio the surviving batch needs; ``max_new_tokens`` raw, not clipped.

        With nothing kept (the last request was aborted) this is 0.0, as in SGLang.
        """
        kept = list(kept)
        num_decoded = sum(len(r.output_ids) for r in kept)
        num_max_new = sum(r.sampling_params.max_new_tokens for r in kept)
        estimate = (num_decoded + self.retract_decode_steps * len(kept)) / (num_max_new + 1)
        return min(1.0, estimate)

    def on_retract(self, kept: Iterable[Req]) -> float:
        """Assign the after-retract estimate (may go up or down; no lower clamp)."""
        self.current = self.estimate_after_retract(kept)
        return self.current

    def __repr__(self) -> str:
        return (
            f"NewTokenRatioTracker(current={self.current:.4f}, init={self.init_ratio}, "
            f"min={self.min_ratio}, decay={self.decay})"
        )
