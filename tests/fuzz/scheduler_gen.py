"""Messages for scheduler_svc's generate socket: generate / abort / info, mutated.

Valid generates are short (a few new tokens) so a run stays quick. The hostile
ones: the legitimate client's rid resubmitted or aborted under the fuzzer's own
client id, sampling values at float32's edges, prompts past the token limit,
PD-only fields on a normal stack, and op ids replayed with another body.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from memsvc import protocol as wire
from scheduler_svc.protocol import MAX_PROMPT_TOKENS
from tests.fuzz.mutate import EDGE_INTS, Message, garbage, mutate

LEGIT_PROMPT = list(range(3, 20))
OPS = ("generate", "abort", "info")
EDGE_FLOATS = [0.0, 1e-300, 1e-46, -0.0, 1.0, 2.0, 1e308, float("nan"), float("inf"), -1.0]


class SchedulerMessages:
    ops = OPS

    def __init__(self, client_id: str = "fuzzer") -> None:
        self.client_id = client_id
        self.op_id = 0
        self.sent_op_ids: list[int] = []
        self.rids: list[str] = ["f0"]

    def next(self, rng: random.Random) -> list[bytes]:
        roll = rng.random()
        if roll < 0.08:
            return garbage(rng)
        message = self._valid(rng)
        if roll < 0.3:
            return wire.pack(*message)
        if roll < 0.45:
            header, arrays = message
            if self.sent_op_ids and rng.random() < 0.5:
                header["op_id"] = rng.choice(self.sent_op_ids[-50:])
            else:
                self._hostile(message, rng)
            return wire.pack(header, arrays)
        return mutate(message, rng, self.ops)

    def observe(self, header: dict[str, Any]) -> None:
        pass

    def _valid(self, rng: random.Random) -> Message:
        self.op_id += 1
        self.sent_op_ids.append(self.op_id)
        del self.sent_op_ids[:-200]
        op = rng.choices(OPS, weights=[6, 2, 1])[0]
        header: dict[str, Any] = {"op": op, "op_id": self.op_id}
        arrays: dict[str, np.ndarray] = {}
        if op == "info":
            return header, arrays
        header["client"] = self.client_id
        header["rid"] = self._rid(rng, op)
        if op == "abort":
            return header, arrays
        sampling: dict[str, Any] = {"max_new_tokens": rng.randint(0, 6)}
        if rng.random() < 0.5:
            sampling.update(temperature=rng.choice([0.0, 0.7, 1.0]), seed=rng.randrange(9))
            sampling.update(top_p=rng.choice([1.0, 0.9]), top_k=rng.randrange(4))
        if rng.random() < 0.3:
            sampling.update(ignore_eos=True, stop_token_ids=[rng.randrange(300)])
        header["sampling"] = sampling
        header["stream"] = rng.random() < 0.3
        if rng.random() < 0.8:
            arrays["input_ids"] = np.array(
                [rng.randrange(256) for _ in range(rng.randint(1, 40))], dtype=np.int64
            )
        else:
            header["text"] = rng.choice(["hi", "", "a b c", "\u00e9\u4e2d"])
        return header, arrays

    def _rid(self, rng: random.Random, op: str) -> str:
        if rng.random() < 0.15:
            return "legit"  # the legitimate client's rid (not its client id)
        if op == "generate" and rng.random() < 0.5:
            self.rids = [*self.rids[-20:], f"f{self.op_id}"]
            return self.rids[-1]
        return rng.choice(self.rids)

    def _hostile(self, message: Message, rng: random.Random) -> None:
        header, arrays = message
        sampling = dict(header.get("sampling", {}))
        key = rng.choice(["temperature", "top_p", "top_k", "seed", "max_new_tokens", "extra"])
        sampling[key] = rng.choice([*EDGE_FLOATS, *EDGE_INTS, "1", None, [1]])
        header["sampling"] = sampling
        kind = rng.randrange(4)
        if kind == 0:
            header["priority"] = rng.choice(EDGE_INTS)
        elif kind == 1:
            header["bootstrap_room"] = rng.choice(EDGE_INTS)
        elif kind == 2:
            arrays["input_ids"] = np.ones(MAX_PROMPT_TOKENS + rng.randrange(2), dtype=np.int64)
            header.pop("text", None)
