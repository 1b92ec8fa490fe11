"""Fault injection against supervised stacks: normal mode, one scenario per fault kind,
PD mode, three scenarios, and PD mode with the file storage tier on one directory for
both memsvc (issue 26), three more.

One stack per mode serves its scenarios (a fault must not break the next one
either); each scenario runs the pressure workload (retracts included) and
injects its fault at a seeded point, then the harness checks tokens against
the fault-free reference, the idle invariant (of both memsvc in PD mode, page
files included with the storage tier), leaks and leftovers. The longer, random
mix is ``python -m tests.faults.soak`` (``--mode pd`` for the PD stack,
``--storage`` for the file tier).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from memsvc.client import MemClient
from tests.faults.harness import FaultHarness, ScenarioResult, temp_workdir

SEED = 7

pytestmark = pytest.mark.timeout(600)


def _harness(mode: str, *, storage: bool = False) -> Iterator[FaultHarness]:
    workdir = temp_workdir()
    try:
        with FaultHarness(workdir, SEED, mode=mode, storage=storage) as running:
            yield running
        assert not running.leftovers, running.leftovers
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def harness() -> Iterator[FaultHarness]:
    yield from _harness("normal")


@pytest.fixture(scope="module")
def pd_harness() -> Iterator[FaultHarness]:
    yield from _harness("pd")


@pytest.fixture(scope="module")
def pd_storage_harness() -> Iterator[FaultHarness]:
    """The PD stack with the file storage tier, both memsvc on one directory."""
    yield from _harness("pd", storage=True)


def check(result: ScenarioResult, fault: str | None) -> None:
    """The fault happened, and every request came out right or with a named error."""
    summary = [(o.job, o.status, o.detail[:300]) for o in result.outcomes if o.detail]
    if fault is not None:
        assert result.faults[fault] >= 1, f"the fault was not injected: {dict(result.faults)}"
    assert result.count("lost") == 0, summary
    assert result.count("mismatch") == 0, summary
    assert result.count("identical") + result.count("error") == len(result.outcomes)
    assert result.count("identical") > 0, summary
    assert not result.problems, result.problems
    assert result.pages_leaked == 0 and result.host_bytes_left == 0
    assert result.retractions > 0, "the workload should retract"


def test_model_svc_killed_mid_workload(harness: FaultHarness) -> None:
    result = harness.run(harness.scenario(1, "kill_model_svc"))
    check(result, "sigkill_model_svc")


def test_memsvc_killed_during_a_retract(harness: FaultHarness) -> None:
    """The new memsvc has a new epoch and an empty pool: every KV holder is re-prefilled."""
    result = harness.run(harness.scenario(2, "kill_memsvc_in_retract"))
    check(result, "sigkill_memsvc_in_retract")


def test_scheduler_killed_mid_workload(harness: FaultHarness) -> None:
    """Clients re-submit under the same rids; streams deliver no token twice."""
    result = harness.run(harness.scenario(3, "kill_scheduler_svc"))
    check(result, "sigkill_scheduler_svc")


def test_memsvc_stalled_past_the_timeouts(harness: FaultHarness) -> None:
    result = harness.run(harness.scenario(4, "stall", "memsvc"))
    check(result, "stall_memsvc")


def test_scheduler_stalled_past_its_lease(harness: FaultHarness) -> None:
    """Clients re-submit into the stalled scheduler (attached once it resumes); memsvc
    expired its session meanwhile, so every request that held KV is re-prefilled."""
    result = harness.run(harness.scenario(6, "stall", "scheduler_svc"))
    check(result, "stall_scheduler_svc")


def test_damaged_messages_on_every_link(harness: FaultHarness) -> None:
    result = harness.run(harness.scenario(5, "wire"))
    assert sum(result.faults.values()) >= 10, f"too few faults injected: {dict(result.faults)}"
    check(result, None)


# -- PD mode: prefill node, decode node, router ------------------------------------------


def test_pd_decode_memsvc_killed(pd_harness: FaultHarness) -> None:
    """memsvc-D comes back empty: the decode node re-bootstraps every request that held KV
    there (running, retracted to its host store, awaiting a transfer) through the prefill
    node; tokens do not change."""
    before = pd_harness.info()["stats"]["rebootstraps"]
    result = pd_harness.run(pd_harness.scenario(1, "kill_memsvc-d", trigger=60))
    check(result, "sigkill_memsvc-d")
    assert pd_harness.info()["stats"]["rebootstraps"] > before


def test_pd_prefill_scheduler_stalled(pd_harness: FaultHarness) -> None:
    """The decode node keeps decoding what it has (memsvc-P still sends the KV prefilled
    before the stall); the late requests that need a prefill fail after the router's
    --prefill-timeout, naming it; the prefill scheduler recovers its expired session."""
    resets = pd_harness.info()["prefill"]["recovery"]["memsvc_resets"]
    result = pd_harness.run(pd_harness.scenario(2, "stall", "scheduler-p", trigger=8))
    check(result, "stall_scheduler-p")
    assert pd_harness.info()["prefill"]["recovery"]["memsvc_resets"] > resets  # lease expired
    for outcome in result.outcomes:
        if outcome.status == "error":
            assert "prefill" in outcome.detail, outcome.detail


def test_pd_damaged_messages_between_router_and_decode(pd_harness: FaultHarness) -> None:
    result = pd_harness.run(pd_harness.scenario(3, "wire"))
    assert sum(result.faults.values()) >= 10, f"too few faults injected: {dict(result.faults)}"
    check(result, None)


# -- PD mode with the file storage tier, both memsvc on one directory (issue 26) ----------


def storage_roles(harness: FaultHarness) -> list[str]:
    return sorted(p.name.split("-")[0] for p in harness.storage_dir.iterdir())


def load_failures(harness: FaultHarness) -> int:
    total = 0
    for name in harness.memsvcs:
        with MemClient(harness.supervisor.address(name)) as mem:
            total += mem.stats()["hicache"].get("storage_load_failures", 0)
    return total


def test_pd_file_tier_damaged_pages(pd_storage_harness: FaultHarness) -> None:
    """Half the page files damaged under both memsvc before the workload runs again: the
    requests that meet them (on the prefill node) recompute, the tokens do not change,
    nothing is aborted. Before: wrong tokens, or every live request aborted."""
    before = load_failures(pd_storage_harness)
    result = pd_storage_harness.run(pd_storage_harness.scenario(4, "damage_storage"))
    assert sum(result.faults.values()) > 0, dict(result.faults)
    check(result, None)
    assert result.count("error") == 0, [o.detail for o in result.outcomes if o.detail]
    assert load_failures(pd_storage_harness) > before, "no damaged page was met"


def test_pd_file_tier_decode_memsvc_killed(pd_storage_harness: FaultHarness) -> None:
    """The kill matrix with the file tier: memsvc-D killed and restarted on the shared
    directory. Before: its restart deleted every page there, memsvc-P's included, and
    memsvc-P's idle check counted memsvc-D's pages as stray in every round."""
    harness = pd_storage_harness
    assert storage_roles(harness) == ["decode", "prefill"]
    result = harness.run(harness.scenario(5, "kill_memsvc-d", trigger=60))
    check(result, "sigkill_memsvc-d")  # both idle checks included (files == index)
    assert storage_roles(harness) == ["decode", "prefill"]  # the dead one's dir is gone


def test_pd_file_tier_prefill_memsvc_killed(pd_storage_harness: FaultHarness) -> None:
    result = pd_storage_harness.run(pd_storage_harness.scenario(6, "kill_memsvc-p", trigger=10))
    check(result, "sigkill_memsvc-p")
    assert storage_roles(pd_storage_harness) == ["decode", "prefill"]
