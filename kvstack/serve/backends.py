"""The stack ``kvstack serve`` fronts, as a :class:`~kvstack.serve.app.Backend`.

Either a stack it starts (:func:`start_stack`: memsvc, model_svc and scheduler_svc,
or PD's two nodes and router, with the forwarded flags; everything mode-specific
lives here) or a running scheduler it fronts (:func:`fronted_backend`, with
``--scheduler``: without ``--model-path`` it asks the scheduler which model it
serves); and the tokenizer that decodes what the backend streams.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Any

from kvstack.model.paths import TINY, say_on_stderr
from kvstack.serve.app import Backend
from kvstack.stack.forward import MEMSVC, ROUTER, SCHEDULER, service_argv, transfer_options
from kvstack.stack.model_args import (
    ModelArgsError,
    StackModel,
    resolve_model_path,
    served_model_name,
    stack_model,
)
from kvstack.stack.process import ready_timeout
from memsvc.curve import CurveClientKeys

ASK_TIMEOUT_S = 2.0  # one try at asking a fronted scheduler what it serves


class ServeError(RuntimeError):
    """The stack cannot be served as asked (exit status 2, the message on stderr)."""


def start_stack(launcher: Any, mode: str, args: argparse.Namespace) -> Backend:
    """Start the services of ``mode`` with ``launcher``; everything mode-specific lives here."""
    if mode == "normal":
        return _start_normal(launcher, args)
    if mode == "pd":
        return _start_pd(launcher, args)
    if mode in ("prefill", "decode"):
        return _start_role(launcher, mode, args)
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


def _start_role(launcher: Any, role: str, args: argparse.Namespace) -> Backend:
    """One PD node for SGLang's router: memsvc with ``--pd-role`` (a decode node's
    listening for KV on a socket in the run folder), scheduler_svc with ``--mode``."""
    model = _stack_model(args)
    options = transfer_options(args)
    transfer = ["--pd-role", role]
    for name in ("transfer_backend", "transfer_timeout"):
        if name in options:
            transfer += [f"--{name.replace('_', '-')}", str(options[name])]
    listen = None
    if role == "decode":
        listen = f"ipc://{launcher.workdir}/transfer.sock"
        transfer += ["--transfer-listen", listen]
    mem, worker, sched = launcher.start_normal_stack(
        model.checkpoint,
        [*_pool(args, model), "--metrics-port", "0", *transfer],
        [*_scheduler(args, model), "--metrics-port", "0", "--mode", role],
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
        transfer=listen,
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


def fronted_backend(args: argparse.Namespace, curve: CurveClientKeys | None) -> Backend:
    if args.mode == "decode" and not args.transfer_listen:
        raise ServeError("--mode decode with --scheduler needs --transfer-listen (its memsvc's)")
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
    return Backend(
        args.scheduler,
        metrics,
        checkpoint,
        curve=curve,
        served_model_name=served,
        transfer=args.transfer_listen,
    )


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
