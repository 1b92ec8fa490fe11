"""Is the scheduler getting anywhere? How long it has had work and made no progress.

A node that answers pings can still be wedged: requests queued, and every
step finding nothing it can do (a prompt that waits for pages nobody will
give back, a transfer room nobody will fill). :class:`StallWatch` is told
about each step of the engine loop and reports, in ``info``, for how long
the node has had work without a step that did any. A step still running (a
long forward pass) is not a stall: the clock stops while it runs. The PD
router reads both nodes' reports, and a stack in which no node with work
has progressed for its ``--stall-timeout`` is unhealthy (``kvstack status``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class StallWatch:
    busy: bool = False  # the engine had work after its last step
    stalled_since: float | None = None  # first step with work that did nothing, since progress
    step_started: float | None = None  # the step running now, if one is

    def step_begins(self, now: float) -> None:
        self.step_started = now

    def step_ends(self, now: float, *, progressed: bool, busy: bool) -> None:
        self.step_started = None
        self.busy = busy
        if progressed or not busy:
            self.stalled_since = None
        elif self.stalled_since is None:
            self.stalled_since = now

    def stalled_s(self, now: float) -> float:
        """Seconds with work and no progress (0 while idle or progressing)."""
        if self.stalled_since is None:
            return 0.0
        until = self.step_started if self.step_started is not None else now
        return max(until - self.stalled_since, 0.0)

    def report(self, now: float) -> dict[str, Any]:
        return {"busy": self.busy, "stalled_s": self.stalled_s(now)}


def wedged(reports: dict[str, dict[str, Any] | None], stall_timeout_s: float) -> str | None:
    """Why a stack of nodes is wedged, or None: some node has work, and none with work has
    progressed for ``stall_timeout_s``. ``reports``: each node's :meth:`StallWatch.report`
    (None for a node that did not answer, which says nothing either way)."""
    busy = {name: r for name, r in reports.items() if r and r.get("busy")}
    if not busy or any(r.get("stalled_s", 0.0) < stall_timeout_s for r in busy.values()):
        return None
    stalls = ", ".join(f"the {name} node for {r['stalled_s']:.0f}s" for name, r in busy.items())
    return f"wedged: requests wait and nothing progresses ({stalls})"
