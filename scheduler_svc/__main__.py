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
from memsvc.lifeline import die_with_parent
from memsvc.server import check_listen_address, default_listen_address, metrics_host
from scheduler_svc.core import ConfigError, SchedulerConfig
from scheduler_svc.core.config import RETRACTION_POLICIES
from scheduler_svc.protocol import RESULT_CACHE_BYTES, RESULT_CACHE_SIZE

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
        choices=["normal", "prefill", "decode"],
        default="normal",
        help="normal: one node; prefill / decode: one side of a PD pair behind "
        "`python -m scheduler_svc.pd.router` (memsvc needs the matching --pd-role)",
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
        choices=list(RETRACTION_POLICIES),
        default="length",
        help="victim order: fewest outputs first (length, SGLang's), lowest priority "
        "(priority), or cheapest to bring back first by the retract cost model under "
        "--retract-mode (cost: re-prefill seconds, or KV copy seconds when offloading)",
    )
    parser.add_argument(
        "--retract-mode",
        choices=["recompute", "offload", "auto"],
        default="recompute",
        help="what a retracted request's KV becomes (normal mode): dropped and re-prefilled "
        "(SGLang), parked in memsvc's host store and loaded back, or per victim the cheaper "
        "of the two by a cost model learned online. A decode node always offloads",
    )
    parser.add_argument(
        "--retract-cooldown-steps",
        type=int,
        default=0,
        help="thrash guard: a request re-admitted after a retract is not a victim again "
        "for this many forward passes unless nothing else can be (0: off, as in SGLang)",
    )
    parser.add_argument(
        "--readmit-charge",
        choices=["remaining", "full"],
        default="remaining",
        help="what re-admitting a retracted request reserves for its output: what it has "
        "left to generate, or its whole max_new_tokens again (SGLang); either way it is "
        "admitted if what it has left fits",
    )
    parser.add_argument(
        "--num-reserved-decode-tokens",
        type=int,
        default=512,
        help="decode node: tokens reserved per active request when preallocating",
    )
    parser.add_argument(
        "--pd-retract-fallback",
        choices=["abort", "recompute"],
        default="abort",
        help="decode node: a victim the host store cannot take is aborted (SGLang) or "
        "re-prefilled through the prefill node",
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
        "(default: the byte-level tokenizer); info names it, so that a front decodes alike",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model_name label of the sglang:* metrics (default: --checkpoint, or "
        "'default' without one)",
    )
    parser.add_argument(
        "--result-cache-bytes",
        type=int,
        default=RESULT_CACHE_BYTES,
        help="bytes of finished results (as msgpack) kept to answer a re-submitted rid, and "
        f"at most {RESULT_CACHE_SIZE} results; the oldest go first, the newest is always kept",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on --metrics-host:PORT (0: any free port)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics server binds (non-loopback needs --allow-remote)",
    )
    faults = parser.add_argument_group("fault tolerance")
    faults.add_argument(
        "--memsvc-timeout",
        type=float,
        default=5.0,
        help="seconds memsvc has to answer one op (tried 3 times) before it counts as dead",
    )
    faults.add_argument(
        "--memsvc-lease",
        type=float,
        default=10.0,
        help="memsvc session lease: memsvc reclaims our KV this long after we go silent",
    )
    faults.add_argument(
        "--worker-timeout",
        type=float,
        default=60.0,
        help="seconds model_svc has to answer one forward call (tried twice) before it "
        "counts as dead (a worker that exits is noticed at once)",
    )
    faults.add_argument(
        "--recovery-timeout",
        type=float,
        default=120.0,
        help="how long to wait for a dead memsvc or model_svc to come back before "
        "failing the live requests",
    )
    faults.add_argument(
        "--memsvc-session-file",
        default=None,
        help="keep our memsvc session id here; a restarted scheduler ends the session its "
        "dead predecessor left, so memsvc reclaims that KV at once",
    )
    add_service_args(parser, ready_fields="address, pid, metrics_port")
    add_curve_arguments(parser, connects_to="memsvc (--memsvc) and model_svc (--worker)")
    return parser


async def serve(args: argparse.Namespace, listen: str, curve: CurveKeys) -> int:
    from model_svc.config import ModelConfig
    from model_svc.tokenizer import ByteTokenizer, load_tokenizer
    from scheduler_svc.engine import Engine
    from scheduler_svc.pd.decode import DecodeEngine
    from scheduler_svc.pd.prefill import PrefillEngine
    from scheduler_svc.recovery import Recovery
    from scheduler_svc.resilient import ResilientModelClient
    from scheduler_svc.service import SchedulerService

    def connect_mem() -> Any:
        return AsyncMemClient.connect(
            args.memsvc,
            role="scheduler",
            name="scheduler_svc",
            lease_s=args.memsvc_lease,
            timeout_s=args.memsvc_timeout,
            curve=curve.client,
        )

    mem = await connect_mem()
    engine = None
    metrics_server = None
    metrics_port = None
    model = ResilientModelClient(
        args.worker,
        timeout_s=args.worker_timeout,
        recovery_timeout_s=args.recovery_timeout,
        curve=curve.client,
    )
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
            retract_mode="offload" if args.mode == "decode" else args.retract_mode,
            num_reserved_decode_tokens=args.num_reserved_decode_tokens,
            retract_cooldown_steps=args.retract_cooldown_steps,
            readmit_charge=args.readmit_charge,
            pd_retract_fallback=args.pd_retract_fallback,
        )
        model_config = ModelConfig.from_dict((await model.info())["model"])
        tokenizer = (
            load_tokenizer(args.checkpoint, model_config) if args.checkpoint else ByteTokenizer()
        )
        engine_class = {"normal": Engine, "prefill": PrefillEngine, "decode": DecodeEngine}
        engine = engine_class[args.mode](
            config,
            mem,
            model,
            lambda req, finished: None,
            eos_token_ids=model_config.eos_token_ids,
            capacity=mem.hello_info["capacity"],
        )
        recovery = Recovery(
            engine,
            connect_mem,
            args.memsvc,
            recovery_timeout_s=args.recovery_timeout,
            session_file=args.memsvc_session_file,
            curve=curve.client,
        )
        await recovery.adopt_session()
        if args.metrics_port is not None:
            from prometheus_client import CollectorRegistry, start_http_server

            from scheduler_svc.metrics import register

            registry = CollectorRegistry()
            register(
                registry,
                engine,
                model_name=args.served_model_name or args.checkpoint or "default",
                mode=args.mode,
                max_context_len=layout.max_context_len,
            )
            metrics_server, _ = start_http_server(args.metrics_port, metrics_host(args), registry)
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
            mode=args.mode,
            curve=curve.server,
            model_info={
                "checkpoint": str(Path(args.checkpoint).resolve()) if args.checkpoint else None,
                "served_model_name": args.served_model_name,
            },
            result_cache_bytes=args.result_cache_bytes,
        )
        await service.run()
        return 0
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        await model.close()
        # recovery may have replaced the engine's memsvc client with a new session
        await (engine.mem if engine is not None else mem).close()


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # when started by a launcher: SIGTERM once it is gone
    args = build_parser().parse_args(argv)
    setup_logging(args)
    try:
        listen = args.listen or default_listen_address("scheduler_svc")
        check_listen_address(listen, allow_remote=args.allow_remote)
        return asyncio.run(serve(args, listen, curve_from_args(args)))
    except (ConfigError, MemsvcError, PeerDeadError) as exc:
        print(f"scheduler_svc: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
