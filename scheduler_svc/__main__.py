"""``python -m scheduler_svc``: the kvstack scheduler."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from memsvc.cli import add_service_args, setup_logging
from memsvc.client import AsyncMemClient, PeerDeadError
from memsvc.core.errors import MemsvcError
from memsvc.server import check_listen_address, default_listen_address
from model_svc.client import AsyncModelClient
from scheduler_svc.core import ConfigError, SchedulerConfig

log = logging.getLogger("scheduler_svc")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scheduler_svc",
        description="kvstack scheduler: admits requests (PrefillAdder with the new_token_ratio "
        "safeguard), runs prefill and decode steps on model_svc over memsvc's KV pool, and "
        "retracts running requests when the next decode step would not fit.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--mode",
        choices=["normal"],
        default="normal",
        help="normal: one node, retracted requests are re-prefilled",
    )
    parser.add_argument("--memsvc", required=True, help="memsvc address")
    parser.add_argument("--worker", required=True, help="model_svc address")
    parser.add_argument(
        "--page-size",
        type=int,
        default=None,
        help="expected page size; refuse to start if memsvc's differs",
    )
    parser.add_argument(
        "--max-running-requests",
        type=int,
        default=None,
        help="most requests decoding at once (default: memsvc's row count)",
    )
    parser.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=16384,
        help="most tokens one prefill batch computes",
    )
    parser.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="split long prompts into chunks of this many tokens (default: off)",
    )
    parser.add_argument(
        "--schedule-conservativeness",
        type=float,
        default=1.0,
        help="scales the initial new_token_ratio (higher: admit fewer)",
    )
    parser.add_argument(
        "--retraction-policy",
        choices=["length", "priority"],
        default="length",
        help="victim order: fewest outputs first (length) or lowest priority",
    )
    parser.add_argument(
        "--enable-priority-scheduling",
        action="store_true",
        help="honour request priorities (needed by --retraction-policy priority)",
    )
    parser.add_argument(
        "--schedule-low-priority-values-first",
        action="store_true",
        help="a lower priority value is more important",
    )
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint folder whose tokenizer.json to use for text input "
        "(default: the byte-level tokenizer)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on 127.0.0.1:PORT (0: any free port)",
    )
    add_service_args(parser, ready_fields="address, pid, metrics_port")
    return parser


async def serve(args: argparse.Namespace, listen: str) -> int:
    from model_svc.config import ModelConfig
    from model_svc.tokenizer import ByteTokenizer, load_tokenizer
    from scheduler_svc.engine import Engine
    from scheduler_svc.service import SchedulerService

    mem = await AsyncMemClient.connect(args.memsvc, role="scheduler", name="scheduler_svc")
    metrics_server = None
    metrics_port = None
    model = AsyncModelClient(args.worker)
    try:
        layout = mem.layout
        if args.page_size is not None and args.page_size != layout.page_size:
            raise ConfigError(
                f"--page-size {args.page_size} but memsvc's pool has page size {layout.page_size}"
            )
        config = SchedulerConfig.from_env(
            page_size=layout.page_size,
            max_running_requests=args.max_running_requests or layout.max_running_requests,
            max_prefill_tokens=args.max_prefill_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            schedule_conservativeness=args.schedule_conservativeness,
            retraction_policy=args.retraction_policy,
            enable_priority_scheduling=args.enable_priority_scheduling,
            schedule_low_priority_values_first=args.schedule_low_priority_values_first,
        )
        model_config = ModelConfig.from_dict((await model.info())["model"])
        tokenizer = (
            load_tokenizer(args.checkpoint, model_config) if args.checkpoint else ByteTokenizer()
        )
        engine = Engine(
            config,
            mem,
            model,
            lambda req, finished: None,
            eos_token_ids=model_config.eos_token_ids,
            capacity=mem.hello_info["capacity"],
        )
        if args.metrics_port is not None:
            from prometheus_client import CollectorRegistry, start_http_server

            from scheduler_svc.metrics import register

            registry = CollectorRegistry()
            register(registry, engine)
            metrics_server, _ = start_http_server(args.metrics_port, "127.0.0.1", registry)
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
        )
        await service.run()
        return 0
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        await model.close()
        await mem.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args)
    try:
        listen = args.listen or default_listen_address("scheduler_svc")
        check_listen_address(listen, allow_remote=args.allow_remote)
        return asyncio.run(serve(args, listen))
    except (ConfigError, MemsvcError, PeerDeadError) as exc:
        print(f"scheduler_svc: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
