"""PD retract + resume against normal retract + re-prefill, and P->D transfer throughput.

For requests of 1k, 4k and 16k tokens on the bundled tiny model (float32,
page 16), in one run:

- ``pd_s``: what a decode node does to retract a request and bring it back:
  offload its KV to the host store, release it, open a new row, allocate and
  load the KV back (memsvc's core ops, in process);
- ``normal_s``: what normal mode does: release without a copy, then
  re-prefill the whole request (one extend forward pass of the model, the
  prefix tree evicted as under the pressure that caused the retract);
- ``ratio_<n>`` = pd_s / normal_s (target for 4k: <= 0.1);
- ``transfer``: memsvc-P -> memsvc-D throughput of each backend between two real
  memsvc processes (a 16k-token prompt, pd_send until Success), against a raw
  memcpy of the same bytes in this process (``ratio_memcpy``).

``--backend cuda`` runs the same on the GPU backend: the model on the GPU,
the pool in GPU memory (offload / load through the pinned host store), the
two memsvc with ``--backend cuda``; the transfer baseline is then also a
device-to-device cupy copy of the same bytes (``d2d_gb_per_s``).

Prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_step import PAGE_SIZE, Bench, best_seconds, bound_pool

from kvstack.stack.launch import Launcher
from memsvc.client import MemClient
from memsvc.core import PoolLayout
from memsvc.transfer import KVPoll
from model_svc.model import LlamaModel
from model_svc.tiny import write_tiny_checkpoint

LENGTHS = (1024, 4096, 16384)


def layout_for(model: LlamaModel, max_tokens: int) -> PoolLayout:
    cfg = model.config
    return PoolLayout(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        page_size=PAGE_SIZE,
        num_pages=2 * -(-max_tokens // PAGE_SIZE) + 16,
        dtype="float32",
        max_running_requests=8,
        max_context_len=max_tokens + PAGE_SIZE,
    )


def pd_retract_resume(bench: Bench, rid: str) -> None:
    pool = bench.pool
    pool.offload(rid)
    pool.release(rid, is_insert=False)
    pool.open_request(rid)
    if pool.load(rid) is None:
        raise RuntimeError("no room to load back")


def normal_retract_reprefill(bench: Bench, rid: str, ids: np.ndarray) -> None:
    pool = bench.pool
    pool.release(rid, is_insert=False)
    pool.open_request(rid)
    pool.alloc_extend([(rid, ids.size)])
    bench.extend(rid, ids).cpu()  # waits for the forward pass on a GPU too


def measure_retract(bench: Bench, num_tokens: int, repeats: int) -> dict[str, float]:
    rid = f"r{num_tokens}"
    ids = bench.prompt(num_tokens)
    bench.open([rid], num_tokens)
    bench.extend(rid, ids)
    try:
        pd_s = best_seconds(lambda: pd_retract_resume(bench, rid), repeats)
        normal_s = best_seconds(lambda: normal_retract_reprefill(bench, rid, ids), repeats)
    finally:
        bench.close([rid])
    return {"pd_s": round(pd_s, 5), "normal_s": round(normal_s, 4), "ratio": pd_s / normal_s}


def measure_transfer(
    model: LlamaModel, backend: str, num_tokens: int, repeats: int, pool_backend: str
) -> dict:
    cfg = model.config
    geometry = [
        "--backend", pool_backend,
        "--num-layers", str(cfg.num_hidden_layers), "--num-kv-heads", str(cfg.num_key_value_heads),
        "--head-dim", str(cfg.head_dim), "--dtype", "float32", "--page-size", str(PAGE_SIZE),
        "--num-pages", str(2 * num_tokens // PAGE_SIZE), "--max-context-len", str(2 * num_tokens),
        "--transfer-backend", backend,
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp, Launcher(tmp) as up:
        listen = f"ipc://{tmp}/transfer.sock"
        d = up.start(
            "memsvc", *geometry, "--pd-role", "decode", "--transfer-listen", listen, name="d"
        )
        p = up.start(
            "memsvc", *geometry, "--pd-role", "prefill", "--transfer-peer", listen, name="p"
        )
        best = float("inf")
        with MemClient(p.address) as pc, MemClient(d.address) as dc:
            for i in range(repeats + 1):
                rid, room = f"t{i}", 100 + i
                for client in (pc, dc):
                    client.alloc_row(rid)
                    client.alloc_extend([(rid, num_tokens)])
                dc.pd_expect(rid, room)
                start = time.perf_counter()
                pc.pd_send(rid, room, num_tokens, first_token=1)
                while (state := dc.pd_status([room])[0]["state"]) not in (0, 4):
                    pass
                elapsed = time.perf_counter() - start
                if state != KVPoll.SUCCESS:
                    raise RuntimeError(f"{backend} transfer failed: {dc.pd_status([room])}")
                if i:  # the first one connects and registers: warm-up
                    best = min(best, elapsed)
                for client in (pc, dc):
                    client.pd_forget([room])
                    client.free_row(rid)
    nbytes = -(-num_tokens // PAGE_SIZE) * PAGE_SIZE * layout_bytes_per_token(model)
    return {"seconds": round(best, 5), "gb_per_s": round(nbytes / best / 1e9, 3), "bytes": nbytes}


def layout_bytes_per_token(model: LlamaModel) -> int:
    cfg = model.config
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4


def memcpy_gb_per_s(nbytes: int, repeats: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    seconds = best_seconds(lambda: np.copyto(dst, src), repeats)
    return nbytes / seconds / 1e9


def d2d_gb_per_s(nbytes: int, repeats: int) -> float:
    import cupy as cp

    src = cp.ones(nbytes, dtype=cp.uint8)
    dst = cp.zeros_like(src)

    def copy() -> None:
        dst[...] = src
        cp.cuda.runtime.deviceSynchronize()

    return nbytes / best_seconds(copy, repeats) / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure")
    parser.add_argument(
        "--backends", default="zmq,nixl", help="transfer backends to measure (comma list)"
    )
    parser.add_argument("--backend", choices=("shm", "cuda"), default="shm", help="KV pool backend")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = "cuda" if args.backend == "cuda" else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        model = LlamaModel.from_checkpoint(write_tiny_checkpoint(tmp), device=device)
    result: dict = {
        "model": "tiny-llama float32",
        "page_size": PAGE_SIZE,
        "backend": args.backend,
    }
    layout = layout_for(model, max(LENGTHS))
    host_bytes = layout.kv_bytes // 2
    with bound_pool(model, layout, host_store_bytes=host_bytes, backend=args.backend) as pool:
        bench = Bench(pool, model, np.random.default_rng(0))
        for n in LENGTHS:
            figures = measure_retract(bench, n, args.repeats)
            result[str(n)] = figures
            result[f"ratio_{n // 1024}k"] = round(figures["ratio"], 4)
    transfer = {}
    for backend in args.backends.split(","):
        transfer[backend] = measure_transfer(
            model, backend, max(LENGTHS), args.repeats, args.backend
        )
    memcpy = memcpy_gb_per_s(transfer[backend]["bytes"], args.repeats)
    if args.backend == "cuda":
        result["d2d_gb_per_s"] = round(d2d_gb_per_s(transfer[backend]["bytes"], args.repeats), 3)
    for figures in transfer.values():
        figures["ratio_memcpy"] = round(figures["gb_per_s"] / memcpy, 3)
    result["transfer"] = transfer
    result["memcpy_gb_per_s"] = round(memcpy, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
