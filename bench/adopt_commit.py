"""What the adoption journal (scheduler_svc.adopt) adds to a decode step, measured.

In process (memsvc's real handler, the real client packing, no socket): N
running requests with P-token prompts; each step appends one token per
request and commits it, as the decode round does beside its forward pass. Per
step: the commit message's bytes, the scheduler's time to build and pack it
(the journal's diff over the requests), memsvc's time to handle it, and, for
scale, memsvc's time to handle that step's ``decode_step`` (the one round trip
a step already makes). The last line is JSON.

    .venv/bin/python -m bench.adopt_commit [--requests 32] [--prompt 1024] [--steps 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from types import SimpleNamespace

from memsvc import protocol as wire
from memsvc.core import KVPool
from memsvc.core.layout import PoolLayout
from memsvc.handlers import MemService, ServiceConfig
from memsvc.inproc import InProcessMem
from scheduler_svc.adopt import Journal, Owner
from scheduler_svc.core import Req, ReqState, SamplingParams


class TimedMem(InProcessMem):
    """Times memsvc's handling of each op and keeps the request's size."""

    async def _invoke(self, call):
        _, frames = self._state.frames(call)
        started = time.perf_counter()
        reply = self._service.handle(frames)
        self.last = (call.op, time.perf_counter() - started, sum(map(len, frames)))
        return self._state.finish(call, wire.unpack(reply))


async def run(num_reqs: int, prompt_len: int, steps: int) -> dict:
    page = 16
    tokens = num_reqs * (prompt_len + steps + page)
    layout = PoolLayout(  # a small model's KV: the control plane is what is measured
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        page_size=page,
        num_pages=tokens // page + num_reqs + 8,
        max_running_requests=num_reqs,
        max_context_len=prompt_len + steps + page,
    )
    pool = KVPool(layout)
    service = MemService(pool, ServiceConfig())
    mem = await TimedMem.connect(service)
    reqs = {}
    for i in range(num_reqs):
        rid = f"bench-{i:04d}"
        req = Req(rid, list(range(prompt_len)), SamplingParams(max_new_tokens=steps + 1))
        row = await mem.alloc_row(rid)
        await mem.alloc_extend([(rid, prompt_len)])
        req.state = ReqState.RUNNING
        req.row, req.kv_len = row, prompt_len
        req.output_ids.append(1)
        reqs[rid] = req
    engine = SimpleNamespace(reqs=reqs, mem=mem, ratio=SimpleNamespace(current=0.5))
    journal = Journal(owner_of=lambda rid: Owner("client", "f" * 64, True), measure=True)
    await journal.commit(engine)  # the admission: full records
    admission_bytes = journal.bytes_sent
    rows = [r.row for r in reqs.values()]
    commit_s, build_s, handle_s, step_s, sizes = [], [], [], [], []
    for step in range(steps):
        await mem.decode_step(rows)
        step_s.append(mem.last[1])
        for req in reqs.values():
            req.output_ids.append(step % 250)
            req.kv_len += 1
        started = time.perf_counter()
        before = journal.bytes_sent
        await journal.commit(engine)
        commit_s.append(time.perf_counter() - started)
        handle_s.append(mem.last[1])
        sizes.append(journal.bytes_sent - before)
        build_s.append(commit_s[-1] - mem.last[1])
    pool.close()
    med = statistics.median
    return {
        "requests": num_reqs,
        "prompt_len": prompt_len,
        "steps": steps,
        "admission_commit_bytes": admission_bytes,
        "commit_bytes_per_step": med(sizes),
        "commit_bytes_per_request_step": med(sizes) / num_reqs,
        "commit_us_per_step": med(commit_s) * 1e6,
        "commit_build_pack_us_per_step": med(build_s) * 1e6,
        "commit_memsvc_handle_us_per_step": med(handle_s) * 1e6,
        "decode_step_memsvc_handle_us": med(step_s) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.requests, args.prompt, args.steps))))


if __name__ == "__main__":
    main()
