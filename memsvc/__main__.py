"""``python -m memsvc``: run the kvstack memory service."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import sys

from memsvc.cli import DEFAULT_NUM_PAGES, DEFAULT_PAGE_SIZE, add_service_args, setup_logging
from memsvc.core import KVPool, PoolLayout
from memsvc.core.backends import BACKENDS
from memsvc.core.errors import MemsvcError
from memsvc.core.hicache_config import HiCacheConfig, WritePolicy
from memsvc.core.storage import STORAGE_BACKENDS
from memsvc.curve import CurveKeys, add_curve_arguments, curve_from_args
from memsvc.handlers import MemService, ServiceConfig
from memsvc.lifeline import die_with_parent
from memsvc.limits import MessageLimit
from memsvc.metrics import Metrics
from memsvc.server import (
    ServiceShell,
    check_listen_address,
    default_listen_address,
    metrics_host,
)
from memsvc.sessions import REPLY_CACHE_SIZE
from memsvc.transfer import TransferAgent

log = logging.getLogger("memsvc")


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memsvc",
        description="kvstack memory service: owns the KV pool, the req_to_token table, the "
        "radix prefix cache and the host store, and serves them over ZMQ.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    pool = parser.add_argument_group(
        "pool layout (the model's; kvstack serve / up read it from the checkpoint)"
    )
    pool.add_argument(
        "--num-layers", type=int, required=True, help="transformer layers (num_hidden_layers)"
    )
    pool.add_argument(
        "--num-kv-heads",
        type=int,
        required=True,
        help="KV heads per layer (num_key_value_heads)",
    )
    pool.add_argument("--head-dim", type=int, required=True, help="dimension of one head")
    pool.add_argument(
        "--dtype",
        choices=["float16", "bfloat16", "float32", "float64"],
        default="float32",
        help="KV element type",
    )
    pool.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="tokens per page")
    pool.add_argument(
        "--num-pages",
        type=int,
        default=DEFAULT_NUM_PAGES,
        help="usable pages (capacity = num_pages x page_size tokens)",
    )
    pool.add_argument(
        "--max-running-requests",
        type=int,
        default=256,
        help="req_to_token rows (requests holding KV at once)",
    )
    pool.add_argument(
        "--max-context-len",
        type=int,
        default=4096,
        help="longest request (prompt + output) in tokens",
    )
    pool.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="no prefix reuse: finished requests' KV is freed, not cached",
    )

    mem = parser.add_argument_group("memory")
    mem.add_argument(
        "--backend",
        choices=BACKENDS,
        default="shm",
        help="shm: POSIX shared memory (no GPU); cuda: cupy + CUDA IPC",
    )
    mem.add_argument("--device", type=int, default=0, help="GPU index for --backend cuda")
    mem.add_argument(
        "--host-store-bytes",
        type=int,
        default=None,
        help="CPU RAM for offloaded KV (default: the size of the KV pool)",
    )
    mem.add_argument(
        "--offload-copy",
        choices=("auto", "sync", "async"),
        default="auto",
        help="async: an offload returns once its copy is issued (CUDA copy stream / shm copy "
        "thread) and the pages it reads are reused only after it has finished; sync: it "
        "returns when the copy is done; auto (default): async on cuda, sync on shm",
    )
    mem.add_argument(
        "--retract-decode-steps",
        type=int,
        default=env_int("SGLANG_RETRACT_DECODE_STEPS", 20),
        help="after each retract release, evict remaining x this many tokens "
        "(env SGLANG_RETRACT_DECODE_STEPS)",
    )

    add_hicache_arguments(parser)

    pd = parser.add_argument_group("PD disaggregation (KV transfer between two memsvc)")
    pd.add_argument(
        "--pd-role",
        choices=["none", "prefill", "decode"],
        default="none",
        help="prefill: send prompt KV to the decode node's memsvc (--transfer-peer); "
        "decode: receive it (--transfer-listen)",
    )
    pd.add_argument(
        "--transfer-backend",
        choices=["auto", "nixl", "zmq"],
        default="auto",
        help="nixl: NIXL/UCX writes straight into the peer's pool (UCX on the loopback "
        "device only, unless --allow-remote); zmq: raw bytes frames; "
        "auto: nixl if the nixl-cu12 wheel is installed, else zmq",
    )
    pd.add_argument(
        "--transfer-listen",
        default=None,
        help="decode role: where prefill-node memsvc connect (tcp://HOST:PORT or ipc://PATH)",
    )
    pd.add_argument(
        "--transfer-peer",
        default=None,
        help="prefill role: the decode-node memsvc's --transfer-listen address",
    )
    pd.add_argument(
        "--transfer-timeout",
        type=float,
        default=5.0,
        help="seconds without a word from the peer memsvc before its transfers fail",
    )

    net = parser.add_argument_group("service")
    net.add_argument(
        "--max-message-bytes",
        type=int,
        default=64 << 20,
        help="larger requests get a too_large error reply (read and dropped frame by frame)",
    )
    net.add_argument(
        "--max-sessions",
        type=int,
        default=ServiceConfig.max_sessions,
        help="sessions open at once; one more hello gets too_many_sessions",
    )
    net.add_argument(
        "--reply-cache-bytes",
        type=int,
        default=ServiceConfig.reply_cache_bytes,
        help="bytes of replies each session keeps to answer a retried op (and at most "
        f"{REPLY_CACHE_SIZE} replies); the oldest go first, the newest is always kept",
    )
    net.add_argument(
        "--max-lease",
        type=float,
        default=ServiceConfig.max_lease_s,
        help="longest session lease (seconds) a hello may ask for",
    )
    net.add_argument(
        "--reap-interval",
        type=float,
        default=0.25,
        help="seconds between checks for expired session leases",
    )
    net.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on --metrics-host:PORT (0: any free port)",
    )
    net.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics server binds (non-loopback needs --allow-remote)",
    )
    add_service_args(
        net,
        ready_fields="address, epoch, pid, metrics_port",
        also_remote=" (and --transfer-listen, --metrics-host); without it the nixl transfer "
        "backend's UCX uses the loopback network device only (UCX_NET_DEVICES=lo), so "
        "memsvc-P and memsvc-D must share a host",
    )
    add_curve_arguments(
        parser,
        connects_to="the decode node's transfer listener (--pd-role prefill); the listener "
        "(--pd-role decode) serves with --curve-secret-key / --curve-clients",
    )
    return parser


def add_hicache_arguments(parser: argparse.ArgumentParser) -> None:
    """SGLang's ``--enable-hierarchical-cache`` / ``--hicache-*`` flags (memsvc's subset)."""
    hi = parser.add_argument_group(
        "hierarchical cache (radix tree over device pool, host memory and storage)"
    )
    hi.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="keep evicted radix-tree KV in a host-memory tier (and a storage tier) and load "
        "it back on a prefix match instead of recomputing it",
    )
    hi.add_argument(
        "--hicache-ratio",
        type=float,
        default=HiCacheConfig.ratio,
        help="host tier size as a multiple of the device KV pool",
    )
    hi.add_argument(
        "--hicache-size",
        type=float,
        default=0,
        help="host tier size in GB (1e9 bytes); > 0 overrides --hicache-ratio",
    )
    hi.add_argument(
        "--hicache-write-policy",
        choices=[p.value for p in WritePolicy],
        default=HiCacheConfig.write_policy,
        help="write_through: copy a node to host when it is inserted; "
        "write_through_selective: once it has been hit; write_back: when it is evicted",
    )
    hi.add_argument(
        "--hicache-storage-backend",
        choices=[b.value for b in STORAGE_BACKENDS],
        default=None,
        help="third tier, fed by host-tier eviction: file (a local directory) or nixl (NIXL's "
        "POSIX storage plugin on the same directory); unset: host eviction drops KV",
    )
    hi.add_argument(
        "--hicache-storage-dir",
        default=HiCacheConfig.storage_dir,
        metavar="PATH",
        help="base directory of the storage tier (default: $XDG_CACHE_HOME/kvstack/hicache, "
        "else ~/.cache/kvstack/hicache); it must be yours and not writable by others. Each "
        "memsvc keeps its pages (0600, checksummed) in a 0700 subdirectory of its own, "
        "<role>-<pid>-<random>, removed when it stops",
    )
    hi.add_argument(
        "--hicache-storage-size",
        type=float,
        default=0,
        help="storage tier cap in GB (1e9 bytes); 0: 4 x the host tier",
    )


def hicache_config_from_args(args: argparse.Namespace) -> HiCacheConfig | None:
    if not args.enable_hierarchical_cache:
        return None
    return HiCacheConfig(
        ratio=args.hicache_ratio,
        size_bytes=int(args.hicache_size * 1e9),
        write_policy=args.hicache_write_policy,
        storage_backend=args.hicache_storage_backend,
        storage_dir=args.hicache_storage_dir,
        storage_size_bytes=int(args.hicache_storage_size * 1e9),
        storage_role="normal" if args.pd_role == "none" else args.pd_role,
    )


def make_transfer_agent(
    args: argparse.Namespace, pool: KVPool, epoch: str, curve: CurveKeys
) -> TransferAgent:
    backend = args.transfer_backend
    if backend == "auto":
        backend = "nixl" if importlib.util.find_spec("nixl_cu12") else "zmq"
    if args.transfer_listen:
        check_listen_address(args.transfer_listen, allow_remote=args.allow_remote)
    agent = TransferAgent(
        pool,
        role=args.pd_role,
        backend=backend,
        epoch=epoch,
        listen=args.transfer_listen,
        peer=args.transfer_peer,
        peer_timeout_s=args.transfer_timeout,
        curve=curve,
        allow_remote=args.allow_remote,
    )
    log.info("PD %s role, %s transfer backend", args.pd_role, backend)
    return agent


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # when started by a launcher: SIGTERM once it is gone
    args = build_parser().parse_args(argv)
    setup_logging(args)
    try:
        listen = args.listen or default_listen_address()
        check_listen_address(listen, allow_remote=args.allow_remote)
        curve = curve_from_args(args)
        layout = PoolLayout(
            num_layers=args.num_layers,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            page_size=args.page_size,
            num_pages=args.num_pages,
            dtype=args.dtype,
            max_running_requests=args.max_running_requests,
            max_context_len=args.max_context_len,
        )
        host_bytes = layout.kv_bytes if args.host_store_bytes is None else args.host_store_bytes
        options = {"device": args.device} if args.backend == "cuda" else {}
        pool = KVPool(
            layout,
            backend=args.backend,
            host_store_bytes=host_bytes,
            disable_radix_cache=args.disable_radix_cache,
            backend_options=options,
            async_offload=args.offload_copy == "async"
            or (args.offload_copy == "auto" and args.backend == "cuda"),
            hicache=hicache_config_from_args(args),
        )
    except MemsvcError as exc:
        print(f"memsvc: error: {exc}", file=sys.stderr)
        return 2
    metrics_server = None
    try:
        registry = None
        metrics_port = args.metrics_port
        if metrics_port is not None:
            from prometheus_client import CollectorRegistry, start_http_server

            registry = CollectorRegistry()
            metrics_server, _ = start_http_server(metrics_port, metrics_host(args), registry)
            metrics_port = metrics_server.server_port
            log.info("metrics on http://127.0.0.1:%d/metrics", metrics_port)
        metrics = Metrics(registry)
        service = MemService(
            pool,
            ServiceConfig(
                retract_decode_steps=args.retract_decode_steps,
                max_message_bytes=args.max_message_bytes,
                max_sessions=args.max_sessions,
                max_lease_s=args.max_lease,
                reply_cache_bytes=args.reply_cache_bytes,
            ),
            metrics,
        )
        metrics.watch(service)
        if args.pd_role != "none":
            service.transfer = make_transfer_agent(args, pool, service.epoch, curve)
        server = ServiceShell(
            "memsvc",
            service.handle,
            listen,
            tick=service.expire_sessions,
            tick_interval_s=args.reap_interval,
            limit=MessageLimit(args.max_message_bytes),
            reject=service.reject,
            curve=curve.server,
            ready_file=args.ready_file,
            ready_info={"epoch": service.epoch, "metrics_port": metrics_port},
            extension=service.transfer,
        )
        asyncio.run(server.run())
    except MemsvcError as exc:
        print(f"memsvc: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
