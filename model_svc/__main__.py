"""``python -m model_svc``: the kvstack model worker."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import ctypes
import ctypes.util
import logging
import os
import sys
import time
from pathlib import Path

from memsvc.cli import add_service_args, setup_logging
from memsvc.client import MemClient
from memsvc.core.errors import MemsvcError
from memsvc.curve import add_curve_arguments, curve_from_args
from memsvc.lifeline import die_with_parent
from memsvc.server import ServiceShell, check_listen_address, default_listen_address
from model_svc.errors import ModelSvcError

log = logging.getLogger("model_svc")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
DTYPES = ("float32", "float16", "bfloat16", "float64")
# How long --memsvc-ready-file is waited for: as long as a launcher gives a service to start.
MEMSVC_READY_WAIT_S = 120.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="model_svc",
        description="kvstack model worker: runs extend (prefill) and decode forward passes of a "
        "Llama-architecture model over the KV pool that memsvc shares, and returns sampled "
        "tokens.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--memsvc", required=True, help="memsvc address (ipc://... or tcp://...)")
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="HF-layout Llama checkpoint folder (config.json + *.safetensors); "
        "default: the bundled tiny model, created on first use",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="compute dtype; must match memsvc's --dtype",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the model runs (cuda needs memsvc --backend cuda)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument(
        "--memsvc-ready-file",
        default=None,
        metavar="FILE",
        help="connect to memsvc only once it has written this ready file (its --ready-file), "
        f"waiting up to {MEMSVC_READY_WAIT_S:g}s: a launcher starts model_svc, which spends "
        "its start-up importing torch and loading the model, while memsvc starts",
    )
    add_service_args(parser, ready_fields="address, epoch, pid, pool_epoch")
    add_curve_arguments(parser, connects_to="memsvc (--memsvc)")
    return parser


def keep_freed_memory() -> None:
    """Stop glibc from returning large freed blocks to the OS after every forward pass.

    Each decode step allocates MB-sized temporaries; with the default thresholds
    glibc unmaps them on free and the next step page-faults them back in, which
    doubled decode step time here. No effect outside glibc.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        pass


def await_ready_file(path: str, timeout_s: float = MEMSVC_READY_WAIT_S) -> None:
    """Return once ``path`` exists (a service's ready file is written atomically)."""
    deadline = time.monotonic() + timeout_s
    ready = Path(path)
    while not ready.exists():
        if time.monotonic() > deadline:
            raise ModelSvcError(f"memsvc wrote no ready file {path} within {timeout_s:g}s")
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # when started by a launcher: SIGTERM once it is gone
    args = build_parser().parse_args(argv)
    setup_logging(args)
    keep_freed_memory()
    import torch

    from model_svc.handlers import AttachedPool, ModelService
    from model_svc.model import LlamaModel
    from model_svc.tiny import default_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"model_svc: error: --device cuda, but torch {torch.__version__} sees no CUDA GPU "
            "(a CPU build, no driver, or CUDA_VISIBLE_DEVICES hides it); use --device cpu "
            "with memsvc --backend shm",
            file=sys.stderr,
        )
        return 2
    mem = None
    try:
        listen = args.listen or default_listen_address("model_svc")
        check_listen_address(listen, allow_remote=args.allow_remote)
        curve = curve_from_args(args)
        checkpoint = args.checkpoint or default_checkpoint()
        model = LlamaModel.from_checkpoint(
            checkpoint, dtype=getattr(torch, args.dtype), device=args.device
        )
        if args.memsvc_ready_file:
            await_ready_file(args.memsvc_ready_file)
        mem = MemClient(args.memsvc, role="worker", name="model_svc", curve=curve.client)

        def attach_pool() -> AttachedPool:
            """The current pool: say hello again when memsvc has restarted."""
            try:
                mem.heartbeat()
            except MemsvcError:
                mem.reconnect()
            return AttachedPool(mem.epoch, mem.attach())

        service = ModelService(model, attach_pool)
    except (ModelSvcError, MemsvcError) as exc:
        print(f"model_svc: error: {exc}", file=sys.stderr)
        if mem is not None:
            mem.close()
        return 2
    try:
        shell = ServiceShell(
            "model_svc",
            service.handle,
            listen,
            reject=service.reject,
            curve=curve.server,
            ready_file=args.ready_file,
            ready_info={"epoch": service.epoch, "pool_epoch": service.pool.epoch},
        )
        asyncio.run(shell.run())
    finally:
        mem.close()
    return 0


def exit_now(code: int) -> None:
    """Exit with ``code`` once ``main`` has cleaned up, skipping the interpreter's teardown.

    Tearing down torch's modules and objects at interpreter exit costs ~1.5 CPU-s
    (2-3 s on a busy machine) after every clean stop, for nothing: the socket
    is closed, the session ended and the ready file gone by then. The exit
    handlers (logging's flush, finalizers) still run, and the standard streams
    are flushed; only the teardown is skipped.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
