"""``kvstack serve``: the stack behind SGLang's native HTTP API (aiohttp).

Either starts a stack itself (memsvc, model_svc, scheduler_svc, in a private
temporary folder, stopped and reaped on the way out) or, with ``--scheduler``,
fronts one that is already running (what docker compose does: one container
per process); without ``--model-path`` it then asks the scheduler which model it
serves (its ``info``, waiting up to ``--ready-timeout`` for an answer), to
decode with that model's tokenizer. Endpoints, as SGLang names them:

* ``POST /generate``: ``text`` or ``input_ids``, ``sampling_params``,
  ``stream`` (server-sent events, ``data: [DONE]`` last), ``rid``;
* ``GET /health``: 200 when the scheduler answers ``info``, else 503;
* ``GET /get_server_info``: the scheduler's ``info`` (pool size, page size,
  retraction policy, schedule conservativeness, mode);
* ``POST /abort_request``: ``{"rid": ...}`` (or ``{"abort_all": true}``);
* ``GET /metrics``: every service's Prometheus metrics and the front's own,
  merged into one exposition (one HELP/TYPE per family, a ``service`` label
  telling the sources apart), so that it parses.

With ``--curve-dir DIR`` every ZMQ socket has CURVE on (docs/security.md): the
stack started serves and connects with DIR's keys, and the front connects with
its client keys (also when fronting with ``--scheduler``).

Bad requests get a 4xx answer ``{"error": {"message", "code"}}`` at once:
the body is validated here (strictly, unknown fields refused) and the
scheduler's intake rejections (a prompt that can never fit, ids out of the
vocabulary...) keep the status code it gives them.

This module is the command (flags, starting the stack, serving until a
signal); the application is :mod:`kvstack.serve.app`, the endpoint families
:mod:`kvstack.serve.sglang` and :mod:`kvstack.serve.openai`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from kvstack.model.paths import TINY, say_on_stderr
from kvstack.serve.app import Backend, HttpFront
from kvstack.serve.limits import (
    FrontLimits,
    add_limit_arguments,
    limits_from_args,
    listen_backlog,
)
from kvstack.stack.forward import (
    MEMSVC,
    ROUTER,
    SCHEDULER,
    add_service_flags,
    service_argv,
    transfer_options,
)
from kvstack.stack.launch import add_ready_timeout, ready_timeout
from kvstack.stack.model_args import (
    ModelArgsError,
    StackModel,
    add_model_arguments,
    add_model_flags,
    resolve_model_path,
    served_model_name,
    stack_model,
)
from memsvc.cli import LOG_FORMAT, write_ready_file
from memsvc.core.errors import InvalidArgumentError
from memsvc.curve import CurveClientKeys, KeyFolder
from memsvc.settings import add_config_argument

log = logging.getLogger("kvstack.http")

DEFAULT_PORT = 30000  # SGLang's
SHUTDOWN_GRACE_S = 5.0  # in-flight requests get this long, then are cancelled (and aborted)
ASK_TIMEOUT_S = 2.0  # one try at asking a fronted scheduler what it serves


class ServeError(RuntimeError):
    """The stack cannot be served as asked (exit status 2, the message on stderr)."""


# -- the stack behind the front ---------------------------------------------------------------


def start_stack(launcher: Any, mode: str, args: argparse.Namespace) -> Backend:
    """Start the services of ``mode`` with ``launcher``; everything mode-specific lives here."""
    if mode == "normal":
        return _start_normal(launcher, args)
    if mode == "pd":
        return _start_pd(launcher, args)
    raise ServeError(f"unknown --mode {mode!r}")


def _start_pd(launcher: Any, args: argparse.Namespace) -> Backend:
    """Prefill node, decode node and router (``Launcher.start_pd_stack``); metrics of all four."""
    model = _stack_model(args)
    up = launcher.start_pd_stack(
        model.checkpoint,
        [*_pool(args, model), "--metrics-port", "0"],
        [*_scheduler(args, model), "--metrics-port", "0"],
        model=model.model_args,
        router=service_argv(args, ROUTER),
        log_level=args.log_level,
        **transfer_options(args),
    )
    metrics = {
        name: f"http://127.0.0.1:{up[name].metrics_port}/metrics"
        for name in ("memsvc-p", "memsvc-d", "scheduler-p", "scheduler-d")
    }
    return Backend(
        scheduler=up["router"].address,
        metrics=metrics,
        checkpoint=model.checkpoint,
        pids={s.name: s.proc.pid for s in up.values()},
    )


def _start_normal(launcher: Any, args: argparse.Namespace) -> Backend:
    model = _stack_model(args)
    mem, worker, sched = launcher.start_normal_stack(
        model.checkpoint,
        [*_pool(args, model), "--metrics-port", "0"],
        [*_scheduler(args, model), "--metrics-port", "0"],
        model=model.model_args,
        log_level=args.log_level,
    )
    return Backend(
        scheduler=sched.address,
        metrics={
            "memsvc": f"http://127.0.0.1:{mem.metrics_port}/metrics",
            "scheduler": f"http://127.0.0.1:{sched.metrics_port}/metrics",
        },
        checkpoint=model.checkpoint,
        pids={s.name: s.proc.pid for s in (mem, worker, sched)},
    )


def _stack_model(args: argparse.Namespace) -> StackModel:
    try:
        return stack_model(args, say=say_on_stderr("kvstack serve"))
    except ModelArgsError as exc:
        raise ServeError(str(exc)) from None


def _pool(args: argparse.Namespace, model: StackModel) -> list[str]:
    """memsvc's flags: the model's pool, then the options the user set."""
    return [*model.memsvc_args, *service_argv(args, MEMSVC)]


def _scheduler(args: argparse.Namespace, model: StackModel) -> list[str]:
    """scheduler_svc's flags; it tokenizes ``text`` with the checkpoint's tokenizer, as the
    front decodes."""
    return [
        *service_argv(args, SCHEDULER),
        "--checkpoint",
        str(model.checkpoint),
        "--served-model-name",
        served_model_name(args),
    ]


def _fronted(args: argparse.Namespace, curve: CurveClientKeys | None) -> Backend:
    metrics = {}
    for i, spec in enumerate(args.metrics_url):
        name, sep, url = spec.partition("=")
        if not sep or "://" in name:
            name, url = f"source{i}", spec
        metrics[name] = url
    if args.model_path is not None:
        checkpoint, served = _fronted_checkpoint(args.model_path), None
    else:
        checkpoint, served = _scheduler_model(args.scheduler, curve, ready_timeout(args, None))
    return Backend(args.scheduler, metrics, checkpoint, curve=curve, served_model_name=served)


def _fronted_checkpoint(model_path: str) -> Path | None:
    """The fronted stack's checkpoint, for its tokenizer; None: the tiny model's bytes."""
    if model_path == TINY and not Path(TINY).is_dir():
        return None
    try:
        return resolve_model_path(model_path, say=say_on_stderr("kvstack serve"))
    except ModelArgsError as exc:
        raise ServeError(str(exc)) from None


def _scheduler_model(
    address: str, curve: CurveClientKeys | None, timeout_s: float
) -> tuple[Path | None, str | None]:
    """What the scheduler at ``address`` serves, asked until it answers (up to
    ``timeout_s``): the checkpoint whose tokenizer it uses (None: bytes, the tiny
    model's) and its served model name."""
    info = _ask_info(address, curve, timeout_s)
    if "checkpoint" not in info:
        raise ServeError(
            f"the scheduler at {address} does not say which model it serves (an older "
            "scheduler_svc); pass --model-path"
        )
    checkpoint = info["checkpoint"]
    if checkpoint is not None and not Path(checkpoint).is_dir():
        raise ServeError(
            f"the scheduler at {address} serves {checkpoint}, which is no folder here; pass "
            "--model-path (that model's folder, or its name, here)"
        )
    return (None if checkpoint is None else Path(checkpoint)), info.get("served_model_name")


def _ask_info(address: str, curve: CurveClientKeys | None, timeout_s: float) -> dict[str, Any]:
    from memsvc.client import PeerDeadError
    from scheduler_svc.client import GenerateClient

    deadline = time.monotonic() + timeout_s
    ask_s = min(timeout_s, ASK_TIMEOUT_S)
    with GenerateClient(address, timeout_s=ask_s, resubmits=0, curve=curve) as client:
        while True:
            with contextlib.suppress(PeerDeadError):
                info = client.info()
                if info.get("ok") or "checkpoint" in info:  # a wedged router still says
                    return info
                time.sleep(min(ask_s, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                raise ServeError(
                    f"the scheduler at {address} did not answer within {timeout_s:g} s, so "
                    "which model it serves is unknown: pass --model-path (or a longer "
                    "--ready-timeout)"
                )


def load_stream_tokenizer(checkpoint: Path | None) -> Any:
    """The tokenizer that turns streamed token ids into text (the scheduler's own choice)."""
    from model_svc.tokenizer import ByteTokenizer

    if checkpoint is None:
        return ByteTokenizer()
    from model_svc.config import ModelConfig
    from model_svc.errors import CheckpointError
    from model_svc.tokenizer import load_tokenizer

    try:
        return load_tokenizer(checkpoint, ModelConfig.from_file(checkpoint))
    except CheckpointError as exc:
        raise ServeError(f"--model-path: {exc}") from None


# -- the command ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve kvstack over SGLang's native HTTP API: start a stack (memsvc, model_svc, "
        "scheduler_svc) or front a running scheduler (--scheduler)."
    )
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to serve HTTP on")
    http.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port (0: any free)")
    http.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="streamed chunks carry only the new text and ids (SGLang's flag); by default "
        "each chunk carries the whole output so far",
    )
    http.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a generate request may wait for the scheduler's next reply",
    )
    http.add_argument(
        "--control-timeout",
        type=float,
        default=5.0,
        help="seconds /health, /get_server_info and aborts wait for the scheduler",
    )
    http.add_argument(
        "--ready-file",
        default=None,
        help="write {address, pid, scheduler, services, metrics} as JSON here once serving",
    )
    http.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log verbosity (also passed to the services started)",
    )

    stack = parser.add_argument_group("stack")
    stack.add_argument(
        "--mode",
        choices=["normal", "pd"],
        default="normal",
        help="normal: one node; pd: prefill/decode disaggregation",
    )
    stack.add_argument(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help="front the scheduler (or PD router) at this address instead of starting a stack",
    )
    stack.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="with --scheduler: a service's /metrics to include in ours (repeatable)",
    )
    security = parser.add_argument_group("security")
    security.add_argument(
        "--curve-dir",
        default=None,
        metavar="DIR",
        help="CURVE on every ZMQ socket, with the keys in DIR (docs/security.md): the stack "
        "started serves and connects with them (created in DIR if it holds none); with "
        "--scheduler, the front connects with DIR's client keys; refused (exit 2) if DIR, "
        "clients/ or a key file is another user's or group- or world-writable",
    )
    add_ready_timeout(stack)
    add_limit_arguments(parser)
    model = add_model_arguments(
        parser,
        default_model=None,
        default_help="default: tiny; with --scheduler, the model the scheduler says it serves",
    )
    add_model_flags(model)
    add_service_flags(parser)
    add_config_argument(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    signals = _DeferredSignals()
    signals.install()  # a signal while the stack starts stops it once it is up
    args.model_path = getattr(args, "model_path", None) or (None if args.scheduler else TINY)
    try:
        limits = _limits(args)
        with contextlib.ExitStack() as exits:
            curve = _curve_keys(args)
            if args.scheduler:
                backend = _fronted(args, curve.client_keys() if curve else None)
            else:
                from kvstack.stack.launch import Launcher, LaunchError
                from kvstack.stack.model_pool import PoolMismatchError
                from model_svc.errors import CheckpointError

                workdir = exits.enter_context(tempfile.TemporaryDirectory(prefix="kvstack-serve-"))
                given = getattr(args, "ready_timeout", None)  # None: each service's default
                launcher = Launcher(workdir, curve=curve, ready_timeout=given)
                exits.callback(_report_leaks, launcher)  # runs once the launcher has stopped all
                exits.enter_context(launcher)
                try:
                    backend = start_stack(launcher, args.mode, args)
                except (LaunchError, PoolMismatchError, CheckpointError) as exc:
                    raise ServeError(str(exc)) from None
                if curve is not None:
                    backend = dataclasses.replace(backend, curve=curve.client_keys())
            if signals.received is not None:
                log.info("signal %d while starting: stopping", signals.received)
                return 0
            front = HttpFront(
                backend,
                mode=args.mode,
                tokenizer=load_stream_tokenizer(backend.checkpoint),
                incremental_streaming=args.incremental_streaming_output,
                request_timeout_s=args.request_timeout,
                control_timeout_s=args.control_timeout,
                served_model_name=served_model_name(args) or backend.served_model_name,
                limits=limits,
            )
            try:
                asyncio.run(serve(front, args, signals))
            finally:
                signals.install()  # the loop restored the defaults: stay alive to clean up
            return 0
    except ServeError as exc:
        print(f"kvstack serve: error: {exc}", file=sys.stderr)
        return 2


def _limits(args: argparse.Namespace) -> FrontLimits:
    try:
        limits = limits_from_args(args)
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    problem = limits.fd_problem()
    if problem is not None:
        raise ServeError(problem)
    return limits


def _curve_keys(args: argparse.Namespace) -> KeyFolder | None:
    """``--curve-dir``'s keys: created if absent for a stack we start, required when fronting."""
    if not args.curve_dir:
        return None
    try:
        if args.scheduler:
            return KeyFolder.existing(args.curve_dir)
        return KeyFolder.ensure(args.curve_dir)
    except InvalidArgumentError as exc:
        raise ServeError(str(exc)) from None


def _report_leaks(launcher: Any) -> None:
    """The launcher unlinks what a stopped service left in /dev/shm; say that it had to."""
    if launcher.leaked_segments:
        log.warning("services left shared memory behind (unlinked): %s", launcher.leaked_segments)


async def serve(
    front: HttpFront, args: argparse.Namespace, signals: _DeferredSignals | None = None
) -> None:
    """Serve until SIGINT / SIGTERM; in-flight requests get a short grace, then are aborted."""
    runner = web.AppRunner(
        front.app(),
        shutdown_timeout=SHUTDOWN_GRACE_S,
        handler_cancellation=True,
        **front.limits.aiohttp_settings(),
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if signals is not None and signals.received is not None:
        stop.set()  # it came before the handlers above
    listener: asyncio.Server | None = None
    try:
        # The listening socket is ours, not an aiohttp site, so that every connection
        # goes through the front's connection cap first.
        assert runner.server is not None
        factory = front.connections.protocol_factory(runner.server)
        try:
            listener = await loop.create_server(
                factory, args.host, args.port, backlog=listen_backlog()
            )
        except OSError as exc:
            raise ServeError(f"cannot serve on {args.host}:{args.port}: {exc}") from None
        host, port = listener.sockets[0].getsockname()[:2]
        address = f"http://{host}:{port}"
        write_ready_file(
            args.ready_file,
            address,
            scheduler=front.backend.scheduler,
            services=front.backend.pids,
            metrics=front.backend.metrics,
        )
        print(f"kvstack serve: listening on {address} (scheduler {front.backend.scheduler})")
        sys.stdout.flush()
        await stop.wait()
        log.info("stopping")
    finally:
        if listener is not None:
            listener.close()  # no new connections; runner.cleanup() ends the open ones
        await runner.cleanup()
        if args.ready_file:
            with contextlib.suppress(FileNotFoundError):
                Path(args.ready_file).unlink()


class _DeferredSignals:
    """SIGINT / SIGTERM noted instead of acted on, while the stack starts or stops.

    A signal that killed this process there would orphan the services it has
    started (or is starting, which the launcher does not yet know about).
    """

    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self.received = signum
