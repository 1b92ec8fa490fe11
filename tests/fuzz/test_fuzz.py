"""The seeded fuzzers at a CI budget: a few hundred messages per socket, live services.

Each run must end with no crash, no hang, no internal error, memsvc's
integrity check passing after every batch and the legitimate session's state
as it was. ``python -m tests.fuzz.soak`` runs the same fuzzers for longer.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvstack.stack.launch import Launcher
from tests.fuzz.http_gen import HttpMessages
from tests.fuzz.http_target import HttpTarget
from tests.fuzz.memsvc_gen import MemsvcMessages
from tests.fuzz.model_target import ModelMessages, ModelTarget
from tests.fuzz.runner import fuzz
from tests.fuzz.scheduler_gen import SchedulerMessages
from tests.fuzz.targets import MemsvcTarget, RouterTarget, SchedulerTarget
from tests.fuzz.transfer_target import TransferMessages, TransferTarget


def _assert_clean(figures) -> None:
    assert figures.clean, figures.as_json()
    assert figures.codes.get("ok"), figures.codes  # valid ops got through too
    assert {"malformed", "bad_request"} <= set(figures.codes), figures.codes


def test_memsvc_socket(launcher) -> None:
    target = MemsvcTarget(launcher)
    try:
        figures = fuzz(target, 600, 0, batch=50)
    finally:
        target.close()
    _assert_clean(figures)
    assert figures.messages == 600
    assert figures.codes.get("not_owner"), figures.codes  # the legitimate rid was aimed at


def test_the_memsvc_oracle_sees_a_changed_page(launcher) -> None:
    """The check the fuzz runs rests on: one KV value of the legitimate request changed."""
    target = MemsvcTarget(launcher)
    try:
        assert target.problems() == []
        target.buffers.kv[target.pages[0]].flat[0] += 1
        assert target.problems() == ["the legitimate request's slots or KV bytes changed"]
        target.buffers.kv[target.pages[0]].flat[0] -= 1
    finally:
        target.close()


@pytest.fixture(scope="module")
def normal_stack(tmp_path_factory, checkpoint) -> Iterator[SchedulerTarget]:
    """One normal stack for the scheduler's and the HTTP front's fuzz (a start is seconds)."""
    with Launcher(tmp_path_factory.mktemp("fuzz")) as launcher:
        target = SchedulerTarget(launcher, checkpoint)
        try:
            yield target
        finally:
            target.close()
    assert not launcher.leaked_segments


def test_scheduler_socket(normal_stack) -> None:
    before = normal_stack.before
    assert isinstance(before, list) and len(before) == 12, before
    figures = fuzz(normal_stack, 300, 0, batch=100)
    _assert_clean(figures)
    assert figures.messages == 300


def test_router(launcher, checkpoint) -> None:
    target = RouterTarget(launcher, checkpoint)
    try:
        assert isinstance(target.before, list) and len(target.before) == 12, target.before
        figures = fuzz(target, 100, 0, batch=50)
    finally:
        target.close()
    _assert_clean(figures)


def test_model_svc_socket(launcher, checkpoint) -> None:
    target = ModelTarget(launcher, checkpoint)
    try:
        assert isinstance(target.before[0], list), target.before
        figures = fuzz(target, 300, 0, batch=100)
    finally:
        target.close()
    _assert_clean(figures)
    assert figures.codes.get("invalid_batch"), figures.codes


def test_transfer_socket(launcher) -> None:
    target = TransferTarget(launcher)
    try:
        figures = fuzz(target, 400, 0, batch=50)
    finally:
        target.close()
    assert figures.clean, figures.as_json()
    assert {"ready", "ack", "not_ready", "failed"} <= set(figures.codes), figures.codes


def test_http_front(launcher, checkpoint, normal_stack) -> None:
    target = HttpTarget(launcher, checkpoint, stack=normal_stack)
    try:
        assert isinstance(target.before, list) and len(target.before) == 12, target.before
        figures = fuzz(target, 200, 0, batch=100)
    finally:
        target.close()
    assert figures.clean, figures.as_json()
    assert figures.codes.get("ok") and figures.codes.get("400"), figures.codes


def _memsvc_messages() -> MemsvcMessages:
    messages = MemsvcMessages(legit_row=0)
    messages.observe({"ok": True, "session": "s1"})  # as a hello's reply would
    return messages


@pytest.mark.parametrize(
    "make",
    [
        _memsvc_messages,
        SchedulerMessages,
        HttpMessages,
        lambda: ModelMessages(row=1, num_rows=8, epoch="e"),
        lambda: TransferMessages(page_bytes=64),
    ],
)
def test_a_seed_gives_the_same_messages(make) -> None:
    """A finding is reproduced by its seed: the generators draw only from it."""

    def draw() -> list:
        messages, rng = make(), random.Random(3)
        return [messages.next(rng) for _ in range(300)]

    first = draw()
    assert first == draw()
    assert len({repr(message) for message in first}) > 200
