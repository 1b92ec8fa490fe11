"""Copy fences: how the pool knows an asynchronous copy has finished.

A backend that copies asynchronously (a CUDA copy stream, a copy thread on
the shm backend) hands back a fence per copy; the allocator keeps pages that
copy reads off the free list, and the host store keeps the entry it writes
unreadable, until the fence is done. Copies finish in the order they were
issued, so waiting on a newer fence also covers every older copy.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol


class CopyFence(Protocol):
    def done(self) -> bool:
        """True once the copy has finished (successfully or not)."""

    def wait(self) -> None:
        """Block until the copy has finished. Never raises for a failed copy."""

    def error(self) -> BaseException | None:
        """The copy's failure, once done; ``None`` if it succeeded."""


class DoneFence:
    """A copy that ran synchronously and has finished."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def error(self) -> BaseException | None:
        return None


DONE = DoneFence()


class FailedFence(DoneFence):
    """A copy that ran synchronously and failed (``error`` says how)."""

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def error(self) -> BaseException | None:
        return self._error


class FutureFence:
    """A copy running on a thread pool (the shm backend's copy thread)."""

    def __init__(self, future: Future[Any]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.exception()  # waits; returns the failure instead of raising it

    def error(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None


class EventFence:
    """A copy on a CUDA stream, followed by an event recorded on that stream."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.done)

    def wait(self) -> None:
        self._event.synchronize()

    def error(self) -> BaseException | None:
        return None  # a failed async copy surfaces as a CUDA error on the next call
