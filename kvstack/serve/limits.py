"""What one client may cost ``kvstack serve``'s front: bytes and scheduler requests.

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

Bodies over :data:`INLINE_PARSE_BYTES` are decoded and validated in a worker
thread, :data:`OFFLOAD_CONCURRENCY` at a time, so that the event loop keeps
answering other requests meanwhile.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_BATCH_REQUESTS = 1024
INLINE_PARSE_BYTES = 64 << 10
OFFLOAD_CONCURRENCY = 2


@dataclass(frozen=True, slots=True)
class FrontLimits:
    """The front's bounds on one client (see the module's docstring for each)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_batch_requests: int = DEFAULT_MAX_BATCH_REQUESTS

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_batch_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


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


def limits_from_args(args: argparse.Namespace) -> FrontLimits:
    """:class:`FrontLimits` from :func:`add_limit_arguments`'s flags; ValueError if invalid."""
    return FrontLimits(
        max_body_bytes=args.max_request_body_bytes,
        max_batch_requests=args.max_batch_requests,
    )
