"""Live services to fuzz, each with a legitimate session whose state must not change.

- memsvc: the legitimate session holds a request whose 12 tokens are cached
  and locked; its ``req_to_token`` row and its KV pages' bytes (a pattern it
  wrote) are compared after every batch, with memsvc's ``check``.
- scheduler_svc (normal stack): a legitimate client's greedy generate is run
  again after every batch and must give the same tokens; memsvc ends idle.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np

from kvstack.stack.launch import Launcher
from kvstack.stack.process import Service
from memsvc import protocol as wire
from memsvc.client import MemClient
from memsvc.core.errors import MemsvcError
from scheduler_svc.client import GenerateClient, GenerateError
from tests.fuzz.memsvc_gen import LEGIT_RID, LEGIT_TOKENS, MemsvcMessages
from tests.fuzz.runner import ZmqChannel
from tests.fuzz.scheduler_gen import LEGIT_PROMPT, SchedulerMessages
from tests.procs import SMALL_POOL

STACK_POOL = ["--page-size", "4", "--dtype", "float32", "--max-context-len", "512"]
STACK_POOL += ["--num-pages", "64", "--max-running-requests", "32"]


class MemsvcTarget:
    name = "memsvc"

    def __init__(self, launcher: Launcher) -> None:
        self.service = launcher.start("memsvc", *SMALL_POOL, name="memsvc-fuzz")
        self.address = self.service.address
        self.legit = MemClient(self.address, lease_s=60)
        row = self.legit.alloc_row(LEGIT_RID)
        slots = self.legit.alloc_extend([(LEGIT_RID, LEGIT_TOKENS.size)]).slots
        self.buffers = self.legit.attach()
        page_size = self.legit.layout.page_size
        self.pages = np.unique(slots // page_size)
        pattern = np.arange(self.buffers.kv[self.pages].size) % 97 + 1
        self.buffers.kv[self.pages] = pattern.reshape(self.buffers.kv[self.pages].shape)
        self.legit.cache_unfinished(LEGIT_RID, LEGIT_TOKENS)
        self.row = row
        self.messages = MemsvcMessages(row)
        self.before = self._state()

    def _state(self) -> tuple[Any, ...]:
        slots = self.buffers.req_to_token[self.row, : LEGIT_TOKENS.size].copy()
        pages = np.unique(slots // self.legit.layout.page_size)
        return tuple(slots.tolist()), self.buffers.kv[pages].tobytes()

    def alive(self) -> bool:
        return self.service.proc.poll() is None

    def channel(self) -> ZmqChannel:
        return ZmqChannel(self.address)

    def end_batch(self, channel: ZmqChannel) -> None:
        """Say goodbye for the fuzzing session: all it opened is reclaimed."""
        if self.messages.session is not None:
            bye = {"op": "goodbye", "op_id": 1 << 62, "session": self.messages.session}
            channel.send(wire.pack(bye), 10.0)
        self.messages.forget_session()

    def problems(self) -> list[str]:
        found = memsvc_check_failed(self.legit)
        if self._state() != self.before:
            found.append("the legitimate request's slots or KV bytes changed")
        return found

    def close(self) -> None:
        self.buffers.close()
        with contextlib.suppress(MemsvcError):
            self.legit.free_row(LEGIT_RID)
            self.legit.check(idle=True)
        self.legit.close()


def memsvc_check_failed(client: MemClient) -> list[str]:
    """memsvc's integrity check through ``client``, as a problem list (empty: it passed)."""
    try:
        client.check()
    except MemsvcError as exc:
        return [f"memsvc check failed: {exc}"]
    return []


def free_and_close(rows: list[tuple[MemClient, str]]) -> None:
    """Free each client's row (if memsvc still has it) and close the client."""
    for client, rid in rows:
        with contextlib.suppress(MemsvcError):
            client.free_row(rid)
        client.close()


def _last_generate_reply(header: dict[str, Any]) -> bool:
    return not header.get("ok") or header.get("type") != "chunk"


class SchedulerTarget:
    name = "scheduler"

    def __init__(self, launcher: Launcher, checkpoint: Path) -> None:
        mem, model, sched = launcher.start_normal_stack(checkpoint, STACK_POOL, suffix="-fuzz")
        self.services: list[Service] = [mem, model, sched]
        self.memsvc_addresses = [mem.address]
        self.address = sched.address
        self._start_legit()

    def _start_legit(self) -> None:
        self.legit = GenerateClient(self.address, timeout_s=60, resubmits=0)
        self.num_checks = 0
        self.before = self._legit_output()
        self.messages = SchedulerMessages()

    def _legit_output(self) -> list[int] | str:
        # A fresh rid each time: a finished rid resubmitted gets its first result back.
        self.num_checks += 1
        sampling = {"max_new_tokens": 12, "ignore_eos": True}
        try:
            return self.legit.generate(
                LEGIT_PROMPT, sampling=sampling, rid=f"legit{self.num_checks}"
            ).output_ids
        except GenerateError as exc:
            return f"legit generate failed: {exc}"

    def alive(self) -> bool:
        return all(service.proc.poll() is None for service in self.services)

    def channel(self) -> ZmqChannel:
        return ZmqChannel(self.address, is_last=_last_generate_reply)

    def end_batch(self, channel: ZmqChannel) -> None:
        pass

    def problems(self) -> list[str]:
        found = []
        after = self._legit_output()
        if after != self.before:
            found.append(f"legit generate gave {after}, before {self.before}")
        for address in self.memsvc_addresses:
            try:
                with MemClient(address) as mem:
                    mem.check(idle=True)
            except MemsvcError as exc:
                found.append(f"memsvc check failed at {address}: {exc}")
        return found

    def close(self) -> None:
        self.legit.close()


class RouterTarget(SchedulerTarget):
    """The PD router in front of a prefill and a decode node: the same generate API."""

    name = "router"

    def __init__(self, launcher: Launcher, checkpoint: Path) -> None:
        up = launcher.start_pd_stack(checkpoint, STACK_POOL, transfer_backend="zmq", suffix="-fz")
        self.services = list(up.values())
        self.memsvc_addresses = [up["memsvc-p"].address, up["memsvc-d"].address]
        self.address = up["router"].address
        self._start_legit()
