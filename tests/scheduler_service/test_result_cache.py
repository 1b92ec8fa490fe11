"""The scheduler's cache of finished results is bounded in bytes (issue 26, item 9).

At e09ed5e it kept the last 1,024 results whatever their size: 60 requests with
prompt logprobs (4,000 tokens, top 20) took the scheduler from 58 to 749 MB, and
it stayed there. Here results like those (scaled down) go through the service's
reply path with the bound lowered, and what the cache keeps is measured with
tracemalloc: at most the bound and the newest result, never every result.
"""

from __future__ import annotations

import time
import tracemalloc
from types import SimpleNamespace

from model_svc.tokenizer import ByteTokenizer
from scheduler_svc import service as service_module
from scheduler_svc.core import FinishLength, Req
from scheduler_svc.service import SchedulerService, Waiter

BOUND = 1 << 20
PROMPT_LEN = 1000
TOP = 20


def _service() -> SchedulerService:
    return SchedulerService(
        SimpleNamespace(),  # the reply path never touches the engine
        "ipc:///nonexistent/kvstack-result-cache.sock",
        tokenizer=ByteTokenizer(),
        capacity=4096,
        page_size=4,
        max_context_len=4096,
        vocab_size=256,
    )


def _finish(service: SchedulerService, rid: str) -> None:
    """``rid`` finishes with its prompt's logprobs, top 20, as a scoring request would."""
    req = Req(rid, [(i % 250) + 1 for i in range(PROMPT_LEN)])
    req.return_logprob, req.logprob_start_len, req.top_logprobs_num = True, 0, TOP
    req.output_ids = [7]
    state = req.logprob
    state.input_vals = [None] + [-0.5] * (PROMPT_LEN - 1)
    state.input_tops = [None] + [[(-0.25, t) for t in range(TOP)]] * (PROMPT_LEN - 1)
    state.input_done = True
    state.output_vals, state.output_tops = [-0.5], [[(-0.25, t) for t in range(TOP)]]
    req.finish_reason = FinishLength(1)
    service._waiters[rid] = Waiter(b"peer", 1, False, time.monotonic(), 0, "print", "client")
    service._emit(req, True)
    while not service._outbox.empty():  # sent: what stays is the cache's
        service._outbox.get_nowait()


def test_finished_results_are_kept_within_the_byte_bound(monkeypatch) -> None:
    monkeypatch.setattr(service_module, "RESULT_CACHE_BYTES", BOUND, raising=False)
    service = _service()
    _finish(service, "warm-up")  # first-use allocations out of the measurement
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(30):
            _finish(service, f"r{i}")
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # one result is ~0.3 MB as msgpack and ~2 MB as Python lists: 30 of them, unbounded,
    # are tens of MB; bounded, the bound and the newest one
    assert kept < 4 * BOUND, f"{kept / 2**20:.1f} MiB kept for 30 results"


def test_the_bound_is_in_the_schedulers_help() -> None:
    from scheduler_svc.__main__ import build_parser

    text = build_parser().format_help()
    assert "--result-cache-bytes" in text
