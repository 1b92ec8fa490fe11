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

This module is the command (its flags, and starting or finding the stack, then
serving until a signal); the stack behind the front is :mod:`kvstack.serve.backends`,
the serve loop and its signals :mod:`kvstack.serve.server`, the application
:mod:`kvstack.serve.app`, the endpoint families :mod:`kvstack.serve.sglang` and
:mod:`kvstack.serve.openai`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import sys
import tempfile
from typing import Any

from kvstack.model.paths import TINY
from kvstack.serve.app import HttpFront
from kvstack.serve.backends import (
    ServeError,
    fronted_backend,
    load_stream_tokenizer,
    start_stack,
)
from kvstack.serve.limits import FrontLimits, add_limit_arguments, limits_from_args
from kvstack.serve.server import DeferredSignals, serve
from kvstack.stack.forward import add_service_flags
from kvstack.stack.model_args import add_model_arguments, add_model_flags, served_model_name
from kvstack.stack.process import add_ready_timeout
from memsvc.cli import LOG_FORMAT
from memsvc.core.errors import InvalidArgumentError
from memsvc.curve import KeyFolder
from memsvc.settings import add_config_argument

log = logging.getLogger("kvstack.http")

DEFAULT_PORT = 30000  # SGLang's


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
        choices=["normal", "pd", "prefill", "decode"],
        default="normal",
        help="normal: one node; pd: prefill/decode disaggregation behind kvstack's router; "
        "prefill, decode: one PD node behind SGLang's router, SMG (docs/cluster.md)",
    )
    stack.add_argument(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help="front the scheduler (or PD router) at this address instead of starting a stack",
    )
    stack.add_argument(
        "--transfer-listen",
        default=None,
        metavar="ADDRESS",
        help="with --scheduler and --mode decode: the decode memsvc's --transfer-listen, "
        "which the prefill node is told to send the KV to (kvstack up --decode-nodes)",
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
    signals = DeferredSignals()
    signals.install()  # a signal while the stack starts stops it once it is up
    args.model_path = getattr(args, "model_path", None) or (None if args.scheduler else TINY)
    try:
        limits = _limits(args)
        with contextlib.ExitStack() as exits:
            curve = _curve_keys(args)
            if args.scheduler:
                backend = fronted_backend(args, curve.client_keys() if curve else None)
            else:
                from kvstack.stack.launch import Launcher
                from kvstack.stack.model_pool import PoolMismatchError
                from kvstack.stack.process import LaunchError
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
