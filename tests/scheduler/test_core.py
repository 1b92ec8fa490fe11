"""Scheduler core: victim order, the new-token ratio, config, intake clamp, decode estimate."""

from __future__ import annotations

import itertools
import sys

import pytest

from scheduler_svc.core import (
    RETRACT_ABORT_MESSAGE,
    RETRACT_ABORT_STATUS,
    ConfigError,
    NewTokenRatioTracker,
    PrefillAdder,
    RequestTooLargeError,
    SchedulerConfig,
    check_fits,
    clamp_max_new_tokens,
    decode_tokens_required,
    max_new_tokens_for_memory,
    retraction_order,
)
from scheduler_svc.core.retract_cost import RetractCostModel
from tests.scheduler.helpers import config, make_req


def pop_victims(reqs, cfg) -> list[str]:
    """Victims in the order the retract loop takes them: from the end of the order."""
    order = retraction_order(reqs, cfg)
    assert sorted(order) == list(range(len(reqs)))
    return [reqs[order.pop()].rid for _ in range(len(order))]


# -- victim order --------------------------------------------------------------


@pytest.mark.parametrize("batch", list(itertools.permutations(range(3))))
def test_length_policy_victims_fewest_outputs_then_longest_prompt(batch):
    reqs = [
        make_req("long-output", input_len=5, output_len=10),
        make_req("short-output-short-input", input_len=5, output_len=2),
        make_req("short-output-long-input", input_len=50, output_len=2),
    ]
    reqs = [reqs[i] for i in batch]
    assert pop_victims(reqs, config()) == [
        "short-output-long-input",
        "short-output-short-input",
        "long-output",
    ]


def test_length_policy_full_ties_keep_batch_order():
    reqs = [make_req(f"r{i}", input_len=7, output_len=3) for i in range(4)]
    # Stable sort: the most-preferred is the first in the batch, the first victim the last.
    assert retraction_order(reqs, config()) == [0, 1, 2, 3]
    assert pop_victims(reqs, config()) == ["r3", "r2", "r1", "r0"]


def test_length_policy_exact_order():
    reqs = [
        make_req("a", input_len=10, output_len=1),
        make_req("b", input_len=3, output_len=4),
        make_req("c", input_len=2, output_len=1),
        make_req("d", input_len=10, output_len=4),
    ]
    # Keys (out, -in): a (1,-10) b (4,-3) c (1,-2) d (4,-10); descending: b d c a.
    assert retraction_order(reqs, config()) == [1, 3, 2, 0]


def priority_config(low_values_first: bool) -> SchedulerConfig:
    return config(
        retraction_policy="priority",
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=low_values_first,
    )


@pytest.mark.parametrize(
    ("low_values_first", "priorities"),
    [
        (False, {"low": 1, "mid": 5, "high": 10}),  # default: a larger value matters more
        (True, {"low": 10, "mid": 5, "high": 1}),  # a smaller value matters more
    ],
)
def test_priority_policy_least_important_first_in_both_directions(low_values_first, priorities):
    reqs = [make_req(name, priority=priorities[name]) for name in ("low", "high", "mid")]
    assert pop_victims(reqs, priority_config(low_values_first)) == ["low", "mid", "high"]


@pytest.mark.parametrize("low_values_first", [False, True])
def test_priority_policy_none_is_least_important(low_values_first):
    extreme = -sys.maxsize if not low_values_first else sys.maxsize - 1
    reqs = [
        make_req("none", priority=None, output_len=50),
        make_req("extreme", priority=extreme),
        make_req("zero", priority=0),
    ]
    # None loses even to the most extreme real priority, despite its long output.
    assert pop_victims(reqs, priority_config(low_values_first)) == ["none", "extreme", "zero"]


@pytest.mark.parametrize("low_values_first", [False, True])
def test_priority_policy_ties_broken_by_length(low_values_first):
    reqs = [
        make_req("p3-long-output", priority=3, input_len=5, output_len=9),
        make_req("p3-short-output-long-input", priority=3, input_len=40, output_len=1),
        make_req("p3-short-output-short-input", priority=3, input_len=4, output_len=1),
    ]
    assert pop_victims(reqs, priority_config(low_values_first)) == [
        "p3-short-output-long-input",
        "p3-short-output-short-input",
        "p3-long-output",
    ]


