"""What a checkpoint asks of the stack: memsvc's pool layout, and the worker's CPU threads.

memsvc holds the KV of every layer, so its layout (layers, KV heads, head
dimension) is the model's: the launcher reads it from the checkpoint's
``config.json`` instead of trusting flags. A layout flag a user passes anyway
must agree with the checkpoint; one that contradicts it is refused, naming
both values.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

# memsvc flag -> the ModelConfig field it must equal
LAYOUT_FIELDS = {
    "--num-layers": "num_hidden_layers",
    "--num-kv-heads": "num_key_value_heads",
    "--head-dim": "head_dim",
}


class PoolMismatchError(ValueError):
    """A pool flag contradicts the checkpoint the pool is for."""


def given_flags(args: Sequence[str]) -> dict[str, str]:
    """``--flag value`` and ``--flag=value`` pairs in ``args`` (the last one wins, as argparse)."""
    found: dict[str, str] = {}
    for i, arg in enumerate(args):
        name, sep, value = arg.partition("=")
        if name.startswith("--") and sep:
            found[name] = value
        elif arg.startswith("--") and i + 1 < len(args):
            found[arg] = args[i + 1]
    return found


def pool_layout_args(checkpoint: str | Path, given: Sequence[str] = ()) -> list[str]:
    """memsvc's layout flags for ``checkpoint``; ``given``: the pool flags a user passed.

    Raises :class:`PoolMismatchError` when ``given`` sets a layout flag to
    another value than the checkpoint's (and ``CheckpointError`` for a
    checkpoint whose config cannot be read).
    """
    from model_svc.config import ModelConfig

    config = ModelConfig.from_file(Path(checkpoint) / "config.json")
    user = given_flags(given)
    out: list[str] = []
    for flag, name in LAYOUT_FIELDS.items():
        value = getattr(config, name)
        if flag in user and user[flag] != str(value):
            raise PoolMismatchError(
                f"memsvc {flag} {user[flag]} contradicts the checkpoint {checkpoint}: "
                f"its config.json has {name} = {value}"
            )
        out += [flag, str(value)]
    return out


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def worker_threads(num_workers: int) -> int:
    """torch threads for each of ``num_workers`` model workers sharing this machine's cores."""
    return max(1, usable_cores() // max(1, num_workers))
