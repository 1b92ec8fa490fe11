"""Req: the checked state machine, retract reset, finish checks."""

from __future__ import annotations

import pytest

from scheduler_svc.core import (
    FinishAbort,
    FinishLength,
    FinishMatchedToken,
    IllegalTransitionError,
    Req,
    ReqState,
    SamplingParams,
    decode_tokens_required,
)
from scheduler_svc.core.request import TRANSITIONS
from tests.scheduler.helpers import make_req, running_req


def test_whole_prefill_then_decode():
    req = make_req(input_len=10, max_new_tokens=5)
    assert req.state is ReqState.WAITING
    req.start_prefill(row=3, prefix_len=4, extend_len=6)
    assert (req.state, req.row, req.prefix_len, req.extend_len, req.kv_len) == (
        ReqState.PREFILLING,
        3,
        4,
        6,
        4,
    )
    assert req.is_chunked is False
    assert req.cached_tokens == 4
    assert req.first_scheduled_time is not None
    assert req.complete_extend() is True
    assert req.kv_len == 10
    req.append_token(7)
    assert req.output_ids == [7]
    assert req.kv_len == 10  # the new token's KV is written by the first decode step
    assert req.check_finished() is False
    req.start_decode()
    assert req.state is ReqState.RUNNING
    assert decode_tokens_required([req.kv_len], page_size=5) == 5
    req.append_token(8)
    assert (req.kv_len, req.output_ids, req.fill_ids[-2:]) == (11, [7, 8], [7, 8])
    assert req.first_token_time is not None


def test_chunked_prefill_bookkeeping():
    req = make_req(input_len=20)
    req.start_prefill(row=1, prefix_len=0, extend_len=8)
    assert req.is_chunked is True
    with pytest.raises(IllegalTransitionError, match="not completed"):
        req.continue_prefill(8)
    assert req.complete_extend() is False
    assert req.kv_len == 8
    with pytest.raises(IllegalTransitionError):
        req.append_token(1)  # no token is sampled mid-prefill
    with pytest.raises(IllegalTransitionError):
        req.start_decode()
    req.continue_prefill(8)
    assert (req.prefix_len, req.extend_len, req.kv_len) == (8, 8, 8)
    assert req.complete_extend() is False
    req.continue_prefill(4)
    assert req.is_chunked is False
    assert req.complete_extend() is True
    assert req.kv_len == 20
    assert req.cached_tokens == 0  # earlier chunks are not cache hits
    with pytest.raises(IllegalTransitionError, match="no chunk in progress"):
        req.continue_prefill(1)
    req.append_token(5)
    req.start_decode()
    assert req.state is ReqState.RUNNING


def test_chunk_past_the_end_is_refused():
    req = make_req(input_len=10)
    with pytest.raises(IllegalTransitionError, match="outside fill_ids"):
        req.start_prefill(row=1, prefix_len=4, extend_len=7)
    assert req.state is ReqState.WAITING


def test_a_request_moved_from_another_node_waits_retracted_then_resumes():
    """arrive_migrated: a waiting request with output so far becomes a retracted one
    (its KV on its way), keeping its retraction count; then it resumes as one."""
    req = make_req(input_len=6)
    req.output_ids.extend([7, 8, 9])
    req.arrive_migrated(retractions=2, cached_tokens=4)
    assert req.is_retracted and req.retraction_count == 2 and req.cached_tokens == 4
    req.resume(row=3)
    assert req.state is ReqState.RUNNING and req.kv_len == 8 and req.row == 3
    with pytest.raises(IllegalTransitionError, match="nothing to migrate"):
        make_req().arrive_migrated(retractions=0, cached_tokens=0)  # no output yet


@pytest.mark.parametrize(
    ("setup", "action"),
    [
        ("waiting", lambda r: r.start_decode()),
        ("running", lambda r: r.arrive_migrated(0, 0)),
        ("waiting", lambda r: r.reset_for_retract()),
        ("waiting", lambda r: r.append_token(1)),
        ("waiting", lambda r: r.complete_extend()),
        ("waiting", lambda r: r.resume(row=2)),
        ("running", lambda r: r.start_prefill(row=1, prefix_len=0, extend_len=1)),
        ("running", lambda r: r.start_decode()),
        ("retracted", lambda r: r.reset_for_retract()),
        ("retracted", lambda r: r.append_token(1)),
        ("finished", lambda r: r.abort("late", 500)),
        ("finished", lambda r: r.start_prefill(row=1, prefix_len=0, extend_len=1)),
        ("aborted", lambda r: r.abort("again", 500)),
        ("aborted", lambda r: r.start_prefill(row=1, prefix_len=0, extend_len=1)),
        ("aborted", lambda r: r.reset_for_retract()),
    ],
)
def test_illegal_transitions_raise_and_change_nothing(setup, action):
    req = {
        "waiting": lambda: make_req(),
        "running": lambda: running_req("r", 8, 2, 10),
        "retracted": lambda: _retracted(),
        "finished": lambda: _finished(),
        "aborted": lambda: _aborted(),
    }[setup]()
    before = (req.state, list(req.output_ids), req.kv_len, req.row, req.finish_reason)
    with pytest.raises(IllegalTransitionError):
        action(req)
    assert (req.state, req.output_ids, req.kv_len, req.row, req.finish_reason) == before


