"""The garbage collector's policy in kvstack's services (issue 28, item 4).

memsvc and the scheduler call :func:`memsvc.gcpolicy.apply_gc_policy` once
started: what lives then is frozen (no full collection traverses it again) and
the thresholds make full collections rare. Both report the collector's state
(memsvc in ``stats``, the scheduler in ``info``).
"""

from __future__ import annotations

import gc

from memsvc import gcpolicy
from memsvc.client import MemClient
from memsvc.gcpolicy import THRESHOLDS, apply_gc_policy


def test_the_policy_freezes_what_lives_and_sets_the_thresholds(monkeypatch) -> None:
    monkeypatch.setattr(gcpolicy, "_frozen", 0)  # restored after: this process is not a service
    saved = gc.get_threshold()
    try:
        state = apply_gc_policy()
        assert state["frozen"] > 0 and state["frozen"] == gc.get_freeze_count()
        assert gc.get_threshold() == THRESHOLDS and state["thresholds"] == list(THRESHOLDS)
        # rarer full collections than CPython's default (700, 10, 10): one per 70,000
        # net new containers at most
        assert THRESHOLDS[0] * THRESHOLDS[1] * THRESHOLDS[2] > 700 * 10 * 10
    finally:
        gc.unfreeze()
        gc.set_threshold(*saved)


def test_memsvc_applies_the_policy_once_started(memsvc) -> None:
    with MemClient(memsvc.address) as mem:
        state = mem.stats()["gc"]
    assert state["frozen"] > 10_000  # at least the imports (memsvc, numpy, pydantic, zmq)
    assert state["thresholds"] == list(THRESHOLDS)
    assert len(state["collections"]) == 3
