"""How kvstack's long-running services set CPython's garbage collector (issue 28, item 4).

CPython's cyclic collector runs a young collection once 700 more container
objects (lists, dicts, tuples, instances) are alive than at the last one, and
a full (generation-2) collection every 100 young ones, if the objects that
survived since the last full one are at least a quarter of the rest. A full
collection traverses every tracked object the process holds: in memsvc the
prefix tree (every node, its children dict, its arrays), in the scheduler
every request's state, in both everything imported (about 40,000 objects,
8 ms a collection on a shared 2-core machine). While the tree grows, its
nodes survive and the defaults run such pauses, growing with the tree (one of
28-40 ms while a 22k-node tree grew, ``bench/gc_pause.py``); before issue 28
an eviction walked the tree building a list of every leaf, and collections
tripled the decode step's cost at batch 256 with a 5k-node tree. (With the
eviction heap a steady decode step allocates nothing that survives it: no
collection ran in 1,000 steps, with the defaults or with this policy.)

:func:`apply_gc_policy` is called once by each service's ``main`` after
start-up (everything imported, the pool built, before the first request):

- ``gc.freeze()`` moves every object alive then (modules, classes, pydantic's
  validators, the pool's own objects) to the permanent generation, which no
  collection traverses again: they live as long as the process anyway.
- :data:`THRESHOLDS` make young collections rarer (each one traverses only
  what survived since the last) and full collections rarer still.

The collector stays on: a reference cycle made while serving is still
collected, only later. kvstack's hot path makes none by design (an evicted
tree node is unlinked from its parent, so reference counting frees it at once).
``bench/gc_pause.py`` measures the step, the tree's growth and one full
collection with and without this policy.
"""

from __future__ import annotations

import gc
from typing import Any

# (young, middle, full): a young collection per 20,000 net new containers, a middle
# one per 10 young, a full one per 100 middle (and only if a quarter of the
# long-lived objects are new since the last, as CPython always requires).
THRESHOLDS = (20_000, 10, 100)

_frozen = 0  # objects the policy froze (gc.get_freeze_count walks them all: ~1 ms)


def apply_gc_policy() -> dict[str, Any]:
    """Collect what start-up left, freeze what survives, set :data:`THRESHOLDS`.

    Returns :func:`gc_state`. Call it once, after start-up and before serving.
    """
    global _frozen
    gc.collect()  # start-up's garbage, so that it is not frozen with the rest
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    _frozen = gc.get_freeze_count()
    return gc_state()


def gc_state() -> dict[str, Any]:
    """What the collector is doing: the objects :func:`apply_gc_policy` froze (0 if it
    did not run), thresholds, collections so far by generation. Cheap (a few µs)."""
    return {
        "frozen": _frozen,
        "thresholds": list(gc.get_threshold()),
        "collections": [s["collections"] for s in gc.get_stats()],
    }
