"""Seeded mutations of a valid message, shared by every socket's generator.

A message is a header map plus named int64 arrays (:func:`memsvc.protocol.pack`).
Each mutation keeps the whole message small (a few KiB, a handful of frames),
so a reply is always due: what a service drops unread for its size is
``tests/bounds.py``'s business, not the fuzzers'.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from memsvc import protocol as wire

Message = tuple[dict[str, Any], dict[str, np.ndarray]]

# Ints at and past every width a decoder may store them in.
EDGE_INTS = [0, -1, 1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63), 2**64 - 1, 10**18]


def hostile_value(rng: random.Random) -> Any:
    """A value of a wrong type or an edge magnitude."""
    kind = rng.randrange(10)
    if kind == 0:
        return rng.choice(EDGE_INTS)
    if kind == 1:
        return rng.choice([None, True, False, float("nan"), float("inf"), -0.0, 1e308])
    if kind == 2:
        return rng.choice(["", "x" * rng.randrange(300), "\u0000", "r0", "nope", "\u00e9" * 3])
    if kind == 3:
        return rng.randbytes(rng.randrange(16))
    if kind == 4:
        return [rng.choice(EDGE_INTS) for _ in range(rng.randrange(5))]
    if kind == 5:
        return {"k": rng.choice(EDGE_INTS), "n": [None, {}]}
    if kind == 6:
        return nested(rng.randrange(1, 400))
    if kind == 7:
        return rng.randrange(-(2**64), 2**64)
    if kind == 8:
        return rng.uniform(-1e6, 1e6)
    return []


def nested(depth: int) -> Any:
    value: Any = 0
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


def hostile_array(rng: random.Random) -> np.ndarray:
    kind = rng.randrange(5)
    if kind == 0:
        return np.array([], dtype=np.int64)
    if kind == 1:
        return np.array([rng.choice(EDGE_INTS[:8]) for _ in range(rng.randint(1, 8))])
    if kind == 2:
        return np.full(rng.randint(1, 512), rng.randrange(-4, 300), dtype=np.int64)
    if kind == 3:
        return np.arange(rng.randint(1, 64), dtype=np.int64) * rng.choice([-1, 1, 7])
    return np.array([rng.randrange(-(2**63), 2**63) for _ in range(rng.randint(1, 4))])


def _drop_field(header, arrays, rng):
    keys = [k for k in header if k != "op"] or list(header)
    if keys:
        header.pop(rng.choice(keys))


def _extra_field(header, arrays, rng):
    header[rng.choice(["evil", "arrays_", "session_", "x" * 40, "op_id "])] = hostile_value(rng)


def _retype_field(header, arrays, rng):
    header[rng.choice(list(header) or ["op"])] = hostile_value(rng)


def _retype_array(header, arrays, rng):
    if arrays and rng.random() < 0.5:
        name = rng.choice(list(arrays))
        if rng.random() < 0.5:
            arrays[name] = hostile_array(rng)
        else:  # an array's field sent in the header instead
            header[name] = arrays.pop(name).tolist()
    else:
        arrays[rng.choice(["rows", "token_ids", "num_tokens", "input_ids", "rooms", "z"])] = (
            hostile_array(rng)
        )


def _other_op(header, arrays, rng, ops: tuple[str, ...] = ()) -> None:
    header["op"] = rng.choice([*ops, "nope", "", "HELLO", "check "]) if ops else "nope"


HEADER_MUTATIONS: list[Callable[..., None]] = [
    _drop_field,
    _extra_field,
    _retype_field,
    _retype_field,
    _retype_array,
    _retype_array,
]


def mutate_frames(frames: list[bytes], rng: random.Random) -> list[bytes]:
    """Damage the framing itself: flipped, cut, duplicated, dropped, swapped or extra frames."""
    frames = list(frames)
    i = rng.randrange(len(frames))
    kind = rng.randrange(7)
    if kind == 0 and frames[i]:
        data = bytearray(frames[i])
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        frames[i] = bytes(data)
    elif kind == 1:
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    elif kind == 2:
        frames.insert(i, frames[i])
    elif kind == 3:
        frames.pop(i)
    elif kind == 4:
        j = rng.randrange(len(frames))
        frames[i], frames[j] = frames[j], frames[i]
    elif kind == 5:
        frames.append(rng.randbytes(rng.randrange(24)))
    else:  # a header that is valid msgpack but not a map
        frames[0] = msgpack.packb(rng.choice([[1, 2], 7, "op", None, b"\x00"]))
    return frames or [b""]


def mutate(message: Message, rng: random.Random, ops: tuple[str, ...]) -> list[bytes]:
    """One to three header/array mutations of ``message``, sometimes frame damage on top."""
    header, arrays = dict(message[0]), dict(message[1])
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.1:
            _other_op(header, arrays, rng, ops)
        else:
            rng.choice(HEADER_MUTATIONS)(header, arrays, rng)
    try:
        frames = wire.pack(header, arrays)
    except (TypeError, ValueError, OverflowError):  # msgpack cannot say it: send garbage instead
        frames = [rng.randbytes(rng.randrange(1, 32))]
    if rng.random() < 0.2:
        frames = mutate_frames(frames, rng)
    return frames


def garbage(rng: random.Random) -> list[bytes]:
    return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randint(1, 4))]
