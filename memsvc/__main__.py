"""``python -m memsvc``: run the kvstack memory service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from memsvc.cli import add_service_args, setup_logging
from memsvc.config import SERVICE, MemsvcConfig
from memsvc.core import KVPool
from memsvc.core.errors import MemsvcError
from memsvc.core.hicache_config import HiCacheConfig
from memsvc.curve import CurveKeys, add_curve_arguments, curve_from_args
from memsvc.gcpolicy import apply_gc_policy
from memsvc.handlers import MemService
from memsvc.kv_events import start_kv_events
from memsvc.lifeline import die_with_parent
from memsvc.limits import MessageLimit
from memsvc.metrics import Metrics
from memsvc.server import (
    ServiceShell,
    check_listen_address,
    default_listen_address,
    metrics_host,
)
from memsvc.settings import add_arguments, add_config_argument, from_args, parse_args
from memsvc.transfer import TransferAgent

log = logging.getLogger("memsvc")


def build_parser() -> argparse.ArgumentParser:
    """memsvc's flags: :class:`MemsvcConfig`'s, then where it listens and its keys."""
    parser = argparse.ArgumentParser(
        prog="memsvc",
        description="kvstack memory service: owns the KV pool, the req_to_token table, the "
        "radix prefix cache and the host store, and serves them over ZMQ.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_argument(parser)
    groups = add_arguments(parser, MemsvcConfig)
    add_service_args(
        groups[SERVICE],
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


def hicache_config_from_args(args: argparse.Namespace) -> HiCacheConfig | None:
    """The hierarchical cache ``args`` ask for (None: off)."""
    return from_args(MemsvcConfig, args).hicache


def make_transfer_agent(
    config: MemsvcConfig, allow_remote: bool, pool: KVPool, epoch: str, curve: CurveKeys
) -> TransferAgent:
    backend = config.transfer_backend.resolve()
    if config.transfer_listen:
        check_listen_address(config.transfer_listen, allow_remote=allow_remote)
    agent = TransferAgent(
        pool,
        role=config.pd_role,
        backend=backend,
        epoch=epoch,
        listen=config.transfer_listen,
        peer=config.transfer_peer,
        peer_timeout_s=config.transfer_timeout,
        curve=curve,
        allow_remote=allow_remote,
    )
    log.info("PD %s role, %s transfer backend", config.pd_role, backend)
    return agent


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # when started by a launcher: SIGTERM once it is gone
    args = parse_args(build_parser(), argv)
    setup_logging(args)
    try:
        listen = args.listen or default_listen_address()
        check_listen_address(listen, allow_remote=args.allow_remote)
        curve = curve_from_args(args)
        config = from_args(MemsvcConfig, args)
        layout = config.layout
        pool_bytes = layout.kv_bytes + layout.swa_kv_bytes  # both pools of a hybrid model
        host_bytes = pool_bytes if config.host_store_bytes is None else config.host_store_bytes
        options = {"device": config.device} if config.backend == "cuda" else {}
        pool = KVPool(
            layout,
            backend=config.backend,
            host_store_bytes=host_bytes,
            disable_radix_cache=config.disable_radix_cache,
            backend_options=options,
            async_offload=config.async_offload,
            hicache=config.hicache,
            storage_seed=config.identity.storage_seed,
            zero_freed_kv=config.zero_freed_kv,
            max_cached_tokens_per_namespace=config.max_cached_tokens_per_salt,
        )
    except MemsvcError as exc:
        print(f"memsvc: error: {exc}", file=sys.stderr)
        return 2
    metrics_server = kv_events = None
    try:
        registry = None
        metrics_port = config.metrics.port
        if metrics_port is not None:
            from prometheus_client import CollectorRegistry, start_http_server

            registry = CollectorRegistry()
            metrics_server, _ = start_http_server(metrics_port, metrics_host(args), registry)
            metrics_port = metrics_server.server_port
            log.info("metrics on http://127.0.0.1:%d/metrics", metrics_port)
        metrics = Metrics(registry)
        service = MemService(pool, config.service, metrics)
        metrics.watch(service)
        if config.pd_role != "none":
            service.transfer = make_transfer_agent(
                config, args.allow_remote, pool, service.epoch, curve
            )
        kv_events = start_kv_events(
            config.kv_events_config, pool.tree, allow_remote=args.allow_remote
        )
        handle, tick = service.handle, service.expire_sessions
        if kv_events is not None:  # one batch of events per request handled, and per tick
            handle, tick = kv_events.after(handle), kv_events.after(tick)
        server = ServiceShell(
            "memsvc",
            handle,
            listen,
            tick=tick,
            tick_interval_s=config.reap_interval,
            limit=MessageLimit(config.service.max_message_bytes),
            reject=service.reject,
            curve=curve.server,
            ready_file=args.ready_file,
            ready_info={"epoch": service.epoch, "metrics_port": metrics_port},
            extension=service.transfer,
        )
        apply_gc_policy()  # started: what lives now lives as long as the process
        asyncio.run(server.run())
    except MemsvcError as exc:
        print(f"memsvc: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        if kv_events is not None:
            kv_events.close()
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
