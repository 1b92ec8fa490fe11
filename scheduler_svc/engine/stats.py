"""The engine's counters and gauges (``info``'s ``stats``, the Prometheus metrics).

Work done and time spent per kind of work, what retract cost and where its
victims' KV went, and SGLang's scheduler gauges: the last prefill batch's
prefix-cache hit rate and the decode throughput over a window of passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GEN_THROUGHPUT_PASSES = 40  # SGLang's decode_log_interval


@dataclass
class EngineStats:
    forward_passes: int = 0
    # Batch composition: passes of each kind, and the requests they carried in all
    # (a pass's mean batch is reqs / passes).
    prefill_passes: int = 0
    prefill_pass_reqs: int = 0
    decode_passes: int = 0
    decode_pass_reqs: int = 0
    retract_events: int = 0
    retracted_reqs: int = 0
    retracted_input_tokens: int = 0
    retracted_output_tokens: int = 0
    reprefilled_tokens: int = 0
    offloaded_reqs: int = 0  # victims whose KV went to the host store
    offloaded_tokens: int = 0
    loaded_reqs: int = 0  # ... and came back from it
    loaded_tokens: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    aborted_reqs: int = 0
    finished_reqs: int = 0
    # The overlap schedule: decode steps whose slots were reserved while the previous
    # step ran, and reserved slots given back before a retract (or a round short of room).
    reserved_ahead_steps: int = 0
    dropped_ahead_reqs: int = 0
    last_retracted_reqs: int = 0  # the num_retracted_reqs gauge
    last_ratio_after_retract: float | None = None
    # Wall seconds in each kind of work (where a retract's cost goes). A prefill batch
    # mixing first prefills and re-prefills is split between them by token share.
    prefill_s: float = 0.0
    reprefill_s: float = 0.0  # part of prefill_s
    decode_s: float = 0.0
    retract_s: float = 0.0  # memsvc's retract, offload copies included
    load_s: float = 0.0  # host-store loads on re-admission
    # Hierarchical cache: victims retracted into the tree's host tier, and admitted prefix
    # hits that memsvc loaded from the host / disk tier (re-admissions too).
    tree_retracted_reqs: int = 0
    tree_retracted_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    # ... and admissions undone because such a load failed (a lost or damaged storage page):
    # each matched again, the shorter prefix now, and recomputed the rest.
    cut_prefix_reqs: int = 0
    # SGLang's scheduler gauges (scheduler_svc.metrics): the last prefill batch's prefix-cache
    # hit rate (re-prefills of retracted requests left out), and the decode tokens per second
    # over the last GEN_THROUGHPUT_PASSES decode passes, measured at gen_throughput_at.
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (first admissions)
    last_cache_hit_rate: float = 0.0
    last_gen_throughput: float = 0.0
    gen_throughput_at: float | None = None  # time.monotonic()
    decode_window: tuple[float, int, int] | None = None  # (start, passes, tokens)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def note_prefill(self, hit_tokens: int, computed_tokens: int) -> None:
        self.cached_tokens += hit_tokens
        total = hit_tokens + computed_tokens
        self.last_cache_hit_rate = hit_tokens / total if total else 0.0

    def note_decode(self, num_tokens: int, now: float) -> None:
        start, passes, tokens = self.decode_window or (now, 0, 0)
        passes, tokens = passes + 1, tokens + num_tokens
        if passes >= GEN_THROUGHPUT_PASSES and now > start:
            self.last_gen_throughput = tokens / (now - start)
            self.gen_throughput_at = now
            start, passes, tokens = now, 0, 0
        self.decode_window = (start, passes, tokens)
