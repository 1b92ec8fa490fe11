"""A service started by a kvstack launcher dies with it, even when the launcher is SIGKILLed.

The launcher (``kvstack.stack.launch``, the ``kvstack up`` supervisor) puts
:func:`child_env` in the child's environment; the child's ``main`` calls
:func:`die_with_parent` first thing. The child then gets SIGTERM, and so runs
its usual clean shutdown (memsvc unlinks its shared memory), when the
launcher's process ends:

- spawned from the launcher's main thread: Linux's parent-death signal
  (``PR_SET_PDEATHSIG``), set in the child itself: a ``preexec_fn`` is not
  safe in a process with threads;
- spawned from another thread: the parent-death signal would fire when *that
  thread* ends, so a daemon thread watches ``getppid()`` instead (the parent
  process is gone once the child has been re-parented).

Either way the child checks its parent once the watch is set, so a launcher
that died before that is not missed. Until the service's shell handles SIGTERM
(and again once it stops: :func:`memsvc.server.stop_on_signals`),
SIGTERM raises :class:`SystemExit`, so a service stopped while it starts up
still runs its ``finally`` blocks (memsvc unlinks its segments).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

from memsvc.core.backends.shm import install_sigterm_cleanup

PARENT_ENV = "KVSTACK_PARENT"  # "PID" (spawned from its main thread) or "PID:thread"
PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 0.25


def child_env() -> dict[str, str]:
    """For a child's environment, set by the process that spawns it (this one)."""
    main = threading.current_thread() is threading.main_thread()
    return {PARENT_ENV: str(os.getpid()) if main else f"{os.getpid()}:thread"}


def die_with_parent() -> None:
    """In a service's ``main``, first: SIGTERM to itself once the launcher named in
    :data:`PARENT_ENV` is gone (no watch if the variable is unset)."""
    if threading.current_thread() is threading.main_thread():  # else signal.signal raises
        install_sigterm_cleanup()
    value = os.environ.pop(PARENT_ENV, None)  # not for this service's own children
    if not value:
        return
    pid, _, spawner = value.partition(":")
    parent = int(pid)
    if spawner == "thread" or not _set_parent_death_signal():
        threading.Thread(
            target=_watch_parent, args=(parent,), name="parent-watch", daemon=True
        ).start()
    elif os.getppid() != parent:  # it died before the signal was set
        os.kill(os.getpid(), signal.SIGTERM)


def _set_parent_death_signal() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    os.kill(os.getpid(), signal.SIGTERM)
