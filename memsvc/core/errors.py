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


class StoredPageError(MemsvcError):
    """A page read back from the storage tier is missing, short, corrupt or unreadable.

    Raised on the copy thread by a load; it ends that load's fence. ``loaded``
    holds the keys the load verified and copied before it met the bad one: the
    prefix they cover is still good.
    """

    code = "stored_page"

    def __init__(self, message: str, loaded: frozenset[str] = frozenset()) -> None:
        super().__init__(message)
        self.loaded = loaded


class PrefixCutError(MemsvcError):
    """A request's matched prefix was cut back since its match: a page loaded for it
    failed verification (a miss for that request alone).

    ``cut`` maps each such request to its prefix length now; its row holds that
    much KV, still locked, and nothing was allocated. The caller recomputes from
    there (or releases the request and matches again).
    """

    code = "prefix_cut"

    def __init__(self, message: str, cut: dict[str, int] | None = None) -> None:
        super().__init__(message)
        self.cut = dict(cut or {})

    @classmethod
    def of(cls, cut: dict[str, int]) -> PrefixCutError:
        held = ", ".join(f"{rid!r} now holds {n} tokens" for rid, n in cut.items())
        return cls(f"a cached prefix failed to load and was cut back: {held}", cut)


class BackendUnavailableError(MemsvcError):
    """The requested buffer backend cannot run here (e.g. ``cuda`` without a GPU or cupy)."""

    code = "backend_unavailable"


class IntegrityError(MemsvcError, AssertionError):
    """``check_integrity()`` found a page in two places, a leak, or wrong accounting."""

    code = "integrity"