def _retracted() -> Req:
    req = running_req("r", 8, 2, 10)
    req.reset_for_retract()
    return req


def _finished() -> Req:
    req = running_req("r", 8, 1, 2)
    req.append_token(5)
    assert req.check_finished()
    return req


def _aborted() -> Req:
    req = make_req()
    req.abort("gone", 503)
    return req


def test_transition_table():
    S = ReqState
    expected = {
        # RUNNING: PD commit_transfer; RETRACTED: arrive_migrated (moved from another node)
        S.WAITING: {S.PREFILLING, S.RUNNING, S.RETRACTED, S.ABORTED},
        # WAITING / RETRACTED: unschedule, the pool had no room after all
        S.PREFILLING: {S.WAITING, S.PREFILLING, S.RUNNING, S.RETRACTED, S.FINISHED, S.ABORTED},
        S.RUNNING: {S.RETRACTED, S.FINISHED, S.ABORTED},
        S.RETRACTED: {S.PREFILLING, S.RUNNING, S.ABORTED},
        S.FINISHED: set(),
        S.ABORTED: set(),
    }
    assert dict(TRANSITIONS) == expected
    assert [s for s in S if s >= S.FINISHED] == [S.FINISHED, S.ABORTED]


def test_unschedule_puts_an_admitted_request_back_as_it_was():
    req = make_req("r", input_len=8)
    req.start_prefill(row=3, prefix_len=4, extend_len=4)
    assert req.cached_tokens == 4
    req.unschedule()
    assert (req.state, req.row, req.cached_tokens) == (ReqState.WAITING, None, 0)
    assert (req.prefix_len, req.extend_len, req.kv_len, req.already_computed) == (0, 0, 0, 0)
    assert not (req.is_chunked or req.extend_in_flight)
    req.start_prefill(row=3, prefix_len=4, extend_len=4)  # admitted again later
    assert req.cached_tokens == 4

    back = running_req("b", 8, 2, 10)
    back.reset_for_retract()
    back.start_prefill(row=2, prefix_len=8, extend_len=2)
    back.unschedule()
    assert (back.state, back.retraction_count, back.cached_tokens) == (ReqState.RETRACTED, 1, 0)
    with pytest.raises(IllegalTransitionError):
        back.unschedule()  # nothing in flight


def test_reset_for_retract_fields():
    req = make_req("r", input_len=8, max_new_tokens=50)
    req.start_prefill(row=4, prefix_len=4, extend_len=4)
    req.complete_extend()
    req.append_token(100)
    req.start_decode()
    req.append_token(101)
    req.append_token(102)
    queued_at = req.queue_entry_time
    req.reset_for_retract()
    assert req.state is ReqState.RETRACTED and req.is_retracted
    assert req.row is None
    assert (req.prefix_len, req.extend_len, req.kv_len, req.already_computed) == (0, 0, 0, 0)
    assert (req.is_chunked, req.extend_in_flight) == (False, False)
    assert req.retraction_count == 1
    assert req.retracted_stain is True
    assert req.output_ids == [100, 101, 102]  # kept: never re-streamed
    assert req.fill_ids == [*range(1, 9), 100, 101, 102]
    assert req.cached_tokens == 4
    assert req.retract_time is not None and req.queue_entry_time >= queued_at
    assert req.finish_reason is None

    # Re-prefill of origin + output: the hit is not counted again.
    req.start_prefill(row=2, prefix_len=8, extend_len=3)
    assert req.cached_tokens == 4
    assert req.is_retracted is False
    assert req.complete_extend() is True
    req.append_token(103)
    req.start_decode()
    assert req.kv_len == 11
    req.reset_for_retract()
    assert req.retraction_count == 2
    assert req.output_ids == [100, 101, 102, 103]


