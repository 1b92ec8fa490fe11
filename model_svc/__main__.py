"""``python -m model_svc``: the kvstack model worker."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import logging
import sys

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


if __name__ == "__main__":
    sys.exit(main())
