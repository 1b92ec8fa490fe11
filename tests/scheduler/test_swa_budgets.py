"""The SWA pool's budgets (issue 29 item 3): one test per SGLang 0.5.23 formula.

The expected values are worked by hand from the reference's formulas
(sglang-retract-semantics.md §3.2, §5.2-5.5, §7.2; differences D15, D26, D30,
D32, D41-D43), written out beside each assertion. Pure core: no pool.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.core import AddDecision, AddResult, PrefillAdder, RequestTooLargeError
from scheduler_svc.core.swa_budget import (
    DecodeMemCheck,
    SwaPrefillGate,
    SwaSizes,
    SwaSpec,
    check_decode_mem,
    estimate_swa_kv_tokens,
    need_swa_single,
    prealloc_required_tokens,
    swa_allocatable_tokens,
    swa_retractable_len,
    swa_sizes_of,
    swa_spec_of,
    swa_tail_len,
)
from scheduler_svc.core.swa_intake import (
    check_swa_fits,
    swa_decode_peak_tokens,
)
from tests.scheduler.helpers import config, make_req

CONTINUE, NO_TOKEN, OTHER = AddResult.CONTINUE, AddResult.NO_TOKEN, AddResult.OTHER
W, PS = 128, 16


def spec(capacity: int = 1024, **kw) -> SwaSpec:
    return SwaSpec(
        sliding_window=kw.pop("window", W),
        capacity=capacity,
        page_size=kw.pop("page_size", PS),
        **kw,
    )


# -- _swa_tail_len / _swa_retractable_len ---------------------------------------


@pytest.mark.parametrize(
    ("seq_len", "tail"),
    [
        (0, 0),
        (100, 100),  # shorter than the window: all of it
        (128, 128),  # exactly W
        (130, 130),  # start 2, floored to page 0
        (150, 134),  # start 22 -> page start 16: 150 - 16
        (1000, 136),  # start 872 -> 864: 1000 - 864
    ],
)
def test_swa_tail_len(seq_len, tail):
    # L - floor_page(max(0, L - W))
    assert swa_tail_len(seq_len, W, PS) == tail


@pytest.mark.parametrize(
    ("seq_len", "window", "plain", "radix"),
    [
        (1000, 128, 136, 136),  # radix start 1000-1-128 = 871 -> 864, as plain
        (144, 128, 128, 144),  # plain start 16 -> 16; radix start 15 -> 0
        (145, 128, 129, 129),  # plain 17 -> 16; radix 16 -> 16
        (96, 8, 16, 32),  # W < page: plain 88 -> 80; radix 96-1-16 = 79 -> 64
    ],
)
def test_swa_tail_len_with_the_decode_radix_cache(seq_len, window, plain, radix):
    # D42: window_start = max(0, L - 1 - max(W, ps)), page floored
    assert swa_tail_len(seq_len, window, PS) == plain
    assert swa_tail_len(seq_len, window, PS, decode_radix_cache=True) == radix


def test_swa_tail_len_page_size_one_is_the_window():
    assert swa_tail_len(1000, W, 1) == 128
    assert swa_tail_len(10, W, 1) == 10


def test_swa_retractable_len():
    # _swa_tail_len(len(origin)) + len(output) = 136 + 50
    assert swa_retractable_len(1000, 50, spec()) == 186
    # full length without tail prealloc (page_size 1) or without an SWA pool
    assert swa_retractable_len(1000, 50, spec(page_size=1)) == 1050
    assert swa_retractable_len(1000, 50, None) == 1050


# -- the SWA reservation of an admission -------------------------------------------


def test_estimate_swa_kv_tokens():
    # max(allocated - W, 0) + min(extend + max_new, W) + page
    assert estimate_swa_kv_tokens(1000, 100, W, PS) == 872 + 128 + 16
    assert estimate_swa_kv_tokens(1000, 100, W, PS, allocation_limit=256) == 128 + 128 + 16
    assert estimate_swa_kv_tokens(64, 20, W, PS) == 0 + 84 + 16
    assert estimate_swa_kv_tokens(64, 20, 0, PS) == 64 + 20 + 16  # no window: everything


# -- check_decode_mem (D15) ----------------------------------------------------------


def test_check_decode_mem_single_pool_evicts_the_shortfall():
    # n = 32: evict 32 - 20 = 12; 20 + min(12, 100) = 32 >= 32
    assert check_decode_mem(32, 20, 100) == DecodeMemCheck(12, 0, True)
    # evictable 5: 25 < 32
    assert check_decode_mem(32, 20, 5) == DecodeMemCheck(12, 0, False)
    assert check_decode_mem(32, 40, 0) == DecodeMemCheck(0, 0, True)


def test_check_decode_mem_hybrid_evicts_both_shortfalls_and_needs_both_pools():
    # full: 20 + 12 evicted; SWA: 40 already >= 32
    assert check_decode_mem(32, 20, 100, SwaSizes(40, 0)) == DecodeMemCheck(12, 0, True)
    # SWA short by 22, only 15 evictable: min(32, 25) < 32
    assert check_decode_mem(32, 20, 100, SwaSizes(10, 15)) == DecodeMemCheck(12, 22, False)
    # SWA short by 22, 30 evictable: both reach 32
    assert check_decode_mem(32, 20, 100, SwaSizes(10, 30)) == DecodeMemCheck(12, 22, True)
    # the full pool alone short: fails though the SWA pool is fine
    assert check_decode_mem(32, 20, 0, SwaSizes(100, 0)) == DecodeMemCheck(12, 0, False)


# -- PrefillAdder's SWA gate (D26, D30, D32) -----------------------------------------------


def adder(
    available_swa: int,
    evictable_swa: int = 0,
    capacity: int = 1024,
    num_running_reqs: int = 1,
    **cfg,
) -> PrefillAdder:
    # One request running by default: its decoding may free SWA pages, so a shortfall is
    # transient (with none running and none admitted, admission does not wait: see below).
    gate = SwaPrefillGate(spec(capacity), SwaSizes(available_swa, evictable_swa))
    return PrefillAdder(
        config(page_size=PS, **cfg), 100_000, num_running_reqs=num_running_reqs, swa=gate
    )


def test_swa_gate_is_separate_from_the_full_budget():
    a = adder(500, 100)  # remaining_swa = 600
    # A: ceil_page(300) = 304: (304 - 128) + min(354, 128) + 16 = 320 < 600
    assert a.add_one_req(make_req("a", 300, max_new_tokens=50), 0) == AddDecision(CONTINUE, 300)
    assert a.swa.remaining_swa == 280
    # the full budget is charged as without the gate: 304 + 16 + 50
    assert a.remaining_total_tokens == 100_000 - 370
    # B: 208 -> 80 + 128 + 16 = 224 < 280
    assert a.add_one_req(make_req("b", 200, max_new_tokens=10), 0) == AddDecision(CONTINUE, 200)
    assert a.swa.remaining_swa == 56
    # C: 48 -> 0 + 58 + 16 = 74 >= 56, a transient shortfall: NO_TOKEN, nothing charged
    assert a.add_one_req(make_req("c", 40, max_new_tokens=10), 0) == AddDecision(NO_TOKEN, 0)
    assert a.swa.remaining_swa == 56 and len(a.admitted) == 2


def test_swa_gate_is_strict():
    # 48 -> 58 + 16 = 74: needs remaining_swa > 74
    assert adder(74).add_one_req(make_req("c", 40, max_new_tokens=10), 0).extend_len == 0
    assert adder(75).add_one_req(make_req("c", 40, max_new_tokens=10), 0).extend_len == 40


def test_budget_state_needs_remaining_swa():
    # has_capacity also requires remaining_swa > 0 (D26)
    assert adder(0).budget_state() is NO_TOKEN
    assert adder(0, 1).budget_state() is CONTINUE
    assert adder(0).add_one_req(make_req("a", 4, max_new_tokens=1), 0) == AddDecision(NO_TOKEN, 0)


def test_swa_gate_lowers_the_chunk_limit_of_a_request_that_never_fits():
    # capacity 512, 500 free; chunk 512: (512 - 128) + 128 + 16 = 528 >= 500 and >= 512:
    # never fits, so the chunk limit drops to floor_page(500 - (0 + 100 + 16)) = 384 (D30)
    a = adder(500, capacity=512, chunked_prefill_size=512)
    assert a.add_one_req(make_req("long", 2000, max_new_tokens=100), 0) == AddDecision(
        CONTINUE, 384
    )
    # the chunk reserves (384 - 128) + 128 + 16 = 400 SWA tokens, no output
    assert a.swa.remaining_swa == 100
    assert a.new_chunked_req is not None and a.rem_chunk_tokens == 512 - 384


def test_swa_gate_chunk_ends_on_a_page_boundary_of_the_sequence():
    # lowered limit 384, prefix 8: floor_page(8 + 384) - 8 = 376 (D30's absolute re-floor)
    a = adder(500, capacity=512, chunked_prefill_size=512)
    assert a.add_one_req(make_req("long", 2000, max_new_tokens=100), 8).extend_len == 376


def test_swa_gate_transient_shortfall_waits_rather_than_shrinking():
    # same request, capacity 2048: 528 >= 500 but < 2048: it waits (NO_TOKEN)
    a = adder(500, capacity=2048, chunked_prefill_size=512)
    assert a.add_one_req(make_req("long", 2000, max_new_tokens=100), 0) == AddDecision(NO_TOKEN, 0)


def test_swa_gate_without_chunking_cannot_shrink():
    a = adder(500, capacity=512)
    assert a.add_one_req(make_req("long", 2000, max_new_tokens=100), 0) == AddDecision(NO_TOKEN, 0)


@pytest.mark.parametrize(("chunk", "extend"), [(None, 40), (512, 16)])
def test_swa_gate_does_not_wait_with_nothing_running_and_nothing_admitted(chunk, extend):
    # a cached 16-token prefix (W 128 here: its pinned SWA tail 16) leaves remaining_swa 16;
    # its 40 new tokens reserve 0 + min(48 + 10, 128) + 16 = 74 >= 16, a shortfall nothing
    # running would ever free: no wait. Unchunked: whole (memsvc's allocation decides);
    # chunked: one page.
    a = adder(0, 32, capacity=64, num_running_reqs=0, chunked_prefill_size=chunk)
    a.lock_prefix(0, swa_pinned_tokens=16)
    assert a.swa.remaining_swa == 16
    d = a.add_one_req(make_req("b", 56, max_new_tokens=10), 16)
    assert d.extend_len == extend and len(a.admitted) == 1
    # the same with one running request, or after one admitted this round: it waits
    b = adder(0, 32, capacity=64, num_running_reqs=1, chunked_prefill_size=chunk)
    b.lock_prefix(0, swa_pinned_tokens=16)
    assert b.add_one_req(make_req("b", 56, max_new_tokens=10), 16) == AddDecision(NO_TOKEN, 0)


def in_progress(input_len: int, done: int):
    req = make_req("chunked", input_len=input_len, max_new_tokens=100)
    req.start_prefill(row=1, prefix_len=0, extend_len=done)
    req.complete_extend()
    return req


def chunk_adder(available_swa: int, req, num_running_reqs: int = 1) -> PrefillAdder:
    gate = SwaPrefillGate(spec(), SwaSizes(available_swa, 0))
    return PrefillAdder(
        config(page_size=PS, chunked_prefill_size=512),
        100_000,
        num_running_reqs=num_running_reqs,
        chunked_req=req,
        swa=gate,
    )


def test_in_progress_chunk_is_cut_by_the_swa_budget():
    # min(512, remaining_total, remaining_swa - page) = min(512, .., 100 - 16) = 84
    req = in_progress(2000, 512)
    a = chunk_adder(100, req)
    assert a.add_chunked_req(req).extend_len == 84


def test_in_progress_chunk_is_parked_by_the_swa_budget():
    # remaining_swa - page = 16 - 16 = 0: parked, returned unadmitted, nothing charged (D32)
    req = in_progress(2000, 512)
    a = chunk_adder(16, req)
    assert a.add_chunked_req(req) == AddDecision(CONTINUE, 0)
    assert a.admitted == [] and a.swa.remaining_swa == 16
    assert a.remaining_total_tokens == 100_000
    # the round may go on with the waiting requests
    assert a.add_one_req(make_req("w", 4, max_new_tokens=1), 0) == AddDecision(NO_TOKEN, 0)
    # and never makes a second chunked request while one is parked (were there room)
    a.swa.sizes = SwaSizes(10_000, 0)
    assert a.add_one_req(make_req("w2", 1000, max_new_tokens=1), 0) == AddDecision(OTHER, 0)
    assert a.add_one_req(make_req("w3", 40, max_new_tokens=1), 0) == AddDecision(CONTINUE, 40)


@pytest.mark.parametrize("available_swa", [0, 8, 16])
def test_in_progress_chunk_is_not_parked_with_nothing_running(available_swa):
    # nothing running: no decode would free SWA pages, so parking would wait forever. The
    # SWA budget leaves no page beside the rounding one: one page (memsvc frees the window's
    # pages before it allocates it; kvstack, sglang-differences rows 34, 35)
    req = in_progress(2000, 512)
    a = chunk_adder(available_swa, req, num_running_reqs=0)
    # (its reservation, 0 + 128 + 16, leaves the SWA budget spent: NO_TOKEN)
    assert a.add_chunked_req(req) == AddDecision(NO_TOKEN, PS)
    assert a.admitted[0].extend_len == PS


def test_chunk_with_nothing_running_and_no_total_budget_is_cut_to_the_swa_budget():
    # the total budget is gone (the chunk budget alone would decide: 512), the SWA budget
    # is not: the chunk is cut to remaining_swa - page = 200 - 16
    req = in_progress(2000, 512)
    gate = SwaPrefillGate(spec(), SwaSizes(200, 0))
    a = PrefillAdder(
        config(page_size=PS, chunked_prefill_size=512),
        0,
        num_running_reqs=0,
        chunked_req=req,
        swa=gate,
    )
    assert a.add_chunked_req(req).extend_len == 184


def test_pure_swa_model_bases_the_total_budget_on_the_swa_pool():
    gate = SwaPrefillGate(spec(all_swa=True), SwaSizes(300, 50))
    a = PrefillAdder(config(page_size=PS), 100_000, swa=gate)
    assert a.remaining_total_tokens == 350 and a.remaining_current_tokens == 350


def test_scratch_copy_does_not_charge_the_real_swa_gate():
    a = adder(500)
    sim = a.scratch()
    sim.add_one_req(make_req("a", 300, max_new_tokens=50), 0)
    assert sim.swa.remaining_swa == 180 and a.swa.remaining_swa == 500


def test_resumed_request_passes_the_swa_gate():
    # kv_len 299 -> 304: 176 + min(304 + 50, 128) + 16 = 320
    req = make_req("r", 300, max_new_tokens=50)
    assert not adder(320).add_resumed_req(req)
    a = adder(321)
    assert a.add_resumed_req(req) and a.swa.remaining_swa == 1


def test_no_swa_gate_keeps_the_single_pool_rule():
    a = PrefillAdder(config(page_size=PS), 1000)
    assert a.swa is None
    assert a.add_one_req(make_req("a", 300, max_new_tokens=50), 0) == AddDecision(CONTINUE, 300)
    assert a.remaining_total_tokens == 1000 - 370


# -- PD decode pre-allocation (D41, D42) ------------------------------------------------


def test_prealloc_required_tokens_page_ceils_then_adds_the_reserve():
    # full: ceil_page(1000) = 1008, + 512; SWA: tail 136 -> 144, + 512
    assert prealloc_required_tokens(1000, PS, 512, spec()) == (1520, 656)
    # radix cache off: no reserve on the SWA side
    assert prealloc_required_tokens(1000, PS, 512, spec(radix_cache=False)) == (1520, 144)
    # page_size 1: no tail prealloc, no ceiling
    assert prealloc_required_tokens(1000, 1, 512, spec(page_size=1)) == (1512, 1512)
    # not hybrid: the SWA requirement is the full one
    assert prealloc_required_tokens(1000, PS, 512) == (1520, 1520)


def test_need_swa_single():
    running = [(1000, 200), (300, 8192)]
    # max(136 + 200, (300 - 160) + min(8192, 4096)) - 400 = 4236 - 400
    assert need_swa_single(running, 400, spec(), 4096) == 3836
    assert need_swa_single(running, None, spec(), 4096) == 0
    assert need_swa_single([], 400, spec(), 4096) == 0


def test_swa_allocatable_tokens_growth_stops_at_the_window():
    s = spec(capacity=4096)
    # used 1096 >= 3 x 128: no growth left, so no reserve: 3000 + 200 - max(0, 100) - 656
    got = swa_allocatable_tokens(
        s,
        SwaSizes(3000, 200),
        n_active=3,
        reserved_per_req=512,
        need_single=100,
        retracted_swa_required=656,
    )
    assert got == 2444
    # used 96: growth 384 - 96 = 288 < R x 3 = 1536: 4000 + 200 - 288
    got = swa_allocatable_tokens(s, SwaSizes(4000, 200), n_active=3, reserved_per_req=512)
    assert got == 3912
    # growth larger than the reserve: the reserve (R x n) is kept back
    got = swa_allocatable_tokens(
        spec(capacity=4096, window=4096), SwaSizes(4000, 0), n_active=3, reserved_per_req=512
    )
    assert got == 4000 - 1536


# -- intake ------------------------------------------------------------------------


def test_decode_node_refuses_a_swa_requirement_over_the_swa_pool():
    # swa_required = 656 (above): > 640 refused, 656 fits (SGLang: swa_required > size_swa)
    with pytest.raises(RequestTooLargeError, match="SWA") as err:
        check_swa_fits(1000, spec(capacity=640), mode="decode", reserved=512)
    assert err.value.status_code == 400
    check_swa_fits(1000, spec(capacity=656), mode="decode", reserved=512)


def test_normal_node_refuses_what_admission_never_could():
    # chunking off: 1008 -> 880 + 128 + 16 = 1024 >= capacity 1024 (the gate is strict)
    with pytest.raises(RequestTooLargeError):
        check_swa_fits(1000, spec(capacity=1024), mode="normal")
    check_swa_fits(1000, spec(capacity=1025), mode="normal")
    # chunking on: the gate cuts a chunk to one page: 0 + 17 + 16 = 33
    with pytest.raises(RequestTooLargeError, match="need 33 SWA"):
        check_swa_fits(1000, spec(capacity=33), mode="normal", chunked_prefill_size=512)
    # and a page-sized chunk at s needs its pages from floor_page(s - page + 1 - W) on and
    # its own: 2 x 16 + ceil_page(127) = 160 (swa_chunk_progress_tokens)
    check_swa_fits(1000, spec(capacity=160), mode="normal", chunked_prefill_size=512)
    with pytest.raises(RequestTooLargeError, match="needs 160 SWA KV tokens at once"):
        check_swa_fits(1000, spec(capacity=144), mode="normal", chunked_prefill_size=512)
    # a short prompt never holds more than its positions up to the first decoded one
    check_swa_fits(20, spec(capacity=34), mode="normal", chunked_prefill_size=512)
    check_swa_fits(10**6, None, mode="normal")  # not hybrid: nothing


def test_normal_node_checks_the_output_admission_reserves():
    # admission reserves min(extend + max_new, W): 0 + min(16 + 100, 128) + 16 = 132 with
    # max_new 100, not the 0 + 17 + 16 = 33 of one token of output
    check_swa_fits(10, spec(capacity=50), mode="normal")
    with pytest.raises(RequestTooLargeError, match="need 132 SWA"):
        check_swa_fits(10, spec(capacity=132), mode="normal", max_new_tokens=100)
    check_swa_fits(10, spec(capacity=133), mode="normal", max_new_tokens=100)


# -- what the scheduler reads from memsvc -----------------------------------------------


def test_swa_numbers_from_memsvc():
    class Sizes:
        available, evictable, protected = 10, 0, 0

    assert swa_sizes_of(Sizes()) is None  # no SWA numbers: not hybrid
    Sizes.swa_available, Sizes.swa_evictable = 7, 3
    assert swa_sizes_of(Sizes()) == SwaSizes(7, 3)

    class Layout:
        is_hybrid, sliding_window, swa_capacity_tokens, page_size = True, W, 640, PS
        full_layer_ids = (0,)

    assert swa_spec_of(Layout()) == spec(capacity=640)
    Layout.full_layer_ids = ()
    assert swa_spec_of(Layout()).all_swa
    Layout.is_hybrid = False
    assert swa_spec_of(Layout()) is None and swa_spec_of(None) is None


# -- the intake of the scheduler service ------------------------------------------------


def generate(input_len: int, max_new: int = 16):
    from scheduler_svc import protocol as p

    return p.Generate(
        op="generate",
        op_id=1,
        rid="r",
        client="c",
        input_ids=np.arange(1, input_len + 1, dtype=np.int64),
        sampling={"max_new_tokens": max_new},
    )


@pytest.mark.parametrize(
    ("mode", "capacity", "refused"),
    [
        ("decode", 640, True),  # swa_required 656 > 640
        ("decode", 656, False),
        ("normal", 1024, True),  # 1024 >= 1024
        ("normal", 1025, False),
        ("prefill", 1024, True),  # a prefill node admits as a normal one does
    ],
)
def test_intake_refuses_a_request_over_the_swa_pool_with_400(mode, capacity, refused):
    from scheduler_svc.intake import new_req

    def admit():
        return new_req(
            generate(1000),
            list(range(1, 1001)),
            capacity=100_000,
            page_size=PS,
            mode=mode,
            stop_decoder=lambda ids: "",
            swa=spec(capacity=capacity),
            config=config(page_size=PS, num_reserved_decode_tokens=512),
        )

    if refused:
        with pytest.raises(RequestTooLargeError, match="SWA") as err:
            admit()
        assert err.value.status_code == 400
    else:
        req, _ = admit()
        assert req.sampling_params.max_new_tokens == (1 if mode == "prefill" else 16)


# -- properties of the gate ---------------------------------------------------------------

requests = st.lists(
    st.tuples(st.integers(1, 600), st.integers(0, 599), st.integers(1, 300)), min_size=1, max_size=8
)


@settings(max_examples=200, deadline=None)
@given(
    reqs=requests,
    available=st.integers(0, 2000),
    evictable=st.integers(0, 200),
    capacity=st.integers(64, 2048),
    chunk=st.sampled_from([None, 64, 256]),
)
def test_swa_gate_never_overdraws_and_a_refusal_changes_nothing(
    reqs, available, evictable, capacity, chunk
):
    gate = SwaPrefillGate(spec(capacity), SwaSizes(available, evictable))
    a = PrefillAdder(
        config(page_size=PS, chunked_prefill_size=chunk), 100_000, num_running_reqs=1, swa=gate
    )
    for i, (input_len, prefix, max_new) in enumerate(reqs):
        prefix = min(prefix, input_len - 1) // PS * PS
        before = (a.swa.remaining_swa, a.remaining_total_tokens, len(a.admitted))
        d = a.add_one_req(make_req(f"r{i}", input_len, max_new_tokens=max_new), prefix)
        if d.admitted:
            assert a.swa.remaining_swa >= 0
        else:
            assert (a.swa.remaining_swa, a.remaining_total_tokens, len(a.admitted)) == before
        if d.result is not CONTINUE:
            break


@settings(max_examples=200, deadline=None)
@given(reqs=requests, available=st.integers(0, 5000), chunk=st.sampled_from([None, 64, 256]))
def test_a_swa_pool_that_never_binds_changes_no_decision(reqs, available, chunk):
    # every reservation here is below 600 + 300 + 16 < 10**6: the gate never refuses
    gate = SwaPrefillGate(spec(10**6), SwaSizes(10**6, 0))
    with_gate = PrefillAdder(config(page_size=PS, chunked_prefill_size=chunk), available, swa=gate)
    without = PrefillAdder(config(page_size=PS, chunked_prefill_size=chunk), available)
    for i, (input_len, prefix, max_new) in enumerate(reqs):
        prefix = min(prefix, input_len - 1) // PS * PS
        req = make_req(f"r{i}", input_len, max_new_tokens=max_new)
        d = with_gate.add_one_req(req, prefix)
        assert d == without.add_one_req(req, prefix)
        if d.result is not CONTINUE:
            break
    assert with_gate.remaining_total_tokens == without.remaining_total_tokens


def test_a_prefix_lock_pins_swa_evictable_tokens():
    # SGLang reads swa_available + swa_evictable live, after the candidate's lock
    a = adder(50, 40)  # remaining_swa 90
    a.lock_prefix(0, swa_pinned_tokens=30)
    assert a.swa.remaining_swa == 60
    a.lock_prefix(0, swa_pinned_tokens=30)  # at most what is evictable
    assert a.swa.remaining_swa == 50
    # 48 -> 0 + 58 + 16 = 74 >= 50 now: refused, though 74 < 90 before the locks
    assert a.add_one_req(make_req("c", 40, max_new_tokens=10), 0) == AddDecision(NO_TOKEN, 0)


@pytest.mark.parametrize(("capacity", "refused"), [(132, True), (133, False)])
def test_intake_checks_the_swa_reservation_of_the_requested_output(capacity, refused):
    # 10 tokens, max_new 100: 0 + min(16 + 100, 128) + 16 = 132, what admission reserves
    # (with one token of output, 33, it was taken and then never admitted)
    from scheduler_svc.intake import new_req

    def admit():
        return new_req(
            generate(10, max_new=100),
            list(range(1, 11)),
            capacity=100_000,
            page_size=PS,
            mode="normal",
            stop_decoder=lambda ids: "",
            swa=spec(capacity=capacity),
            config=config(page_size=PS),
        )

    if refused:
        with pytest.raises(RequestTooLargeError, match="need 132 SWA") as err:
            admit()
        assert err.value.status_code == 400
    else:
        assert admit()[0].sampling_params.max_new_tokens == 100


def test_normal_node_refuses_what_decoding_alone_would_outgrow():
    # W 16, page 4, a 16-token SWA pool, a 14-token prompt, 6 new tokens: the decode step
    # of position 16 holds ceil_page(17) - floor_page(0) = 20 SWA slots > 16 (it aborted
    # with the out-of-memory 500 before intake checked it)
    small = spec(capacity=16, window=16, page_size=4)
    assert swa_decode_peak_tokens(14, 6, small) == 20
    with pytest.raises(RequestTooLargeError, match="up to 20 SWA KV tokens at once") as err:
        check_swa_fits(14, small, mode="normal", chunked_prefill_size=4, max_new_tokens=6)
    assert err.value.status_code == 400
    # 3 new tokens decode positions 14 and 15 only: ceil_page(16) - 0 = 16 fits
    assert swa_decode_peak_tokens(14, 3, small) == 16
    check_swa_fits(14, small, mode="normal", chunked_prefill_size=4, max_new_tokens=3)
    # past the window the peak repeats page by page: W 8, page 4 -> 12 at most
    assert swa_decode_peak_tokens(9, 500, spec(window=8, page_size=4)) == 12
    assert swa_decode_peak_tokens(9, 1, small) == 0  # no decode step