@pytest.mark.parametrize("policy", ["length", "priority", "cost"])
def test_speculative_retracts_from_the_tail(policy):
    reqs = [
        make_req("low", priority=1, output_len=9),
        make_req("high", priority=10, output_len=0),
        make_req("mid", priority=5, output_len=3),
    ]
    cfg = config(speculative=True, retraction_policy=policy, enable_priority_scheduling=True)
    assert retraction_order(reqs, cfg) == [0, 1, 2]
    assert pop_victims(reqs, cfg) == ["mid", "high", "low"]


def test_retraction_order_of_empty_batch():
    assert retraction_order([], config()) == []


def cost_victims(reqs, mode: str, cost: RetractCostModel | None = None) -> list[str]:
    order = retraction_order(reqs, config(retraction_policy="cost", retract_mode=mode), cost=cost)
    assert sorted(order) == list(range(len(reqs)))
    return [reqs[i].rid for i in reversed(order)]


# Recompute re-prefills seq_len minus the likely tree hit (half the page-aligned prompt);
# offload copies seq_len - 1 tokens of KV. The two orders differ on this batch, and both
# differ from the length policy's.
COST_BATCH = [
    ("long-prompt", 200, 1),  # recompute 201 - 100 = 101 tokens, offload 200
    ("long-output", 8, 120),  # recompute 128 - 4 = 124, offload 127
    ("big", 400, 40),  # recompute 440 - 200 = 240, offload 439
]


@pytest.mark.parametrize("batch", list(itertools.permutations(range(3))))
def test_cost_policy_victims_cheapest_to_bring_back_first(batch):
    reqs = [make_req(rid, input_len=i, output_len=o) for rid, i, o in COST_BATCH]
    reqs = [reqs[i] for i in batch]
    assert cost_victims(reqs, "recompute") == ["long-prompt", "long-output", "big"]
    assert cost_victims(reqs, "offload") == ["long-output", "long-prompt", "big"]
    assert pop_victims(reqs, config()) == ["long-prompt", "big", "long-output"]


def test_cost_policy_auto_follows_the_learned_rates():
    reqs = [make_req(rid, input_len=i, output_len=o) for rid, i, o in COST_BATCH]
    copy_is_cheap = RetractCostModel(bytes_per_token=1, page_size=4, copy_bytes_per_s=1e12)
    assert cost_victims(reqs, "auto", copy_is_cheap) == ["long-output", "long-prompt", "big"]
    copy_is_dear = RetractCostModel(bytes_per_token=1, page_size=4, copy_bytes_per_s=1.0)
    assert cost_victims(reqs, "auto", copy_is_dear) == ["long-prompt", "long-output", "big"]
    # Per victim the cheaper way: 20 tokens/s of prefill, 20 bytes/s of copy (2 copies).
    mixed = RetractCostModel(
        bytes_per_token=1, page_size=4, prefill_tokens_per_s=20.0, copy_bytes_per_s=20.0
    )
    assert [mixed.readmit_s(r, "auto") for r in reqs] == [101 / 20, 124 / 20, 240 / 20]


def test_cost_policy_ties_fall_back_to_length():
    reqs = [make_req(f"r{i}", input_len=8, output_len=3) for i in range(3)]
    assert cost_victims(reqs, "offload") == ["r2", "r1", "r0"]  # stable, as length


def test_cost_policy_keeps_the_thrash_guard():
    cfg = config(retraction_policy="cost", retract_cooldown_steps=10)
    reqs = [make_req(rid, input_len=i, output_len=o) for rid, i, o in COST_BATCH]
    assert retraction_order(reqs, cfg, step=100)[-1] == 0  # long-prompt: cheapest
    reqs[0].readmit_step = 95  # cooling down: kept while anything else can go
    order = retraction_order(reqs, cfg, step=100)
    assert order[0] == 0 and order[-1] == 1


# -- new_token_ratio -----------------------------------------------------------

DECAY = (0.7 - 0.098) / 600


def default_tracker() -> NewTokenRatioTracker:
    return NewTokenRatioTracker.from_config(SchedulerConfig.from_env(environ={}, **_BASE))


_BASE = dict(page_size=1, max_running_requests=8)


def test_tracker_defaults_exact():
    t = default_tracker()
    assert t.init_ratio == 0.7
    assert t.min_ratio == 0.098
    assert t.decay == DECAY == 0.0010033333333333333
    assert t.current == 0.7


