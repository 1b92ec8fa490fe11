"""Command-line pieces every kvstack service shares: where it listens, its ready file, logs.

Also memsvc's pool defaults, which the ``kvstack`` commands size pools from.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

DEFAULT_PAGE_SIZE = 16  # tokens per KV page
DEFAULT_NUM_PAGES = 1024  # usable pages: 16384 tokens at the default page size


def add_service_args(parser: Any, *, ready_fields: str, also_remote: str = "") -> None:
    """``--listen``, ``--allow-remote``, ``--ready-file`` and ``--log-level``.

    ``also_remote``: what else of this service ``--allow-remote`` opens up.
    """
    parser.add_argument(
        "--listen",
        default=None,
        help="ipc://PATH or tcp://127.0.0.1:PORT (default: an ipc:// socket in a private "
        "runtime folder, printed at start)",
    )
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --listen address" + also_remote,
    )
    parser.add_argument(
        "--ready-file",
        default=None,
        help=f"write {{{ready_fields}}} as JSON here once serving",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log verbosity",
    )


def setup_logging(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)


def write_ready_file(path: str | None, address: str, **info: Any) -> None:
    """Atomically write ``{address, pid, **info}`` to ``path`` (if given): "I am serving"."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"address": address, "pid": os.getpid(), **info}, f)
    os.replace(tmp, path)