def test_retract_mid_chunk_for_pause():
    req = make_req(input_len=20)
    req.start_prefill(row=1, prefix_len=0, extend_len=8)
    req.complete_extend()
    req.reset_for_retract()
    assert (req.state, req.is_chunked, req.kv_len) == (ReqState.RETRACTED, False, 0)


def test_resume_after_pd_retract():
    req = running_req("r", input_len=8, output_len=3, max_new_tokens=10)
    req.reset_for_retract()
    req.resume(row=9)
    assert (req.state, req.row, req.kv_len) == (ReqState.RUNNING, 9, 10)
    req.append_token(7)
    assert req.kv_len == 11


def test_check_finished_on_length():
    req = running_req("r", input_len=4, output_len=2, max_new_tokens=3)
    assert req.check_finished() is False
    req.append_token(55)
    assert req.check_finished(eos_token_ids={55}) is True  # length wins over the EOS match
    assert req.state is ReqState.FINISHED
    assert req.finish_reason == FinishLength(3)
    assert req.finish_reason.to_json() == {"type": "length", "length": 3}
    assert req.finish_time is not None
    assert req.check_finished() is True  # idempotent once finished


def test_check_finished_on_stop_token_and_eos():
    req = running_req("r", 4, 1, 100, stop_token_ids=frozenset({9}))
    req.append_token(8)
    assert req.check_finished(eos_token_ids={2}) is False
    req.append_token(9)
    assert req.check_finished(eos_token_ids={2}) is True
    assert req.finish_reason.to_json() == {"type": "stop", "matched": 9}

    req = running_req("e", 4, 1, 100)
    req.append_token(2)
    assert req.check_finished(eos_token_ids={2}) is True
    assert req.finish_reason == FinishMatchedToken(2)


def test_ignore_eos_ignores_stop_tokens_but_not_length():
    req = running_req("r", 4, 1, 3, ignore_eos=True, stop_token_ids=frozenset({9}))
    req.append_token(9)
    assert req.check_finished(eos_token_ids={9}) is False
    req.append_token(2)
    assert req.check_finished(eos_token_ids={2}) is True
    assert req.finish_reason == FinishLength(3)


def test_first_token_can_finish_a_prefill():
    req = make_req(input_len=4, max_new_tokens=1)
    req.start_prefill(row=1, prefix_len=0, extend_len=4)
    req.complete_extend()
    req.append_token(3)
    assert req.check_finished() is True
    assert req.state is ReqState.FINISHED
    with pytest.raises(IllegalTransitionError):
        req.start_decode()


def test_check_finished_needs_a_token():
    with pytest.raises(IllegalTransitionError):
        make_req().check_finished()


@pytest.mark.parametrize("state", ["waiting", "running", "retracted"])
def test_abort(state):
    req = {
        "waiting": make_req,
        "running": lambda: running_req("r", 8, 2, 10),
        "retracted": _retracted,
    }[state]()
    row = req.row
    req.abort("Request waiting timeout reached.", 503)
    assert req.state is ReqState.ABORTED and req.is_finished
    assert req.row == row  # kept for the service to release
    assert req.finish_reason == FinishAbort("Request waiting timeout reached.", 503)
    assert req.finish_reason.to_json() == {
        "type": "abort",
        "message": "Request waiting timeout reached.",
        "status_code": 503,
    }


def test_request_validation():
    with pytest.raises(ValueError, match="empty prompt"):
        Req(rid="x", origin_input_ids=[])
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=-1)
    assert SamplingParams(stop_token_ids=[1, 2, 2]).stop_token_ids == frozenset({1, 2})


def test_commit_transfer_starts_decoding_with_the_prefill_token():
    req = make_req("r", input_len=8, max_new_tokens=50)
    req.commit_transfer(row=3, first_token=77, cached_tokens=4)
    assert req.state is ReqState.RUNNING
    assert (req.row, req.kv_len, req.output_ids, req.cached_tokens) == (3, 8, [77], 4)
    assert req.kv_len == req.seq_len - 1  # the next decode step writes token 77's KV
    with pytest.raises(IllegalTransitionError):
        req.commit_transfer(row=3, first_token=78)


def test_resume_from_host_clears_the_host_copy():
    req = make_req("r", input_len=8, max_new_tokens=50)
    req.commit_transfer(row=3, first_token=77)
    req.append_token(78)
    req.reset_for_retract()
    req.host_copy = True
    req.resume(row=5)
    assert (req.state, req.row, req.kv_len, req.host_copy) == (ReqState.RUNNING, 5, 9, False)
