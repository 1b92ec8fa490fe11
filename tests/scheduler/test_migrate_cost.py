"""The retract cost model's third way (issue 32): moving a victim already in the host
store to another decode node, against waiting for room here
(scheduler_svc.core.retract_cost.RetractCostModel.migrate_beats_waiting).
"""

from __future__ import annotations

import math

import pytest

from scheduler_svc.core.retract_cost import RetractCostModel
from tests.scheduler.helpers import make_req


def model(**kwargs: float) -> RetractCostModel:
    return RetractCostModel(bytes_per_token=1000, page_size=4, **kwargs)


def test_wait_is_zero_when_the_slots_are_free_now() -> None:
    assert model().wait_s(need=10, allocatable=10, running=[(5, 100)]) == 0.0


def test_wait_counts_the_steps_until_enough_ends_free_room() -> None:
    cost = model(decode_step_s=0.5)
    # After 2 steps the first ends (frees 20), the other has grown by 2: 5 + 20 - 2 = 23.
    assert cost.wait_s(need=23, allocatable=5, running=[(2, 20), (7, 30)]) == 1.0
    # One slot more: only after the second ends, at step 7 (5 + 20 + 30).
    assert cost.wait_s(need=24, allocatable=5, running=[(2, 20), (7, 30)]) == 3.5


def test_wait_is_infinite_when_their_ends_never_free_enough() -> None:
    assert model().wait_s(need=100, allocatable=5, running=[(2, 20), (7, 30)]) == math.inf
    assert model().wait_s(need=1, allocatable=0, running=[]) == math.inf


@pytest.mark.parametrize(
    ("move_bytes_per_s", "moves"),
    [(1e12, True), (1.0, False)],  # a fast link moves, a slow one waits 2 steps
)
def test_the_move_is_weighed_against_the_wait(move_bytes_per_s: float, moves: bool) -> None:
    cost = model(decode_step_s=0.1, move_bytes_per_s=move_bytes_per_s)
    req = make_req("r", 40, 8)
    assert cost.move_s(req) == cost.kv_bytes(req) / move_bytes_per_s
    assert cost.migrate_beats_waiting(req, 48, 0, [(2, 60)]) is moves
    assert cost.migrate_beats_waiting(req, 48, 48, [(2, 60)]) is False  # it fits here now


def test_moves_and_decode_steps_teach_the_rates() -> None:
    cost = model(move_bytes_per_s=1e9, decode_step_s=0.05)
    cost.observe_move(2_000_000, 0.001)  # 2 GB/s seen
    cost.observe_decode_step(0.25)
    assert 1e9 < cost.move_bytes_per_s < 2e9
    assert 0.05 < cost.decode_step_s < 0.25
    before = (cost.move_bytes_per_s, cost.decode_step_s)
    cost.observe_move(0, 1.0)  # nothing moved, or no time: ignored
    cost.observe_decode_step(0.0)
    assert (cost.move_bytes_per_s, cost.decode_step_s) == before
