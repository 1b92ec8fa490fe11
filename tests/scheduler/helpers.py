"""Small builders shared by the scheduler-core tests."""

from __future__ import annotations

from scheduler_svc.core import Req, SamplingParams, SchedulerConfig


def make_req(
    rid: str = "r",
    input_len: int = 8,
    output_len: int = 0,
    max_new_tokens: int = 128,
    *,
    priority: int | None = None,
    ignore_eos: bool = False,
    stop_token_ids: frozenset[int] = frozenset(),
) -> Req:
    """A WAITING request with ``input_len`` prompt tokens and ``output_len`` already generated."""
    return Req(
        rid=rid,
        origin_input_ids=list(range(1, input_len + 1)),
        output_ids=[1000 + i for i in range(output_len)],
        sampling_params=SamplingParams(
            max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids
        ),
        priority=priority,
    )


def running_req(rid: str, input_len: int, output_len: int, max_new_tokens: int, **kw) -> Req:
    """A RUNNING request that has generated ``output_len >= 1`` tokens."""
    req = make_req(rid, input_len, 0, max_new_tokens, **kw)
    req.start_prefill(row=1, prefix_len=0, extend_len=input_len)
    req.complete_extend()
    req.append_token(2000)
    req.start_decode()
    for i in range(output_len - 1):
        req.append_token(2001 + i)
    return req


def config(**overrides) -> SchedulerConfig:
    fields: dict = dict(page_size=4, max_running_requests=64)
    fields.update(overrides)
    return SchedulerConfig(**fields)
