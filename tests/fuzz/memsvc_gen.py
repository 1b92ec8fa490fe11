"""Messages for memsvc's socket: valid ops, their mutations, garbage, and hostile-but-valid ops.

The hostile ones aim at the legitimate session (see :mod:`tests.fuzz.targets`):
its rid under the fuzzer's own session, its row in ``decode_step`` / ``retract``,
its cached tokens handed back under other ids, forged session ids, and op ids
replayed with another body. The legitimate session's own id is a capability
(whoever holds it is that session), so it is never sent.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from memsvc import protocol as wire
from tests.fuzz.mutate import Message, garbage, mutate

LEGIT_RID = "legit"
LEGIT_TOKENS = np.arange(1000, 1012, dtype=np.int64)  # three 4-token pages
RIDS = ("f0", "f1", "f2", LEGIT_RID)
TARGETS = ("free", "host_entry")  # retract targets (and "tree", which needs token ids)
# Retract: one target for every row, a target per row (None), or a bad one.
RETRACT_KINDS = ("free", "host_entry", None, "nope")


class MemsvcMessages:
    """Seeded message source for one fuzzing socket; ``observe`` each reply."""

    ops = wire.OP_NAMES

    def __init__(self, legit_row: int) -> None:
        self.legit_row = legit_row
        self.session: str | None = None
        self.op_id = 0
        self.sent_op_ids: list[int] = []

    def next(self, rng: random.Random) -> list[bytes]:
        if self.session is None:
            return self._frames({"op": "hello", "role": rng.choice(["scheduler", "worker"])}, {})
        roll = rng.random()
        if roll < 0.08:
            return garbage(rng)
        message = self._valid(rng)
        if roll < 0.3:
            return wire.pack(*message)
        if roll < 0.42:  # hostile but well formed
            header, arrays = message
            if rng.random() < 0.5 and self.sent_op_ids:
                header["op_id"] = rng.choice(self.sent_op_ids[-50:])
            else:
                header["session"] = rng.choice([rng.randbytes(8).hex(), "", self.session + "0"])
            return wire.pack(header, arrays)
        return mutate(message, rng, self.ops)

    def observe(self, header: dict[str, Any]) -> None:
        if header.get("ok") and isinstance(header.get("session"), str):
            self.session = header["session"]
        elif header.get("ok") and "reclaimed" in header:  # our goodbye: hello again
            self.session = None

    def forget_session(self) -> None:
        self.session = None

    def _frames(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> list[bytes]:
        return wire.pack(*self._stamp(header, arrays))

    def _stamp(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> Message:
        self.op_id += 1
        self.sent_op_ids.append(self.op_id)
        del self.sent_op_ids[:-200]
        stamped = {**header, "op_id": self.op_id}
        if self.session is not None:
            stamped["session"] = self.session
        return stamped, arrays

    def _valid(self, rng: random.Random) -> Message:
        op = rng.choice(self.ops)
        rid = rng.choice(RIDS)
        header: dict[str, Any] = {"op": op}
        arrays: dict[str, np.ndarray] = {}
        if op == "hello":
            header["role"] = rng.choice(["scheduler", "worker"])
        elif op == "check":
            header["idle"] = rng.random() < 0.2
        elif op in ("alloc_row", "free_row", "load", "host_discard"):
            header["rid"] = rid
        elif op in ("match_prefix", "cache_unfinished", "release"):
            header["rid"] = rid
            arrays["token_ids"] = self._tokens(rng)
            if op == "release":
                header["is_insert"] = rng.random() < 0.7
        elif op == "alloc_extend":
            rids = rng.sample(RIDS, rng.randint(1, 2))
            header["rids"] = rids
            arrays["num_tokens"] = np.array([rng.randint(0, 20) for _ in rids])
            if rng.random() < 0.3:  # the round's candidates not admitted (LEGIT_RID too)
                header["free_rids"] = rng.sample(RIDS, rng.randint(1, 2))
        elif op in ("admit", "cache_unfinished_many", "release_many"):
            rids = rng.sample(RIDS, rng.randint(1, 3))
            parts = [self._tokens(rng) for _ in rids]
            header["rids"] = rids
            arrays["token_ids"] = np.concatenate(parts)
            arrays["token_lens"] = np.array([part.size for part in parts])
            if op == "release_many":
                header["is_insert"] = [rng.random() < 0.7 for _ in rids]
        elif op in ("decode_step", "retract"):
            arrays["rows"] = self._rows(rng)
            if op == "retract":
                kind = rng.choice(RETRACT_KINDS)
                if kind is None:
                    header["targets"] = [TARGETS[rng.randrange(2)] for _ in arrays["rows"]]
                else:
                    header["targets"] = [kind] * len(arrays["rows"])
        elif op == "offload":
            header["rid"] = rid
            if rng.random() < 0.5:
                header["num_tokens"] = rng.randint(0, 16)
        elif op == "pd_expect":
            header.update(rid=rid, room=rng.randrange(8))
        elif op == "pd_send":
            header.update(rid=rid, room=rng.randrange(8), num_tokens=rng.randint(1, 12))
            header["first_token"] = rng.randrange(100)
        elif op in ("pd_status", "pd_forget"):
            arrays["rooms"] = np.array([rng.randrange(8)])
        return self._stamp(header, arrays)

    def _tokens(self, rng: random.Random) -> np.ndarray:
        kind = rng.randrange(3)
        if kind == 0:  # the legitimate session's cached prefix, or part of it
            return LEGIT_TOKENS[: rng.randint(1, LEGIT_TOKENS.size)].copy()
        if kind == 1:  # a forged tail on the legitimate prefix
            forged = np.arange(5000, 5000 + rng.randint(1, 12), dtype=np.int64)
            return np.concatenate([LEGIT_TOKENS[: rng.choice([4, 8])], forged])
        return np.array([rng.randrange(50) for _ in range(rng.randint(1, 24))])

    def _rows(self, rng: random.Random) -> np.ndarray:
        rows = [rng.randrange(8) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.5:
            rows.append(self.legit_row)
        return np.array(rows)