def test_tracker_decays_linearly_to_min():
    t = default_tracker()
    assert t.decay_step() == 0.7 - DECAY
    assert t.current == 0.6989966666666666
    for _ in range(9):
        t.decay_step()
    assert t.current == pytest.approx(0.7 - 10 * DECAY, abs=1e-12)
    for _ in range(589):  # 599 steps in all
        t.decay_step()
    assert t.current == pytest.approx(0.098 + DECAY, abs=1e-12)
    t.decay_step()  # the 600th reaches the floor
    assert t.current == 0.098
    t.decay_step()
    assert t.current == 0.098


def test_tracker_reset_returns_to_init():
    t = default_tracker()
    for _ in range(50):
        t.decay_step()
    assert t.current < 0.7
    t.reset()
    assert t.current == 0.7


@pytest.mark.parametrize(
    ("conservativeness", "init", "minimum"),
    [(1.0, 0.7, 0.098), (2.0, 1.0, 0.14), (0.5, 0.35, 0.049), (0.0, 0.0, 0.0)],
)
def test_tracker_scales_with_conservativeness(conservativeness, init, minimum):
    cfg = SchedulerConfig.from_env(environ={}, schedule_conservativeness=conservativeness, **_BASE)
    t = NewTokenRatioTracker.from_config(cfg)
    assert t.init_ratio == pytest.approx(init, abs=1e-15)
    assert t.min_ratio == pytest.approx(minimum, abs=1e-15)
    assert t.decay == pytest.approx((init - minimum) / 600, abs=1e-15)


def test_tracker_after_retract_estimate_on_a_batch():
    t = default_tracker()
    kept = [
        make_req("a", output_len=10, max_new_tokens=100),
        make_req("b", output_len=30, max_new_tokens=200),
    ]
    # (10 + 30 + 20 * 2) / (100 + 200 + 1)
    assert t.estimate_after_retract(kept) == 80 / 301
    assert t.current == 0.7  # estimating changes nothing
    assert t.on_retract(kept) == 80 / 301
    assert t.current == 80 / 301


def test_tracker_after_retract_uses_raw_max_new_tokens_not_clipped():
    t = default_tracker()
    kept = [make_req("a", output_len=100, max_new_tokens=100_000)]
    assert t.on_retract(kept) == (100 + 20) / 100_001


def test_tracker_after_retract_caps_at_one():
    t = default_tracker()
    assert t.on_retract([make_req("a", output_len=90, max_new_tokens=100)]) == 1.0


def test_tracker_after_retract_has_no_lower_clamp_then_decay_lifts_to_min():
    t = default_tracker()
    assert t.on_retract([make_req("a", output_len=0, max_new_tokens=10_000)]) == 20 / 10_001
    assert t.current < t.min_ratio
    assert t.decay_step() == 0.098


def test_tracker_after_retract_of_everything_is_zero():
    t = default_tracker()
    assert t.on_retract([]) == 0.0


def test_tracker_after_retract_uses_retract_decode_steps():
    cfg = SchedulerConfig.from_env(environ={"SGLANG_RETRACT_DECODE_STEPS": "5"}, **_BASE)
    t = NewTokenRatioTracker.from_config(cfg)
    kept = [make_req("a", output_len=10, max_new_tokens=99)]
    assert t.on_retract(kept) == (10 + 5) / 100


# -- config ---------------------------------------------------------------------


def test_config_defaults_match_sglang():
    cfg = SchedulerConfig.from_env(environ={}, page_size=16, max_running_requests=32)
    assert (
        cfg.init_new_token_ratio,
        cfg.min_new_token_ratio_factor,
        cfg.new_token_ratio_decay_steps,
        cfg.retract_decode_steps,
        cfg.clip_max_new_tokens,
        cfg.test_retract,
        cfg.test_retract_interval,
    ) == (0.7, 0.14, 600, 20, 4096, False, 3)
    assert cfg.max_prefill_tokens == 16384
    assert cfg.chunked_prefill_size is None
    assert cfg.schedule_conservativeness == 1.0
    assert cfg.retraction_policy == "length"


ENV = {
    "SGLANG_INIT_NEW_TOKEN_RATIO": "0.5",
    "SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR": "0.2",
    "SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS": "100",
    "SGLANG_RETRACT_DECODE_STEPS": "10",
    "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "1024",
    "SGLANG_TEST_RETRACT": "true",
    "SGLANG_TEST_RETRACT_INTERVAL": "5",
}


