"""Issue 32, part 1: a scheduler killed mid-decode is restarted and adopts the KV memsvc
still holds; nothing is re-prefilled. In PD mode, the decode scheduler likewise (the
last test).

The supervised normal stack of :mod:`tests.faults.harness` (a 256-token pool, a low
schedule conservativeness and SGLang's testing retract, so the workload retracts),
the scheduler SIGKILLed once the streams have delivered a seeded number of tokens
(mid-decode; memsvc and model_svc survive). Clients re-submit under the same rids
and must get every token once, identical to the fault-free reference, and the
stack must end idle with nothing leaked. The restarted scheduler's
``recovery.reprefilled_tokens`` counts the KV tokens of the dead scheduler's
requests that memsvc freed, each to be computed again: before adoption it ended
the dead session and every KV holder was re-prefilled (the count was the whole
held KV); with adoption it is 0. Printed for the record either way.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import pytest

from memsvc.client import Call, MemClient
from memsvc.core.errors import MemsvcError
from tests.faults.harness import FaultHarness, temp_workdir
from tests.faults.test_faults import check

SEED = 11

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def harness() -> Iterator[FaultHarness]:
    workdir = temp_workdir()
    try:
        with FaultHarness(workdir, SEED) as running:
            yield running
        assert not running.leftovers, running.leftovers
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize("index, trigger", [(1, 40), (2, 120)])
def test_scheduler_killed_mid_decode_adopts_without_reprefill(
    harness: FaultHarness, index: int, trigger: int
) -> None:
    result = harness.run(harness.scenario(index, "kill_scheduler_svc", trigger=trigger))
    recovery = harness.info()["recovery"]
    print(
        "ADOPT",
        json.dumps(
            {
                "trigger_tokens": trigger,
                "reprefilled_tokens": recovery["reprefilled_tokens"],
                "adopted_reqs": recovery.get("adopted_reqs"),
                "adopted_kv_tokens": recovery.get("adopted_kv_tokens"),
                "discarded_step_tokens": recovery.get("discarded_step_tokens"),
                "outcomes": {s: result.count(s) for s in ("identical", "error", "mismatch")},
            }
        ),
    )
    check(result, "sigkill_scheduler_svc")
    assert result.count("error") == 0, [o.detail for o in result.outcomes if o.detail]
    assert recovery["reprefilled_tokens"] == 0, recovery
    assert recovery["adopted_reqs"] > 0, recovery


def test_model_svc_killed_mid_decode_replays_the_step_without_reprefill(
    harness: FaultHarness,
) -> None:
    """The KV is in memsvc's pool: the restarted worker maps it again and the scheduler
    (ResilientModelClient) sends the same forward again, or ZMQ delivers the call it
    queued to the new worker (model_resends then stays 0). Counted: no request re-queued
    for re-prefill, no memsvc session lost, no KV freed; every token identical."""
    before = harness.info()
    result = harness.run(harness.scenario(3, "kill_model_svc", trigger=60))
    after = harness.info()
    assert after["pid"] == before["pid"], "the scheduler itself must not have restarted"
    delta = {
        key: after["recovery"][key] - before["recovery"][key]
        for key in ("model_resends", "requeued_reqs", "memsvc_resets", "reprefilled_tokens")
    }
    print("ADOPT model_svc", json.dumps(delta))
    check(result, "sigkill_model_svc")
    assert result.count("error") == 0, [o.detail for o in result.outcomes if o.detail]
    assert delta["requeued_reqs"] == 0 and delta["memsvc_resets"] == 0, delta
    assert delta["reprefilled_tokens"] == 0, delta


def test_another_session_cannot_adopt_the_live_scheduler(harness: FaultHarness) -> None:
    """Over memsvc's socket: a client with a wrong id, or with the scheduler's real id but
    not a scheduler_svc session (another name or role), is refused with adopt_refused;
    the scheduler keeps its session and serves on (a killed-scheduler scenario after)."""
    session = (harness.workdir / "run" / "scheduler_svc.session").read_text().strip()
    address = harness.supervisor.address("memsvc")
    refused = []
    for options, predecessor in [
        ({"name": "scheduler_svc"}, "0123456789abcdef"),
        ({"name": "intruder"}, session),
        ({"name": "scheduler_svc", "role": "worker"}, session),
    ]:
        with MemClient(address, timeout_s=5, heartbeat=False, **options) as intruder:
            with pytest.raises(MemsvcError) as caught:
                intruder._invoke(Call("adopt", {"predecessor": predecessor}, None, _header))
            refused.append(caught.value.code)
            assert intruder.stats()["sessions"] >= 2  # the scheduler's is still there
    assert refused == ["adopt_refused"] * 3
    assert (harness.workdir / "run" / "scheduler_svc.session").read_text().strip() == session
    result = harness.run(harness.scenario(4, "kill_scheduler_svc", trigger=80))
    check(result, "sigkill_scheduler_svc")
    assert harness.info()["recovery"]["reprefilled_tokens"] == 0


def _header(header, arrays):
    return header


# -- PD mode: the decode scheduler is killed --------------------------------------------


@pytest.fixture(scope="module")
def pd_harness() -> Iterator[FaultHarness]:
    workdir = temp_workdir()
    try:
        with FaultHarness(workdir, SEED, mode="pd") as running:
            yield running
        assert not running.leftovers, running.leftovers
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_decode_scheduler_killed_mid_decode_adopts_and_the_router_reattaches(
    pd_harness: FaultHarness,
) -> None:
    """The PD stack's decode scheduler SIGKILLed mid-decode (memsvc-D survives): its
    successor adopts the requests whose KV had arrived (running, or retracted to
    memsvc-D's host store), and the router, told which with ``adopted``, re-submits
    them to it without prefilling them again; the rest (still awaiting their KV)
    start over through the prefill node. Before: the successor ended the dead
    session and every request started over (adopted_reqs 0, reattached 0)."""
    before = pd_harness.info()
    result = pd_harness.run(pd_harness.scenario(5, "kill_scheduler-d", trigger=40))
    after = pd_harness.info()
    recovery, router = after["recovery"], after["router"]
    reattached = router.get("reattached", 0) - before["router"].get("reattached", 0)
    redrives = router["redrives"] - before["router"]["redrives"]
    print(
        "ADOPT pd",
        json.dumps(
            {
                "adopted_reqs": recovery.get("adopted_reqs"),
                "adopted_kv_tokens": recovery.get("adopted_kv_tokens"),
                "reprefilled_tokens": recovery["reprefilled_tokens"],
                "discarded_step_tokens": recovery.get("discarded_step_tokens"),
                "reattached": reattached,
                "redrives": redrives,
                "outcomes": {s: result.count(s) for s in ("identical", "error", "mismatch")},
            }
        ),
    )
    check(result, "sigkill_scheduler-d")
    assert result.count("error") == 0, [o.detail for o in result.outcomes if o.detail]
    assert recovery["adopted_reqs"] > 0 and recovery["adopted_kv_tokens"] > 0, recovery
    assert reattached > 0, router
    assert reattached <= recovery["adopted_reqs"], (router, recovery)
