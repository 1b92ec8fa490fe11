"""What one client may cost ``kvstack serve``'s front: bytes, scheduler requests, time, sockets.

SGLang's HTTP server sets none of these limits itself; each is a flag here
(:func:`add_limit_arguments`), said in ``--help`` and in
``docs/sglang-differences.md``:

* ``--max-request-body-bytes``: a larger body is refused with 413 before it is
  read (by its Content-Length; a chunked one once it passes the cap). The
  default takes the largest prompt the scheduler takes (``MAX_PROMPT_TOKENS``
  ids of six digits as JSON is 8 MiB) twice over.
* ``--max-batch-requests``: the scheduler requests one body may become, a
  batch's prompts × ``n``; the prompt list alone is checked before its items
  are validated. Past it: 400 naming the cap.
* ``--http-header-timeout``: a connection must deliver a request's headers
  within this long of opening (or of its previous answer), else aiohttp closes
  it (its ``keepalive_timeout``).
* ``--http-body-timeout``: a body must arrive whole within this long of its
  headers, else 408; the rest of a refused body is drained for at most this
  long too (aiohttp's ``lingering_time``) before the connection is closed.
* ``--max-connections``: connections held at once
  (:class:`kvstack.serve.connections.ConnectionGuard`); by default a quarter of
  the open-file limit, at most 512, so that the front never runs out of
  descriptors.

Bodies over :data:`INLINE_PARSE_BYTES` are decoded and validated in a worker
thread, :data:`OFFLOAD_CONCURRENCY` at a time, so that the event loop keeps
answering other requests meanwhile.
"""

from __future__ import annotations

import argparse
import resource
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_BATCH_REQUESTS = 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
MAX_DEFAULT_CONNECTIONS = 512
MAX_LISTEN_BACKLOG = 128  # aiohttp's
FD_RESERVE = 64  # descriptors the front needs besides its connections (ZMQ, logs...)
LINGERING_S = 10.0  # aiohttp's default drain of an unread body
INLINE_PARSE_BYTES = 64 << 10
OFFLOAD_CONCURRENCY = 2


def open_file_limit() -> int | None:
    """The process's soft limit on open files; None when there is none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def listen_backlog() -> int:
    """The listening socket's backlog, which is also how many connections asyncio accepts
    in one go, before the cap sees any: an eighth of the open-file limit, at most 128."""
    limit = open_file_limit()
    return MAX_LISTEN_BACKLOG if limit is None else max(1, min(MAX_LISTEN_BACKLOG, limit // 8))


def default_max_connections() -> int:
    """A quarter of the open-file limit, at most :data:`MAX_DEFAULT_CONNECTIONS`: room for
    the sockets accepted in one go before the cap closes them, and the front's own."""
    limit = open_file_limit()
    if limit is None:
        return MAX_DEFAULT_CONNECTIONS
    return max(1, min(MAX_DEFAULT_CONNECTIONS, limit // 4))


@dataclass(frozen=True, slots=True)
class FrontLimits:
    """The front's bounds on one client (see the module's docstring for each)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_batch_requests: int = DEFAULT_MAX_BATCH_REQUESTS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = field(default_factory=default_max_connections)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_batch_requests", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be more than 0, got {getattr(self, name)}")

    def fd_problem(self) -> str | None:
        """Why ``max_connections`` does not fit the open-file limit, or None: the
        connections, two bursts of accepted sockets (those the cap is closing, and the
        next) and :data:`FD_RESERVE` must fit."""
        limit = open_file_limit()
        if limit is None:
            return None
        most = limit - 2 * listen_backlog() - FD_RESERVE
        if self.max_connections > most:
            return (
                f"--max-connections {self.max_connections} does not fit the open-file limit "
                f"({limit}): at most {max(most, 0)} here, or raise the limit (ulimit -n)"
            )
        return None

    def aiohttp_settings(self) -> dict[str, Any]:
        """The aiohttp server settings that carry the time limits."""
        return {
            "keepalive_timeout": self.header_timeout_s,
            "lingering_time": min(LINGERING_S, self.body_timeout_s),
        }


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "limits", "what one client may cost the front (SGLang's server has none of these)"
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES",
        help="a larger body gets 413 before it is read (default: %(default)s, 16 MiB: the "
        "largest prompt the scheduler takes, as JSON ids, twice over)",
    )
    group.add_argument(
        "--max-batch-requests",
        type=int,
        default=DEFAULT_MAX_BATCH_REQUESTS,
        metavar="N",
        help="scheduler requests one body may become (a batch's prompts × n); more gets "
        "400 (default: %(default)s)",
    )
    group.add_argument(
        "--http-header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="a connection that has not sent a request's headers this long after opening "
        "(or after its last answer) is closed (default: %(default)s)",
    )
    group.add_argument(
        "--http-body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        metavar="SECONDS",
        help="a body not received whole this long after its headers gets 408 (default: "
        "%(default)s)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="connections held at once; past it the one waiting longest for its headers or "
        "body is closed, or, if none is, the new one gets 503 (default: a quarter of the "
        f"open-file limit, at most {MAX_DEFAULT_CONNECTIONS}; here {default_max_connections()})",
    )


def limits_from_args(args: argparse.Namespace) -> FrontLimits:
    """:class:`FrontLimits` from :func:`add_limit_arguments`'s flags; ValueError if invalid."""
    connections = args.max_connections
    return FrontLimits(
        max_body_bytes=args.max_request_body_bytes,
        max_batch_requests=args.max_batch_requests,
        header_timeout_s=args.http_header_timeout,
        body_timeout_s=args.http_body_timeout,
        **({} if connections is None else {"max_connections": connections}),
    )