def test_config_reads_sglang_env(monkeypatch):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    cfg = SchedulerConfig.from_env(**_BASE)
    assert cfg.init_new_token_ratio == 0.5
    assert cfg.min_new_token_ratio_factor == 0.2
    assert cfg.new_token_ratio_decay_steps == 100
    assert cfg.retract_decode_steps == 10
    assert cfg.clip_max_new_tokens == 1024
    assert cfg.test_retract is True
    assert cfg.test_retract_interval == 5
    t = NewTokenRatioTracker.from_config(cfg)
    assert (t.init_ratio, t.min_ratio, t.decay) == (0.5, 0.1, 0.004)
    assert t.decay_step() == 0.496


def test_config_env_clip_reaches_admission(monkeypatch):
    monkeypatch.setenv("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", "100")
    cfg = SchedulerConfig.from_env(page_size=4, max_running_requests=8)
    adder = PrefillAdder(cfg, available_tokens=10_000)
    adder.add_one_req(make_req(input_len=8, max_new_tokens=5000), prefix_len=0)
    assert adder.remaining_total_tokens == 10_000 - (8 + 4 + 100)


def test_config_overrides_win_over_env():
    cfg = SchedulerConfig.from_env(environ=ENV, retract_decode_steps=7, test_retract=False, **_BASE)
    assert cfg.retract_decode_steps == 7
    assert cfg.test_retract is False
    assert cfg.clip_max_new_tokens == 1024


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("YES", True), ("n", False), ("0", False)])
def test_config_bool_spellings(raw, value):
    cfg = SchedulerConfig.from_env(environ={"SGLANG_TEST_RETRACT": raw}, **_BASE)
    assert cfg.test_retract is value


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("SGLANG_TEST_RETRACT", "maybe"),
        ("SGLANG_TEST_RETRACT_INTERVAL", "3.5"),
        ("SGLANG_INIT_NEW_TOKEN_RATIO", "high"),
    ],
)
def test_config_bad_env_value_names_the_variable(name, raw):
    with pytest.raises(ConfigError, match=name):
        SchedulerConfig.from_env(environ={name: raw}, **_BASE)


def test_config_priority_retraction_needs_priority_scheduling():
    with pytest.raises(ConfigError, match="enable_priority_scheduling"):
        config(retraction_policy="priority")
    assert config(retraction_policy="priority", enable_priority_scheduling=True)


@pytest.mark.parametrize(
    "bad",
    [
        dict(page_size=0),
        dict(max_running_requests=0),
        dict(chunked_prefill_size=3),  # below one page (4)
        dict(schedule_conservativeness=-0.1),
        dict(retraction_policy="lof"),
        dict(new_token_ratio_decay_steps=0),
        dict(test_retract_interval=0),
    ],
)
def test_config_rejects_bad_values(bad):
    with pytest.raises(ConfigError):
        config(**bad)


def test_config_from_env_rejects_unknown_and_missing_fields():
    with pytest.raises(ConfigError, match="unknown"):
        SchedulerConfig.from_env(environ={}, page_sise=4, max_running_requests=1)
    with pytest.raises(ConfigError, match="max_running_requests"):
        SchedulerConfig.from_env(environ={}, page_size=4)


def test_config_test_retract_interval():
    cfg = SchedulerConfig.from_env(environ={"SGLANG_TEST_RETRACT": "1"}, **_BASE)
    assert [ct for ct in range(10) if cfg.is_test_retract_step(ct)] == [0, 3, 6, 9]
    assert not any(config().is_test_retract_step(ct) for ct in range(10))


# -- decode estimate, abort message ------------------------------------------------


def test_decode_tokens_required_counts_requests_opening_a_page():
    assert decode_tokens_required([0, 3, 4, 5, 8], page_size=4) == 12
    assert decode_tokens_required([1, 2, 3], page_size=4) == 0
    assert decode_tokens_required([0, 3, 4, 5, 8], page_size=1) == 5
    assert decode_tokens_required([], page_size=16) == 0


def test_abort_message_and_status():
    assert RETRACT_ABORT_MESSAGE == (
        "Out of memory even after retracting all other requests in the decode batch. "
        "Aborting the last request."
    )
    assert RETRACT_ABORT_STATUS == 500


# -- intake clamp -------------------------------------------------------------------


