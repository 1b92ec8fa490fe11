"""``kvstack up``: build the process list for a mode (or, with ``--nodes N``, a cluster:
:mod:`kvstack.up.cluster`) and supervise it until a signal.

See :mod:`kvstack.stack.spec` for what runs and
:mod:`kvstack.up.supervisor` for how it is kept running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvstack.model.paths import TINY, say_on_stderr
from kvstack.stack.forward import (
    MEMSVC,
    ROUTER,
    SCHEDULER,
    add_service_flags,
    service_argv,
    transfer_options,
)
from kvstack.stack.model_args import (
    ModelArgsError,
    add_model_arguments,
    add_model_flags,
    served_model_name,
    stack_model,
)
from kvstack.stack.process import add_ready_timeout, ready_timeout
from kvstack.stack.spec import (
    ProcessSpec,
    StackOptions,
    StackUnavailableError,
    build_process_list,
)
from kvstack.up.cluster import ClusterOptions, check_shape, cluster_stack, workers_ready
from kvstack.up.supervisor import STATE_FILE, RestartPolicy, Supervisor, SupervisorError
from memsvc.cli import LOG_FORMAT, make_private_dirs, open_private_log
from memsvc.core.errors import InvalidArgumentError
from memsvc.curve import KeyFolder
from memsvc.settings import add_config_argument

log = logging.getLogger("kvstack.supervisor")


def default_run_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix="kvstack-up-", dir=base))


def prepare_run_dir(path: str | None) -> Path:
    """The run directory: a fresh one, or ``path`` if no live supervisor uses it."""
    if path is None:
        return default_run_dir()
    run_dir = make_private_dirs(Path(path).resolve())
    with contextlib.suppress(OSError, ValueError):
        state = json.loads((run_dir / STATE_FILE).read_text())
        pid = state.get("supervisor_pid")
        if state.get("status") not in ("stopped", "failed") and pid and pid_alive(pid):
            raise StackUnavailableError(f"a stack already runs in {run_dir} (supervisor pid {pid})")
    return run_dir


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mode",
        choices=["normal", "pd"],
        default="normal",
        help="normal: memsvc + model_svc + scheduler_svc; pd: a prefill node, a decode node "
        "(each memsvc + model_svc + scheduler) and the router",
    )
    parser.add_argument(
        "--run-dir",
        default=None,
        help="where sockets, logs and state.json go (created 0700 if missing; default: a "
        "fresh folder under $XDG_RUNTIME_DIR or /tmp); state.json, the logs and the "
        "session files are 0600",
    )
    model = add_model_arguments(parser, default_model=TINY)
    add_model_flags(model)
    security = parser.add_argument_group("security")
    security.add_argument(
        "--curve-dir",
        default=None,
        metavar="DIR",
        help="CURVE on every socket of the stack (the PD transfer socket too), with the keys "
        "in DIR: created there (zmq.auth certificates, private) if DIR holds none; "
        "refused (exit 2) if DIR, clients/ or a key file is another user's or group- or "
        "world-writable (docs/security.md)",
    )
    cluster = parser.add_argument_group(
        "cluster (many nodes behind SGLang's router, SMG; needs the cluster extra)"
    )
    cluster.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="N",
        help="start N normal-mode nodes (each memsvc + model_svc + scheduler_svc + its HTTP "
        "front), the Mooncake master (their shared KV tier: hierarchical cache on, "
        "--hicache-storage-backend mooncake) and SMG in front (docs/supervisor.md); not with "
        "--mode pd",
    )
    cluster.add_argument(
        "--prefill-nodes",
        type=int,
        default=None,
        metavar="P",
        help="PD mode instead of --nodes: P prefill nodes (each memsvc --pd-role prefill + "
        "model_svc + scheduler_svc --mode prefill + its HTTP front; the shared tier on them), "
        "the decode nodes (--decode-nodes) and SMG with --pd-disaggregation",
    )
    cluster.add_argument(
        "--decode-nodes",
        type=int,
        default=None,
        metavar="D",
        help="with --prefill-nodes: D decode nodes (memsvc --pd-role decode listening for KV)",
    )
    cluster.add_argument(
        "--smg-port",
        type=int,
        default=30000,
        help="with --nodes / --prefill-nodes: SMG's HTTP port, the cluster's API (0: a free one)",
    )
    cluster.add_argument(
        "--smg-policy",
        default="cache_aware",
        help="with --nodes: SMG's routing policy (smg launch --policy)",
    )
    cluster.add_argument(
        "--smg-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="with --nodes: pass ARG to `smg launch` (e.g. --smg-arg=--log-level=debug)",
    )
    add_service_flags(parser)
    add_config_argument(parser)
    extra = parser.add_argument_group(
        "more flags for one service (repeat for each; PD: memsvc and scheduler flags go to both "
        "nodes)"
    )
    for name in ("memsvc", "model", "scheduler", "router"):
        extra.add_argument(
            f"--{name}-arg",
            action="append",
            default=[],
            metavar="ARG",
            help=f"pass ARG to {name} (e.g. --{name}-arg=--log-level=DEBUG)",
        )
    extra.add_argument(
        "--decode-scheduler-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="--mode pd: pass ARG to the decode node's scheduler only (e.g. "
        "--decode-scheduler-arg=--migrate-to=ADDRESS: it then drains on SIGTERM)",
    )
    sup = parser.add_argument_group("supervision")
    sup.add_argument("--backoff-initial", type=float, default=0.5, help="first restart delay (s)")
    sup.add_argument("--backoff-max", type=float, default=30.0, help="longest restart delay (s)")
    sup.add_argument(
        "--stable-after",
        type=float,
        default=30.0,
        help="a process up this long (s) restarts at the first delay again",
    )
    add_ready_timeout(sup)
    sup.add_argument(
        "--health-interval", type=float, default=5.0, help="seconds between health checks"
    )
    sup.add_argument(
        "--health-timeout", type=float, default=3.0, help="seconds one health check may take"
    )
    sup.add_argument(
        "--drain-timeout",
        type=float,
        default=600.0,
        help="on SIGTERM / Ctrl-C, seconds a decode scheduler with --migrate-to (a "
        "--decode-scheduler-arg) has to move its requests to its peer while the rest of "
        "the stack serves, before it is stopped",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="supervisor log verbosity (the services log at their default)",
    )


def options_from_args(args: argparse.Namespace) -> StackOptions:
    """The stack ``args`` ask for; raises :class:`StackUnavailableError` for bad model flags."""
    from model_svc.errors import CheckpointError

    try:
        model = stack_model(args, say=say_on_stderr("kvstack up"))
    except (ModelArgsError, CheckpointError) as exc:
        raise StackUnavailableError(str(exc)) from None
    try:
        curve = KeyFolder.ensure(args.curve_dir) if args.curve_dir else None
    except InvalidArgumentError as exc:
        raise StackUnavailableError(str(exc)) from None
    scheduler = [*service_argv(args, SCHEDULER), "--served-model-name", served_model_name(args)]
    return StackOptions(
        checkpoint=str(model.checkpoint),
        memsvc_args=[*model.memsvc_args, *service_argv(args, MEMSVC), *args.memsvc_arg],
        model_args=[*model.model_args, *args.model_arg],
        scheduler_args=[*scheduler, *args.scheduler_arg],
        decode_scheduler_args=list(args.decode_scheduler_arg),
        router_args=[*service_argv(args, ROUTER), *args.router_arg],
        curve=curve,
        **transfer_options(args),
    )


def build_specs(
    args: argparse.Namespace, run_dir: Path
) -> tuple[str, StackOptions, list[ProcessSpec]]:
    """(mode, options, process list): one stack, or with ``--nodes`` (or
    ``--prefill-nodes`` / ``--decode-nodes``) a cluster (:mod:`kvstack.up.cluster`)."""
    if args.decode_scheduler_arg and (args.mode != "pd" or args.nodes is not None):
        raise StackUnavailableError("--decode-scheduler-arg is for one PD stack (--mode pd)")
    if args.nodes is None and args.prefill_nodes is None and args.decode_nodes is None:
        options = options_from_args(args)
        return args.mode, options, build_process_list(args.mode, run_dir, options)
    if args.mode != "normal":
        raise StackUnavailableError(
            "a cluster's nodes are given by --nodes or --prefill-nodes / --decode-nodes, "
            f"not --mode {args.mode}"
        )
    cluster = ClusterOptions(
        nodes=args.nodes or 0,
        prefill_nodes=args.prefill_nodes or 0,
        decode_nodes=args.decode_nodes or 0,
        port=args.smg_port,
        policy=args.smg_policy,
        smg_args=tuple(args.smg_arg),
        served_model_name=served_model_name(args),
    )
    check_shape(cluster)  # before the model is looked at
    options = options_from_args(args)
    return "cluster", options, cluster_stack(run_dir, options, cluster)


def await_workers(
    supervisor: Supervisor, nodes: int, timeout_s: float, stop: threading.Event
) -> None:
    """Until SMG reports every node ready (it registers them once it listens); raises
    :class:`SupervisorError` after stopping the cluster if it does not in ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (ready := workers_ready(supervisor.address("smg"))[0]) < nodes:
        if stop.is_set() or time.monotonic() > deadline:
            supervisor.stop()
            why = "interrupted" if stop.is_set() else f"not within {timeout_s:.0f}s"
            raise SupervisorError(f"SMG reports {ready} of {nodes} nodes ready ({why})")
        supervisor.poll()
        time.sleep(0.2)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    try:
        run_dir = prepare_run_dir(args.run_dir)
        mode, options, specs = build_specs(args, run_dir)
    except StackUnavailableError as exc:
        print(f"kvstack up: error: {exc}", file=sys.stderr)
        return 2
    open_private_log(run_dir / "supervisor.log").close()  # created 0600 if new
    handler = logging.FileHandler(run_dir / "supervisor.log")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)
    supervisor = Supervisor(
        specs,
        run_dir,
        mode=mode,
        policy=RestartPolicy(
            args.backoff_initial,
            args.backoff_max,
            args.stable_after,
            ready_timeout(args, options.checkpoint),
        ),
        health_timeout_s=args.health_timeout,
        health_interval_s=args.health_interval,
        drain_timeout_s=args.drain_timeout,
        new_session=True,
        die_with_parent=True,
        curve=options.curve,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        supervisor.start(stop=stop)
        if mode == "cluster":
            workers = (args.nodes or 0) + (args.prefill_nodes or 0) + (args.decode_nodes or 0)
            await_workers(supervisor, workers, supervisor.policy.ready_timeout_s, stop)
    except SupervisorError as exc:
        print(f"kvstack up: error: {exc}", file=sys.stderr)
        return 1
    try:
        print(
            f"kvstack up: {mode} stack running in {run_dir}; generate API at "
            f"{supervisor.address(specs[-1].name)}"
            f"{f' (CURVE, keys in {options.curve.path})' if options.curve else ''}; "
            f"`kvstack status --run-dir {run_dir}`",
            flush=True,
        )
        supervisor.serve(stop)
        log.info("stopping the stack")
    finally:
        supervisor.stop()
    print("kvstack up: stopped", flush=True)
    return 0
