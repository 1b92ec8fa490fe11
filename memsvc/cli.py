"""Command-line pieces every kvstack service shares: where it listens, its ready file, logs.

Also memsvc's pool defaults, which the ``kvstack`` commands size pools from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import IO, Any

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


def make_private_dirs(path: str | os.PathLike) -> Path:
    """``mkdir -p path``, each folder it creates 0700 (one that exists keeps its mode)."""
    path = Path(path)
    for folder in reversed([path, *path.parents]):
        if not folder.exists():
            folder.mkdir(mode=0o700, exist_ok=True)
    return path


def write_private_file(path: str | os.PathLike, text: str) -> None:
    """Atomically replace ``path`` with ``text``, readable and writable by this user only.

    Through ``PATH.tmp``, created anew (0600 whatever the umask; a stale one is
    removed first, a link there is not followed).
    """
    tmp = f"{path}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def open_private_log(path: str | os.PathLike) -> IO[bytes]:
    """``path`` opened to append bytes, created 0600 if it is new."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


def write_ready_file(path: str | None, address: str, **info: Any) -> None:
    """Atomically write ``{address, pid, **info}`` to ``path`` (if given): "I am serving"."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"address": address, "pid": os.getpid(), **info}, f)
    os.replace(tmp, path)