def test_clamp_max_new_tokens():
    # capacity 1000, page 16, input 100 -> ceil 112; 1000 - 112 - 16 - 1 = 871
    assert max_new_tokens_for_memory(100, 1000, 16) == 871
    assert clamp_max_new_tokens(100, 5000, capacity=1000, page_size=16) == 871
    assert clamp_max_new_tokens(100, 871, capacity=1000, page_size=16) == 871
    assert clamp_max_new_tokens(100, 10, capacity=1000, page_size=16) == 10
    assert clamp_max_new_tokens(100, 0, capacity=1000, page_size=16) == 0
    assert clamp_max_new_tokens(100, 50, capacity=100, page_size=16) == 0  # never below 0


def test_check_fits_boundary():
    # input 100, page 16: needs 112 + 16 + 1 + 1 = 130
    check_fits(100, capacity=130, page_size=16)
    assert clamp_max_new_tokens(100, 99, capacity=130, page_size=16) == 1
    with pytest.raises(RequestTooLargeError) as err:
        check_fits(100, capacity=129, page_size=16)
    assert err.value.status_code == 400
    assert "input_len=100" in str(err.value)
    assert "capacity=129" in str(err.value)


@pytest.mark.parametrize(("page_size", "input_len"), [(1, 1), (1, 57), (4, 9), (16, 100)])
def test_clamped_request_alone_always_admitted_to_an_empty_pool(page_size, input_len):
    capacity = 512
    check_fits(input_len, capacity, page_size)
    max_new = clamp_max_new_tokens(input_len, 10**9, capacity, page_size)
    cfg = config(page_size=page_size, clip_max_new_tokens=10**9, max_prefill_tokens=capacity)
    adder = PrefillAdder(cfg, available_tokens=capacity)
    decision = adder.add_one_req(make_req(input_len=input_len, max_new_tokens=max_new), 0)
    assert decision.extend_len == input_len
    assert adder.remaining_total_tokens == 1
    # One more token of output would not have fitted.
    adder = PrefillAdder(cfg, available_tokens=capacity)
    decision = adder.add_one_req(make_req(input_len=input_len, max_new_tokens=max_new + 1), 0)
    assert decision.extend_len == 0


def test_cooldown_keeps_recently_readmitted_requests_out_of_the_victims():
    cfg = config(retract_cooldown_steps=10)
    reqs = [make_req(f"r{i}", input_len=8, output_len=i) for i in range(4)]
    # By length, r0 (fewest outputs) is the first victim (last in the order).
    assert retraction_order(reqs, cfg)[-1] == 0
    reqs[0].readmit_step = 95  # re-admitted 5 passes ago: cooling down
    order = retraction_order(reqs, cfg, step=100)
    assert order[0] == 0 and order[-1] == 1  # kept first; r1 is the victim now
    assert retraction_order(reqs, cfg, step=105)[-1] == 0  # cooled down
    assert retraction_order(reqs, config(), step=100)[-1] == 0  # guard off (SGLang)
    for req in reqs:  # everyone cooling: the policy order among them
        req.readmit_step = 99
    assert retraction_order(reqs, cfg, step=100) == retraction_order(reqs, cfg)


def test_scheduler_cli_accepts_every_retraction_policy():
    from scheduler_svc.__main__ import build_parser

    parser = build_parser()
    base = ["--memsvc", "ipc:///m", "--worker", "ipc:///w"]
    assert parser.parse_args(base).retraction_policy == "length"
    assert parser.parse_args([*base, "--retraction-policy", "cost"]).retraction_policy == "cost"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--retraction-policy", "cheapest"])
    assert "cost" in parser.format_help()


def test_cost_model_learns_how_much_of_a_victims_prompt_the_tree_kept():
    model = RetractCostModel(bytes_per_token=1, page_size=4, prefill_tokens_per_s=1.0)
    req = make_req("victim", input_len=100, output_len=20)
    assert model.recompute_s(req) == 120 - 50  # prior: half the prompt hits
    for _ in range(40):
        model.observe_readmit(prompt_len=100, prefix_len=0)  # evicted every time
    assert model.recompute_s(req) == pytest.approx(120, abs=0.1)
    model.observe_readmit(prompt_len=100, prefix_len=110)  # past the prompt: the whole prompt
    assert model.hit_fraction == pytest.approx(0.2, abs=0.01)
    model.observe_readmit(prompt_len=3, prefix_len=0)  # under a page: nothing to learn
    assert model.hit_fraction == pytest.approx(0.2, abs=0.01)
