"""What a checkpoint asks of the stack: memsvc's pool layout, and the worker's CPU threads.

memsvc also gets the checkpoint's model digest (``--model-digest``,
:mod:`kvstack.model.digest`), which names every KV page it stores.

memsvc holds the KV of every layer, so its layout (layers, KV heads, head
dimension) is the model's: the launcher reads it from the checkpoint's
``config.json`` instead of trusting flags. A layout flag a user passes anyway
must agree with the checkpoint; one that contradicts it is refused, naming
both values.

A model with sliding-window layers (``sliding_window`` and ``layer_types`` in
its config, as transformers writes them) gets ``--layer-types`` and
``--sliding-window`` too, so memsvc builds SGLang's two pools (full and SWA)
with nothing passed by the user. ``--layer-types`` given with every layer
``full_attention`` is the one accepted departure from the checkpoint: one pool
for every layer (SGLang's ``--disable-hybrid-swa-memory``), the worker still
masking each sliding layer to its window.
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


FULL_ATTENTION = "full_attention"


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
    from kvstack.model.digest import model_digest
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
    # the KV's model identity (memsvc.core.identity): a kept storage tier needs it
    out += ["--model-digest", user.get("--model-digest") or model_digest(checkpoint)]
    return out + window_args(config, checkpoint, user)


def all_full_layer_types(num_layers: int) -> list[str]:
    """``--layer-types`` for one pool holding every layer (hybrid SWA memory disabled)."""
    return ["--layer-types", ",".join([FULL_ATTENTION] * num_layers)]


def window_args(config, checkpoint: str | Path, user: dict[str, str]) -> list[str]:
    """``--layer-types`` / ``--sliding-window`` of a model with sliding layers (none without).

    A user's ``--layer-types`` must be the checkpoint's or every layer full (then
    no ``--sliding-window``: one pool); a user's ``--sliding-window`` must be the
    checkpoint's.
    """
    types = ",".join(config.layer_types)
    window = str(config.sliding_window or 0)
    given_types = user.get("--layer-types")
    all_full = ",".join([FULL_ATTENTION] * config.num_hidden_layers)
    if given_types is not None:
        given_types = ",".join(t.strip() for t in given_types.split(",") if t.strip())
    if given_types == all_full and (config.sliding_layer_ids or not config.layer_types):
        if user.get("--sliding-window", "0") != "0":
            raise PoolMismatchError(
                f"memsvc --sliding-window {user['--sliding-window']} with every layer "
                "full_attention in --layer-types (one pool, no SWA pool)"
            )
        return []  # the user's flags say it: one pool for every layer
    if not config.sliding_layer_ids:
        for flag in ("--layer-types", "--sliding-window"):
            if flag in user and user[flag] not in ("0", all_full):
                raise PoolMismatchError(
                    f"memsvc {flag} {user[flag]} contradicts the checkpoint {checkpoint}: "
                    "its config.json has no sliding_attention layer"
                )
        return []
    for flag, value, name in (
        ("--layer-types", types, "layer_types"),
        ("--sliding-window", window, "sliding_window"),
    ):
        mine = given_types if flag == "--layer-types" else user.get(flag)
        if mine is not None and mine != value:
            raise PoolMismatchError(
                f"memsvc {flag} {user[flag]} contradicts the checkpoint {checkpoint}: its "
                f"config.json has {name} = {value} (every layer full_attention is the one "
                "other --layer-types it takes: one pool)"
            )
    return ["--layer-types", types, "--sliding-window", window]


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def worker_threads(num_workers: int) -> int:
    """torch threads for each of ``num_workers`` model workers sharing this machine's cores."""
    return max(1, usable_cores() // max(1, num_workers))
