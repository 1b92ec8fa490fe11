"""model_svc's worker socket, fuzzed beside a legitimate request (a real memsvc and worker).

model_svc trusts its scheduler with rows and positions (it writes KV where
``req_to_token`` says), so the fuzzer forwards only its own request's row,
and rows past the table; the rest is mutated freely: lengths, token ids past
the vocabulary, sampling at float32's edges, wrong pool epochs, types and
frames. After each batch the legitimate request's KV pages must hold the
bytes they held, its greedy extend must give the same token, and memsvc's
check must pass.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np

from kvstack.stack.launch import Launcher
from kvstack.stack.model_pool import pool_layout_args
from memsvc import protocol as wire
from memsvc.client import MemClient
from model_svc.client import ForwardError, ModelClient
from tests.fuzz.mutate import EDGE_INTS, garbage, mutate
from tests.fuzz.runner import ZmqChannel
from tests.fuzz.targets import free_and_close, memsvc_check_failed

POOL_SIZE = ["--page-size", "4", "--num-pages", "128", "--max-running-requests", "8"]
POOL_SIZE += ["--max-context-len", "512"]
LEGIT_TOKENS = np.arange(40, 52, dtype=np.int64)
FUZZ_LEN = 32  # the fuzzer's own request holds this many positions
OPS = ("info", "extend", "decode")


class ModelMessages:
    ops = OPS

    def __init__(self, row: int, num_rows: int, epoch: str) -> None:
        self.row, self.num_rows, self.epoch = row, num_rows, epoch
        self.op_id = 0

    def observe(self, header: dict[str, Any]) -> None:
        pass

    def next(self, rng: random.Random) -> list[bytes]:
        roll = rng.random()
        if roll < 0.08:
            return garbage(rng)
        header, arrays = self._valid(rng)
        if roll < 0.35:
            return wire.pack(header, arrays)
        if roll < 0.5:
            self._hostile(header, arrays, rng)
            return wire.pack(header, arrays)
        return mutate((header, arrays), rng, self.ops)

    def _valid(self, rng: random.Random) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        self.op_id += 1
        op = rng.choices(OPS, weights=[1, 4, 4])[0]
        header: dict[str, Any] = {"op": op, "op_id": self.op_id}
        if op == "info":
            return header, {}
        header["pool_epoch"] = self.epoch if rng.random() < 0.9 else rng.choice([None, "x"])
        if rng.random() < 0.4:
            header["sampling"] = [
                {"temperature": rng.choice([0.0, 0.7]), "top_k": rng.randrange(5), "seed": 1}
            ]
        if op == "extend":
            prefix = rng.randrange(FUZZ_LEN)
            num = rng.randint(1, FUZZ_LEN - prefix)
            arrays = {
                "rows": np.array([self.row]),
                "prefix_lens": np.array([prefix]),
                "num_tokens": np.array([num]),
                "token_ids": np.array([rng.randrange(256) for _ in range(num)]),
            }
        else:
            arrays = {
                "rows": np.array([self.row]),
                "seq_lens": np.array([rng.randint(1, FUZZ_LEN)]),
                "token_ids": np.array([rng.randrange(256)]),
            }
        return header, arrays

    def _hostile(self, header, arrays, rng: random.Random) -> None:
        kind = rng.randrange(5)
        if kind == 0 and "rows" in arrays:
            arrays["rows"] = np.array([rng.choice([self.num_rows, -1, 2**40, -(2**62)])])
        elif kind == 1 and "token_ids" in arrays:
            arrays["token_ids"] = np.full_like(arrays["token_ids"], rng.choice(EDGE_INTS[1:8]))
        elif kind == 2:
            spec = {
                rng.choice(["temperature", "top_p", "top_k", "seed"]): rng.choice(
                    [1e-46, 1e-300, float("nan"), float("inf"), -1.0, 2**63, 2**64 - 1, 0.0]
                )
            }
            header["sampling"] = [spec] * rng.choice([1, 1, 2, 0])
        elif kind == 3 and "seq_lens" in arrays:
            arrays["seq_lens"] = np.array([rng.choice([0, -1, FUZZ_LEN + 1000, 2**40])])
        elif kind == 4 and "num_tokens" in arrays:
            arrays["num_tokens"] = np.array([rng.choice([0, -1, 2**40, 10**6])])


class ModelTarget:
    name = "model_svc"

    def __init__(self, launcher: Launcher, checkpoint: Path) -> None:
        layout = pool_layout_args(checkpoint)
        self.memsvc = launcher.start("memsvc", *layout, *POOL_SIZE, name="memsvc-mfuzz")
        self.model = launcher.start(
            "model_svc", "--memsvc", self.memsvc.address, "--checkpoint", str(checkpoint),
            "--threads", "1", name="model_svc-fuzz",
        )  # fmt: skip
        self.legit = MemClient(self.memsvc.address, lease_s=60)
        self.legit_row = self.legit.alloc_row("legit")
        slots = self.legit.alloc_extend([("legit", LEGIT_TOKENS.size)]).slots
        self.pages = np.unique(slots // self.legit.layout.page_size)
        self.fuzzer = MemClient(self.memsvc.address, lease_s=60)
        fuzz_row = self.fuzzer.alloc_row("fuzz")
        self.fuzzer.alloc_extend([("fuzz", FUZZ_LEN)])
        self.worker = ModelClient(self.model.address)
        self.buffers = self.legit.attach()
        self.before = self._legit_state()
        num_rows = self.buffers.req_to_token.shape[0]
        self.messages = ModelMessages(fuzz_row, num_rows, self.legit.epoch)

    def _legit_state(self) -> tuple[Any, ...]:
        try:
            token = self.worker.extend([(self.legit_row, 0, LEGIT_TOKENS)], None, self.legit.epoch)
            next_ids = token.next_token_ids.tolist()
        except ForwardError as exc:
            next_ids = f"legit extend failed: {exc}"
        return next_ids, self.buffers.kv[self.pages].tobytes()

    def channel(self) -> ZmqChannel:
        return ZmqChannel(self.model.address)

    def alive(self) -> bool:
        return self.memsvc.proc.poll() is None and self.model.proc.poll() is None

    def end_batch(self, channel: ZmqChannel) -> None:
        pass

    def problems(self) -> list[str]:
        found = []
        kv_before = self.buffers.kv[self.pages].tobytes()
        if kv_before != self.before[1]:
            found.append("the legitimate request's KV bytes changed during the batch")
        if self._legit_state() != self.before:
            found.append("the legitimate request's extend gave another token or KV")
        return found + memsvc_check_failed(self.legit)

    def close(self) -> None:
        self.buffers.close()
        self.worker.close()
        free_and_close([(self.fuzzer, "fuzz"), (self.legit, "legit")])
