"""``python -m scheduler_svc``: the kvstack scheduler."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

from memsvc.cli import add_service_args, setup_logging
from memsvc.client import AsyncMemClient, PeerDeadError
from memsvc.core.errors import MemsvcError
from memsvc.curve import CurveKeys, add_curve_arguments, curve_from_args
from memsvc.gcpolicy import apply_gc_policy
from memsvc.lifeline import die_with_parent
from memsvc.server import check_listen_address, default_listen_address, metrics_host
from memsvc.settings import add_arguments, add_config_argument, from_args, parse_args
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core import ConfigError

log = logging.getLogger("scheduler_svc")


def build_parser() -> argparse.ArgumentParser:
    """scheduler_svc's flags: :class:`SchedulerServiceConfig`'s, then where it listens."""
    parser = argparse.ArgumentParser(
        prog="scheduler_svc",
        description="kvstack scheduler: admits requests (PrefillAdder with the new_token_ratio "
        "safeguard), runs prefill and decode steps on model_svc over memsvc's KV pool, and "
        "retracts running requests when the next decode step would not fit.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_argument(parser)
    add_arguments(parser, SchedulerServiceConfig)
    add_service_args(parser, ready_fields="address, pid, metrics_port")
    add_curve_arguments(parser, connects_to="memsvc (--memsvc) and model_svc (--worker)")
    return parser


async def serve(
    config: SchedulerServiceConfig, args: argparse.Namespace, listen: str, curve: CurveKeys
) -> int:
    from model_svc.config import ModelConfig
    from model_svc.tokenizer import ByteTokenizer, load_tokenizer
    from scheduler_svc.adopt import Journal
    from scheduler_svc.engine import Engine
    from scheduler_svc.pd.decode import DecodeEngine
    from scheduler_svc.pd.migrate import MigrationPeer
    from scheduler_svc.pd.prefill import PrefillEngine
    from scheduler_svc.recovery import Recovery
    from scheduler_svc.resilient import ResilientModelClient
    from scheduler_svc.service import SchedulerService

    def connect_mem() -> Any:
        return AsyncMemClient.connect(
            config.memsvc,
            role="scheduler",
            name="scheduler_svc",
            lease_s=config.memsvc_lease,
            timeout_s=config.memsvc_timeout,
            curve=curve.client,
        )

    mem = await connect_mem()
    engine = None
    metrics_server = None
    metrics_port = None
    model = ResilientModelClient(
        config.worker,
        timeout_s=config.worker_timeout,
        recovery_timeout_s=config.recovery_timeout,
        curve=curve.client,
    )
    try:
        layout = mem.layout
        if config.page_size is not None and config.page_size != layout.page_size:
            raise ConfigError(
                f"--page-size {config.page_size} but memsvc's pool has page size {layout.page_size}"
            )
        scheduler_config = config.scheduler_config(layout.page_size, layout.max_running_requests)
        model_config = ModelConfig.from_dict((await model.info())["model"])
        tokenizer = (
            load_tokenizer(config.checkpoint, model_config)
            if config.checkpoint
            else ByteTokenizer()
        )
        engine_class = {"normal": Engine, "prefill": PrefillEngine, "decode": DecodeEngine}
        engine = engine_class[config.mode](
            scheduler_config,
            mem,
            model,
            lambda req, finished: None,
            eos_token_ids=model_config.eos_token_ids,
            capacity=mem.hello_info["capacity"],
        )
        if config.mode != "prefill":  # records a successor adopts (scheduler_svc.adopt)
            engine.journal = Journal(owner_of=lambda rid: None)
        if config.migrate_to:  # decode: retracted requests may move there
            engine.migration = MigrationPeer(config.migrate_to, curve=curve.client)
        if config.mode == "decode":
            engine.migrate_in_timeout_s = config.migrate_in_timeout
            engine.migrate_always = config.migrate_policy == "always"
        recovery = Recovery(
            engine,
            connect_mem,
            config.memsvc,
            recovery_timeout_s=config.recovery_timeout,
            session_file=config.memsvc_session_file,
            curve=curve.client,
        )
        await recovery.adopt_session()
        if config.metrics.port is not None:
            from prometheus_client import CollectorRegistry, start_http_server

            from scheduler_svc.metrics import register

            registry = CollectorRegistry()
            register(
                registry,
                engine,
                model_name=config.served_model_name or config.checkpoint or "default",
                mode=config.mode,
                max_context_len=layout.max_context_len,
            )
            metrics_server, _ = start_http_server(config.metrics.port, metrics_host(args), registry)
            metrics_port = metrics_server.server_port
        service = SchedulerService(
            engine,
            listen,
            tokenizer=tokenizer,
            capacity=mem.hello_info["capacity"],
            page_size=layout.page_size,
            max_context_len=layout.max_context_len,
            vocab_size=model_config.vocab_size,
            ready_file=args.ready_file,
            ready_info={"metrics_port": metrics_port},
            recovery=recovery,
            mode=config.mode,
            curve=curve.server,
            model_info={
                "checkpoint": str(Path(config.checkpoint).resolve()) if config.checkpoint else None,
                "served_model_name": config.served_model_name,
            },
            result_cache_bytes=config.result_cache_bytes,
        )
        apply_gc_policy()  # started: what lives now lives as long as the process
        await service.run()
        return 0
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        await model.close()
        if getattr(engine, "migration", None) is not None:
            await engine.migration.close()
        # recovery may have replaced the engine's memsvc client with a new session
        await (engine.mem if engine is not None else mem).close()


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # when started by a launcher: SIGTERM once it is gone
    args = parse_args(build_parser(), argv)
    setup_logging(args)
    try:
        listen = args.listen or default_listen_address("scheduler_svc")
        check_listen_address(listen, allow_remote=args.allow_remote)
        config = from_args(SchedulerServiceConfig, args)
        if config.migrate_to and config.mode != "decode":
            raise ConfigError("--migrate-to is for a decode node (--mode decode)")
        if config.migrate_to:
            check_listen_address(config.migrate_to, allow_remote=args.allow_remote)
        return asyncio.run(serve(config, args, listen, curve_from_args(args)))
    except (ConfigError, MemsvcError, PeerDeadError) as exc:
        print(f"scheduler_svc: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
