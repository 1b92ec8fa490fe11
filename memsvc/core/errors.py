"""Typed errors raised by the memsvc core.

Every error carries a stable ``code`` string: the service shell puts it in the
error reply, so clients can branch on it without parsing messages. A core
operation that raises has changed nothing.
"""

from __future__ import annotations


class MemsvcError(Exception):
    """Base class of every memsvc error."""

    code = "internal"


class InvalidArgumentError(MemsvcError, ValueError):
    """A size, count or index is negative, out of range or of the wrong shape."""

    code = "invalid_argument"


class InvalidPageError(InvalidArgumentError):
    """A page or slot index outside the pool (page 0 is reserved and never valid)."""

    code = "invalid_page"


class DoubleFreeError(MemsvcError):
    """A page was freed that is already on the free list."""

    code = "double_free"


class PageOwnershipError(MemsvcError):
    """A page was freed or claimed by someone who does not hold it (e.g. it belongs to the tree)."""

    code = "page_ownership"


class UnknownRequestError(MemsvcError, KeyError):
    """No request (or host-store entry) with that id."""

    code = "unknown_request"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown request"


class DuplicateRequestError(MemsvcError):
    """A request id that is already in use."""

    code = "duplicate_request"


class OutOfRowsError(MemsvcError):
    """No free req_to_token row."""

    code = "out_of_rows"


class HostStoreFullError(MemsvcError):
    """The host store has no room for the entry."""

    code = "host_store_full"


class CopyFailedError(MemsvcError):
    """An asynchronous offload copy failed; the host copy is unusable (and dropped)."""

    code = "copy_failed"


class BackendUnavailableError(MemsvcError):
    """The requested buffer backend cannot run here (e.g. ``cuda`` without a GPU or cupy)."""

    code = "backend_unavailable"


class IntegrityError(MemsvcError, AssertionError):
    """``check_integrity()`` found a page in two places, a leak, or wrong accounting."""

    code = "integrity"
