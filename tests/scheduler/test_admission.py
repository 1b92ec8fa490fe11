"""PrefillAdder: the admission budget of one round."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.core import AddDecision, AddResult, PrefillAdder, ceil_page
from tests.scheduler.helpers import config, make_req, running_req

CONTINUE, NO_TOKEN, OTHER = AddResult.CONTINUE, AddResult.NO_TOKEN, AddResult.OTHER


def assert_budget(adder: PrefillAdder, total: float, current: int) -> None:
    assert adder.remaining_total_tokens == total
    assert adder.remaining_current_tokens == current


# -- whole requests -------------------------------------------------------------


def test_new_request_charges_paged_input_extra_page_and_max_new():
    adder = PrefillAdder(config(), available_tokens=1000)
    d = adder.add_one_req(make_req(input_len=10, max_new_tokens=100), prefix_len=0)
    assert d == AddDecision(CONTINUE, 10) and d.admitted
    # ceil_page(10) = 12, + one page (4), + 100 reserved output
    assert_budget(adder, total=1000 - 116, current=1000 - 16)
    assert adder.rem_input_tokens == 16384 - 12
    assert [(a.req.rid, a.prefix_len, a.extend_len) for a in adder.admitted] == [("r", 0, 10)]
    assert (adder.num_hit_tokens, adder.num_input_tokens) == (0, 10)


def test_prefix_hit_is_not_charged():
    adder = PrefillAdder(config(), available_tokens=1000)
    d = adder.add_one_req(make_req(input_len=20, max_new_tokens=10), prefix_len=8)
    assert d == AddDecision(CONTINUE, 12)
    assert_budget(adder, total=1000 - (12 + 4 + 10), current=1000 - 16)
    assert (adder.num_hit_tokens, adder.num_input_tokens) == (8, 12)


def test_extra_page_is_one_whole_page():
    adder = PrefillAdder(config(page_size=16), available_tokens=1000)
    adder.add_one_req(make_req(input_len=1, max_new_tokens=3), prefix_len=0)
    assert_budget(adder, total=1000 - (16 + 16 + 3), current=1000 - 32)


def test_max_new_tokens_is_clipped():
    adder = PrefillAdder(config(), available_tokens=100_000)
    adder.add_one_req(make_req(input_len=4, max_new_tokens=1_000_000), prefix_len=0)
    assert adder.remaining_total_tokens == 100_000 - (4 + 4 + 4096)


def test_retracted_request_charges_only_its_remaining_output():
    """Deliberately unlike SGLang, which checks with the remaining output but then
    reserves the whole max_new_tokens again (``readmit_charge="full"``): the generated
    tokens are recomputed as input, so reserving them as output too counts them twice
    (see docs/sglang-differences.md)."""
    req = make_req("back", input_len=8, output_len=6, max_new_tokens=20)
    req.start_prefill(row=1, prefix_len=0, extend_len=14)
    req.reset_for_retract()
    adder = PrefillAdder(config(), available_tokens=1000)
    d = adder.add_one_req(req, prefix_len=8)
    assert d == AddDecision(CONTINUE, 6)  # recompute the 6 generated tokens
    assert adder.remaining_total_tokens == 1000 - (8 + 4 + (20 - 6))
    assert (adder.num_reprocessed_hit_tokens, adder.num_reprocessed_input_tokens) == (8, 6)
    assert (adder.num_hit_tokens, adder.num_input_tokens) == (0, 0)


def test_no_token_for_the_first_request_that_would_overflow():
    adder = PrefillAdder(config(), available_tokens=300)
    reqs = [make_req(f"r{i}", input_len=10, max_new_tokens=100) for i in range(4)]
    assert adder.add_one_req(reqs[0], 0) == AddDecision(CONTINUE, 10)
    assert adder.add_one_req(reqs[1], 0) == AddDecision(CONTINUE, 10)
    assert_budget(adder, total=68, current=300 - 32)
    # 116 >= 68: refused, nothing charged.
    assert adder.add_one_req(reqs[2], 0) == AddDecision(NO_TOKEN, 0)
    assert_budget(adder, total=68, current=300 - 32)
    assert [a.req.rid for a in adder.admitted] == ["r0", "r1"]
    # A smaller request would still fit (the service stops at NO_TOKEN; the adder allows it).
    assert adder.add_one_req(make_req("small", input_len=4, max_new_tokens=50), 0).admitted


@pytest.mark.parametrize(("available", "admitted"), [(115, False), (116, False), (117, True)])
def test_no_token_boundary_is_strict(available, admitted):
    adder = PrefillAdder(config(), available_tokens=available)
    d = adder.add_one_req(make_req(input_len=10, max_new_tokens=100), 0)
    assert d == (AddDecision(CONTINUE, 10) if admitted else AddDecision(NO_TOKEN, 0))
    assert adder.remaining_total_tokens == (1 if admitted else available)


def test_running_requests_reserve_remaining_output_times_ratio():
    running = [
        running_req("a", input_len=8, output_len=50, max_new_tokens=200),  # 150 * 0.5
        running_req("b", input_len=8, output_len=1, max_new_tokens=10_000),  # 4096 * 0.5
    ]
    adder = PrefillAdder(config(), 5000, running, new_token_ratio=0.5)
    assert adder.running_reserved == 75 + 2048
    assert_budget(adder, total=5000 - 2123, current=5000)
    assert adder.num_running_reqs == 2


def test_running_ignore_eos_reserves_with_ratio_one():
    running = [
        running_req("a", input_len=8, output_len=40, max_new_tokens=100, ignore_eos=True),
        running_req("b", input_len=8, output_len=40, max_new_tokens=100),
    ]
    adder = PrefillAdder(config(), 1000, running, new_token_ratio=0.25)
    assert adder.running_reserved == 60 * 1.0 + 60 * 0.25
    assert adder.remaining_total_tokens == 1000 - 75


def test_running_reservations_can_exhaust_the_budget():
    running = [running_req("a", input_len=8, output_len=1, max_new_tokens=1001)]
    adder = PrefillAdder(config(), 500, running, new_token_ratio=0.5)
    assert adder.remaining_total_tokens == 0
    assert adder.budget_state() is NO_TOKEN
    assert adder.add_one_req(make_req(input_len=1, max_new_tokens=0), 0) == AddDecision(NO_TOKEN, 0)


# -- request and prefill-token caps ------------------------------------------------


def test_max_running_requests_gives_other():
    running = [running_req(f"run{i}", 8, 1, 10) for i in range(2)]
    adder = PrefillAdder(config(max_running_requests=3), 10_000, running, new_token_ratio=0.7)
    assert adder.num_free_request_slots == 1
    assert adder.add_one_req(make_req("a"), 0) == AddDecision(CONTINUE, 8)
    before = adder.remaining_total_tokens
    assert adder.add_one_req(make_req("b"), 0) == AddDecision(OTHER, 0)
    assert adder.remaining_total_tokens == before


def test_num_running_reqs_override_counts_against_the_cap():
    adder = PrefillAdder(config(max_running_requests=3), 10_000, num_running_reqs=3)
    assert adder.add_one_req(make_req(), 0) == AddDecision(OTHER, 0)


def test_first_request_may_exceed_the_prefill_cap():
    adder = PrefillAdder(config(max_prefill_tokens=32), available_tokens=10_000)
    assert adder.add_one_req(make_req("big", input_len=40, max_new_tokens=1), 0) == AddDecision(
        OTHER, 40
    )
    assert adder.rem_input_tokens == -8
    assert adder.add_one_req(make_req("next", input_len=1), 0) == AddDecision(OTHER, 0)


def test_prefill_cap_stops_later_requests():
    adder = PrefillAdder(config(max_prefill_tokens=32), available_tokens=10_000)
    assert adder.add_one_req(make_req("a", input_len=10), 0) == AddDecision(CONTINUE, 10)
    assert adder.rem_input_tokens == 20
    assert adder.add_one_req(make_req("b", input_len=20), 0) == AddDecision(OTHER, 0)  # 20 >= 20
    assert adder.add_one_req(make_req("c", input_len=17), 0) == AddDecision(OTHER, 0)  # ceil 20
    assert adder.add_one_req(make_req("d", input_len=15), 0) == AddDecision(CONTINUE, 15)
    assert adder.rem_input_tokens == 4


def test_prefix_len_must_leave_a_token():
    adder = PrefillAdder(config(), 1000)
    with pytest.raises(ValueError, match="prefix_len"):
        adder.add_one_req(make_req(input_len=8), prefix_len=8)


# -- chunked prefill ------------------------------------------------------------------


def test_long_request_is_chunked_to_the_chunk_budget():
    adder = PrefillAdder(config(chunked_prefill_size=16), available_tokens=1000)
    req = make_req(input_len=50, max_new_tokens=100)
    assert adder.add_one_req(req, 0) == AddDecision(OTHER, 16)  # chunk budget used up
    assert adder.new_chunked_req is req
    assert_budget(adder, total=1000 - (16 + 4), current=1000 - 20)  # no output reserved yet
    assert adder.rem_chunk_tokens == 0


def test_short_request_is_admitted_whole_with_chunking_on():
    adder = PrefillAdder(config(chunked_prefill_size=16), available_tokens=1000)
    # Admitted whole (ceil_page(13) = 16 fits the chunk budget), which that uses up.
    assert adder.add_one_req(make_req(input_len=13, max_new_tokens=7), 0) == AddDecision(OTHER, 13)
    assert adder.new_chunked_req is None
    assert adder.rem_chunk_tokens == 0
    assert adder.budget_state() is OTHER


def test_chunk_is_floored_to_whole_pages():
    adder = PrefillAdder(config(chunked_prefill_size=18), available_tokens=1000)
    assert adder.add_one_req(make_req(input_len=50), 0) == AddDecision(CONTINUE, 16)
    assert adder.rem_chunk_tokens == 2
    # Less than a page of chunk budget left: no chunk at all, nothing charged.
    before = adder.remaining_total_tokens
    assert adder.add_one_req(make_req("b", input_len=20), 0) == AddDecision(OTHER, 0)
    assert adder.remaining_total_tokens == before


def test_chunk_ends_on_a_page_boundary_of_the_sequence():
    adder = PrefillAdder(config(chunked_prefill_size=16), available_tokens=1000)
    d = adder.add_one_req(make_req(input_len=50), prefix_len=2)
    assert d == AddDecision(OTHER, 14)  # positions 2..16: the chunk ends at 16
    assert adder.rem_chunk_tokens == 0


def test_chunk_after_a_whole_request_uses_what_is_left():
    adder = PrefillAdder(config(chunked_prefill_size=32), available_tokens=1000)
    assert adder.add_one_req(make_req("a", input_len=5), 0) == AddDecision(CONTINUE, 5)
    assert adder.rem_chunk_tokens == 24
    d = adder.add_one_req(make_req("b", input_len=40), prefix_len=4)
    assert d == AddDecision(OTHER, 24)
    assert (4 + d.extend_len) % 4 == 0


def test_whole_request_that_does_not_fit_is_not_chunked():
    # The total check is on the whole request (52 + 4 + 1 >= 56), as in SGLang: no chunk of
    # it is admitted, though a 16-token chunk (charge 20) would fit.
    adder = PrefillAdder(config(chunked_prefill_size=16), available_tokens=56)
    assert adder.add_one_req(make_req(input_len=50, max_new_tokens=1), 0) == AddDecision(
        NO_TOKEN, 0
    )


def chunked(input_len: int, done: int, max_new_tokens: int = 100):
    req = make_req("chunked", input_len=input_len, max_new_tokens=max_new_tokens)
    req.start_prefill(row=1, prefix_len=0, extend_len=done)
    req.complete_extend()
    return req


def test_in_progress_chunk_middle_then_last():
    req = chunked(50, done=16)
    adder = PrefillAdder(config(chunked_prefill_size=16), 1000, chunked_req=req)
    assert adder.add_chunked_req(req) == AddDecision(OTHER, 16)
    assert adder.new_chunked_req is req
    assert adder.admitted[0] == (req, 16, 16)
    assert_budget(adder, total=1000 - 20, current=1000 - 20)

    req.continue_prefill(16)
    req.complete_extend()
    req.continue_prefill(16)
    req.complete_extend()  # 48 of 50 done
    adder = PrefillAdder(config(chunked_prefill_size=16), 1000, chunked_req=req)
    assert adder.add_chunked_req(req) == AddDecision(CONTINUE, 2)
    assert adder.new_chunked_req is None
    assert_budget(adder, total=1000 - (4 + 4 + 100), current=1000 - 8)
    assert adder.add_one_req(make_req("next", input_len=4), 0) == AddDecision(CONTINUE, 4)


@pytest.mark.parametrize(
    ("available", "expected_len"),
    [
        (1000, 16),  # the chunk budget binds
        (10, 10),  # the total budget binds, not floored to pages (SGLang)
        (3, 3),  # even under a page of it
        (0, 16),  # no budget at all: the chunk budget alone decides; it already holds KV
    ],
)
def test_in_progress_chunk_is_always_admitted(available, expected_len):
    req = chunked(50, done=16)
    adder = PrefillAdder(config(chunked_prefill_size=16), available, chunked_req=req)
    d = adder.add_chunked_req(req)
    assert d.extend_len == expected_len
    assert adder.remaining_total_tokens == available - (ceil_page(expected_len, 4) + 4)


def test_in_progress_last_chunk_with_no_total_budget_is_not_floored():
    # chunked_prefill_size 18 is not page-aligned: the last 17 tokens fit it and go in whole.
    req = chunked(33, done=16)
    adder = PrefillAdder(config(chunked_prefill_size=18), 0, chunked_req=req)
    assert adder.add_chunked_req(req) == AddDecision(NO_TOKEN, 17)
    assert adder.new_chunked_req is None


def test_in_progress_chunk_counts_against_max_running_requests():
    req = chunked(50, done=16)
    cfg = config(chunked_prefill_size=64, max_running_requests=1)
    adder = PrefillAdder(cfg, 10_000, chunked_req=req)
    assert adder.add_chunked_req(req) == AddDecision(CONTINUE, 34)
    assert adder.add_one_req(make_req(), 0) == AddDecision(OTHER, 0)


def test_in_progress_chunk_must_come_first():
    req = chunked(50, done=16)
    adder = PrefillAdder(config(chunked_prefill_size=16), 1000, chunked_req=req)
    with pytest.raises(ValueError, match="chunked request first"):
        adder.add_one_req(make_req(), 0)
    with pytest.raises(ValueError, match="chunked_req"):
        PrefillAdder(config(chunked_prefill_size=16), 1000).add_chunked_req(req)


# -- properties -------------------------------------------------------------------------

page_sizes = st.sampled_from([1, 4, 16])
requests = st.lists(
    st.tuples(
        st.integers(1, 600),  # input_len
        st.floats(0, 1),  # fraction of it hit in the cache
        st.integers(0, 6000),  # max_new_tokens
    ),
    max_size=25,
)
running_specs = st.lists(
    st.tuples(st.integers(1, 3000), st.integers(1, 3000), st.booleans()), max_size=5
)


def build_running(specs):
    out = []
    for i, (max_new, generated, ignore_eos) in enumerate(specs):
        out.append(
            running_req(f"run{i}", 4, min(generated, max_new), max_new, ignore_eos=ignore_eos)
        )
    return out


@settings(max_examples=300, deadline=None)
@given(
    page_size=page_sizes,
    available=st.integers(0, 20_000),
    ratio=st.floats(0, 1),
    running=running_specs,
    reqs=requests,
)
def test_property_no_token_exactly_when_the_request_would_overflow(
    page_size, available, ratio, running, reqs
):
    cfg = config(page_size=page_size, max_running_requests=1000, max_prefill_tokens=10**9)
    adder = PrefillAdder(cfg, available, build_running(running), new_token_ratio=ratio)
    budget = adder.remaining_total_tokens
    charged = num_admitted = 0
    for i, (input_len, hit, max_new) in enumerate(reqs):
        prefix = min(int(input_len * hit) // page_size * page_size, input_len - 1)
        extend = input_len - prefix
        charge = ceil_page(extend, page_size) + page_size + min(max_new, cfg.clip_max_new_tokens)
        before = adder.remaining_total_tokens
        d = adder.add_one_req(make_req(f"q{i}", input_len, 0, max_new), prefix)
        if charge >= before:
            assert d == AddDecision(NO_TOKEN, 0)
            assert adder.remaining_total_tokens == before
        else:
            assert d == AddDecision(CONTINUE, extend)
            assert adder.remaining_total_tokens == pytest.approx(before - charge, abs=1e-6)
            charged += charge
            num_admitted += 1
        assert charged <= max(budget, 0)
        assert adder.remaining_total_tokens <= adder.remaining_current_tokens
    assert len(adder.admitted) == num_admitted


@settings(max_examples=300, deadline=None)
@given(
    page_size=page_sizes,
    available=st.integers(0, 20_000),
    ratio=st.floats(0, 1),
    running=running_specs,
    reqs=requests,
    chunk_pages=st.one_of(st.none(), st.integers(1, 64)),
    max_prefill=st.integers(1, 4000),
    max_running=st.integers(1, 40),
)
def test_property_budget_never_overdrawn_with_chunks_and_caps(
    page_size, available, ratio, running, reqs, chunk_pages, max_prefill, max_running
):
    cfg = config(
        page_size=page_size,
        max_running_requests=max_running,
        max_prefill_tokens=max_prefill,
        chunked_prefill_size=None if chunk_pages is None else chunk_pages * page_size,
    )
    adder = PrefillAdder(cfg, available, build_running(running), new_token_ratio=ratio)
    budget = adder.remaining_total_tokens
    charged = 0
    for i, (input_len, hit, max_new) in enumerate(reqs):
        prefix = min(int(input_len * hit) // page_size * page_size, input_len - 1)
        extend = input_len - prefix
        whole = ceil_page(extend, page_size) + page_size + min(max_new, cfg.clip_max_new_tokens)
        before = (adder.remaining_total_tokens, adder.remaining_current_tokens, len(adder.admitted))
        d = adder.add_one_req(make_req(f"q{i}", input_len, 0, max_new), prefix)
        if not d.admitted:
            assert d.result is not CONTINUE
            assert before == (
                adder.remaining_total_tokens,
                adder.remaining_current_tokens,
                len(adder.admitted),
            )
            if d.result is NO_TOKEN:
                assert whole >= before[0]
            continue
        assert whole < before[0]  # admitted only if the whole request would fit
        assert 0 < d.extend_len <= extend
        if d.extend_len < extend:  # a chunk: whole pages, ending on a page boundary
            assert chunk_pages is not None
            assert adder.new_chunked_req is adder.admitted[-1].req
            assert (prefix + d.extend_len) % page_size == 0
            charged += ceil_page(d.extend_len, page_size) + page_size
        else:
            charged += whole
        assert d.result is adder.budget_state()
    assert charged == pytest.approx(budget - adder.remaining_total_tokens)
    assert charged <= max(budget, 0)
    assert len(adder.admitted) <= max(max_running - len(running), 0)


def test_running_requests_need_a_ratio():
    with pytest.raises(ValueError, match="new_token_ratio"):
        PrefillAdder(config(), 1000, [running_req("a", 8, 1, 10)])


def test_could_admit_is_a_safe_upper_bound():
    """could_admit is False only when add_one_req would refuse whatever the prefix hit."""
    for available in range(0, 120, 3):
        for prompt_len in (1, 5, 17, 40):
            req = make_req("q", input_len=prompt_len, max_new_tokens=30)
            best_prefix = (prompt_len - 1) // 4 * 4
            for prefix in range(0, best_prefix + 1, 4):
                adder = PrefillAdder(config(), available_tokens=available)
                if not adder.could_admit(req):
                    assert not adder.add_one_req(req, prefix).admitted
            adder = PrefillAdder(config(), available_tokens=available)
            if adder.could_admit(req):
                assert adder.add_one_req(req, best_prefix).admitted


# -- agreement with SGLang 0.5.23 (issue 19) ---------------------------------------------


def test_budget_follows_prefix_locks():
    """Item 2: SGLang re-reads available + evictable after locking a candidate's prefix,
    so the tokens the lock pins leave the budget (page 16, 28 pages: the tree holds 16
    tokens, a 17-token request shares them; 224 left, not 240)."""
    capacity = 28 * 16
    adder = PrefillAdder(config(page_size=16), available_tokens=capacity)
    req = make_req(input_len=17, max_new_tokens=176)
    adder.lock_prefix(16)  # matching it locked its 16-token prefix
    assert adder.add_one_req(req, prefix_len=16) == AddDecision(CONTINUE, 1)
    assert_budget(adder, total=224, current=capacity - 16 - 32)


def test_pinned_tokens_leave_both_budgets_and_charges_stay():
    adder = PrefillAdder(config(), available_tokens=1000)
    adder.add_one_req(make_req("a", input_len=10, max_new_tokens=100), 0)
    adder.lock_prefix(0)  # a prefix running requests had locked already
    adder.lock_prefix(100)
    assert_budget(adder, total=900 - 116, current=900 - 16)
    for bad in (-1, 901):
        with pytest.raises(ValueError, match="cannot pin"):
            adder.lock_prefix(bad)


def test_chunk_continuation_under_a_page_of_budget_stays_chunked():
    """Item 3: with about 8 tokens of total budget left, a 57-token prompt with 48 done
    extends 8 and stays chunked, as in SGLang (it used to take all 9 and reserve its
    whole output)."""
    running = [
        running_req("a", input_len=16, output_len=1, max_new_tokens=110),  # 109 left
        running_req("b", input_len=16, output_len=1, max_new_tokens=109),  # 108 left
    ]
    req = chunked(57, done=48, max_new_tokens=4096)
    cfg = config(page_size=16, chunked_prefill_size=64)
    adder = PrefillAdder(cfg, 160, running, new_token_ratio=0.7, chunked_req=req)
    budget = adder.remaining_total_tokens
    assert 8 < budget < 9
    d = adder.add_chunked_req(req)
    assert d == AddDecision(NO_TOKEN, 8)
    assert adder.new_chunked_req is req
    assert adder.remaining_total_tokens == pytest.approx(budget - (16 + 16))  # no output


def test_chunk_continuation_is_not_floored_to_a_page():
    """Item 3: page 16, chunk 16, an 86-token prompt with 69 done extends 16 (to 85),
    as in SGLang; it used to stop at the page boundary 80 (11 tokens)."""
    req = chunked(86, done=69)
    adder = PrefillAdder(config(page_size=16, chunked_prefill_size=16), 10_000, chunked_req=req)
    assert adder.add_chunked_req(req) == AddDecision(OTHER, 16)
    assert adder.new_chunked_req is req


def readmitted(input_len: int, output_len: int, max_new_tokens: int):
    req = make_req(
        "back", input_len=input_len, output_len=output_len, max_new_tokens=max_new_tokens
    )
    req.start_prefill(row=1, prefix_len=0, extend_len=input_len + output_len)
    req.reset_for_retract()
    return req


def test_full_readmit_charge_checks_remaining_and_reserves_max_new():
    """Item 5: SGLang admits a re-admitted request if its remaining output fits, then
    reserves its whole min(max_new, clip): check 8 + 4 + 14 < 30, reserve 8 + 4 + 20."""
    req = readmitted(input_len=8, output_len=6, max_new_tokens=20)
    adder = PrefillAdder(config(readmit_charge="full"), available_tokens=30)
    assert adder.add_one_req(req, prefix_len=8) == AddDecision(NO_TOKEN, 6)
    assert adder.remaining_total_tokens == 30 - (8 + 4 + 20)


def test_full_readmit_charge_on_a_last_chunk_and_a_host_resume():
    req = readmitted(input_len=40, output_len=6, max_new_tokens=20)
    req.start_prefill(row=1, prefix_len=0, extend_len=32)
    req.complete_extend()
    adder = PrefillAdder(
        config(readmit_charge="full", chunked_prefill_size=16), 1000, chunked_req=req
    )
    assert adder.add_chunked_req(req) == AddDecision(OTHER, 14)  # the last chunk
    assert adder.remaining_total_tokens == 1000 - (16 + 4 + 20)

    host = readmitted(input_len=8, output_len=6, max_new_tokens=20)  # 13 tokens of KV back
    adder = PrefillAdder(config(readmit_charge="full"), available_tokens=36)
    assert adder.add_resumed_req(host)  # check 16 + 4 + 14 < 36
    assert adder.remaining_total_tokens == 36 - (16 + 4 + 20)
