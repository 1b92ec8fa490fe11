"""What ``kvstack up`` runs: the process list of a stack, per mode.

A stack is a list of :class:`ProcessSpec` (command, address, ready file,
which health check applies), built by :func:`build_process_list` for a mode:
``normal`` is memsvc (its layout read from the checkpoint) + model_svc (the
bundled tiny model by default) + scheduler_svc, wired over ``ipc://`` sockets
in the run directory; ``pd`` is a decode node and a prefill node (memsvc-d,
memsvc-p, model_svc-d, model_svc-p, scheduler-d, scheduler-p, the two memsvc
linked by a transfer socket) and the router in front. Every address is fixed
by the run directory, so a restarted process comes back where its peers (the
router, the other memsvc, the workers) reconnect by themselves.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvstack.stack.model_pool import PoolMismatchError, pool_layout_args, worker_threads
from memsvc.curve import KeyFolder
from memsvc.transfer_backend import TransferBackend

MAX_IPC_PATH = 100  # sun_path holds 108 bytes; keep a margin


class StackUnavailableError(Exception):
    """The asked-for stack cannot be built (a mode not available yet, a bad option)."""


# -- what to run -------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessSpec:
    """One supervised process: ``command`` serves ``address`` once ``ready_file`` exists.

    ``kind`` names its health check in :data:`HEALTH_CHECKS`. ``starts_early``: it is
    spawned with the first process, not once those before it serve, as it waits for
    what it needs itself (model_svc imports torch and loads its model meanwhile, then
    waits for memsvc's ready file). ``drains``: SIGTERM makes it drain (a PD decode
    scheduler with ``--migrate-to`` moves its requests to its peer, then exits); the
    supervisor stops it first and waits for it while the rest of the stack serves.
    """

    name: str
    kind: str
    command: tuple[str, ...]
    address: str
    ready_file: Path
    log_file: Path
    env: dict[str, str] = field(default_factory=dict)
    extra_files: tuple[Path, ...] = ()  # removed when the stack stops
    starts_early: bool = False
    drains: bool = False


@dataclass
class StackOptions:
    """What a stack is made of, beyond its mode.

    ``via`` maps a process name to another address its clients connect to
    instead (the fault tests put a proxy there): ``memsvc`` / ``model_svc``
    for the scheduler's links in normal mode, ``scheduler-d`` /
    ``scheduler-p`` for the router's in PD mode. ``memsvc_args`` and
    ``scheduler_args`` go to both nodes in PD mode; the ``decode_*`` ones are
    added on the decode node only (and win). ``env`` goes to the scheduler(s).
    ``curve``: every process serves and connects with these keys (CURVE on
    every socket, the PD transfer socket included).
    """

    checkpoint: str | None = None
    memsvc_args: list[str] = field(default_factory=list)
    model_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    via: dict[str, str] = field(default_factory=dict)
    log_level: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    # PD mode
    decode_memsvc_args: list[str] = field(default_factory=list)
    decode_scheduler_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    transfer_backend: TransferBackend | str = TransferBackend.AUTO
    transfer_timeout: float | None = None
    curve: KeyFolder | None = None


def ipc_path(run_dir: Path, name: str) -> Path:
    """``RUN_DIR/NAME.sock``, refused if too long for an ``ipc://`` socket."""
    socket_path = run_dir / f"{name}.sock"
    if len(str(socket_path)) > MAX_IPC_PATH:
        raise StackUnavailableError(
            f"run dir {run_dir} is too long for an ipc:// socket path; choose a shorter --run-dir"
        )
    return socket_path


def service_spec(
    run_dir: Path, name: str, module: str, args: list[str], *, kind: str | None = None, **kw: Any
) -> ProcessSpec:
    """``python -m module --listen ipc://RUN_DIR/NAME.sock --ready-file ... *args``."""
    socket_path = ipc_path(run_dir, name)
    ready = run_dir / f"{name}.ready"
    address = f"ipc://{socket_path}"
    command = (sys.executable, "-m", module, "--listen", address, "--ready-file", str(ready))
    return ProcessSpec(
        name, kind or name, (*command, *args), address, ready, run_dir / f"{name}.log", **kw
    )


def normal_stack(run_dir: Path, options: StackOptions) -> list[ProcessSpec]:
    """memsvc, model_svc and scheduler_svc in normal mode, in start order."""
    from model_svc.tiny import default_checkpoint  # imports torch: only when building

    logging_args = ["--log-level", options.log_level] if options.log_level else []
    checkpoint = options.checkpoint or str(default_checkpoint())
    mem = service_spec(
        run_dir,
        "memsvc",
        "memsvc",
        [*pool_layout_args(checkpoint, options.memsvc_args), *options.memsvc_args, *logging_args],
    )
    model = service_spec(
        run_dir,
        "model_svc",
        "model_svc",
        [
            "--memsvc",
            options.via.get("memsvc", mem.address),
            "--memsvc-ready-file",
            str(mem.ready_file),
            "--checkpoint",
            checkpoint,
            "--threads",
            str(worker_threads(1)),
            *options.model_args,
            *logging_args,
        ],
        starts_early=True,
    )
    session_file = run_dir / "scheduler_svc.session"
    scheduler = service_spec(
        run_dir,
        "scheduler_svc",
        "scheduler_svc",
        [
            "--memsvc",
            options.via.get("memsvc", mem.address),
            "--worker",
            options.via.get("model_svc", model.address),
            "--memsvc-session-file",
            str(session_file),
            *tokenizer_args(checkpoint),
            *options.scheduler_args,
            *logging_args,
        ],
        env=dict(options.env),
        extra_files=(session_file,),
    )
    return [mem, model, scheduler]


def tokenizer_args(checkpoint: str) -> list[str]:
    """A scheduler tokenizes ``text`` with the model's tokenizer (without, as bytes)."""
    return ["--checkpoint", checkpoint]


PD_NODES = (("d", "decode"), ("p", "prefill"))


def pd_stack(run_dir: Path, options: StackOptions) -> list[ProcessSpec]:
    """Both PD nodes and the router, in start order (the wiring of ``Launcher.start_pd_stack``).

    memsvc-d, memsvc-p, model_svc-d, model_svc-p, scheduler-d, scheduler-p,
    router: memory services first, then the workers, the schedulers (each
    with a session file: a restarted decode scheduler adopts its predecessor's
    memsvc session, a restarted prefill one ends it at once, which also cancels
    that session's transfer rooms), and the router last. Stopped in the
    reverse order.
    """
    from model_svc.tiny import default_checkpoint  # imports torch: only when building

    logging_args = ["--log-level", options.log_level] if options.log_level else []
    checkpoint = options.checkpoint or str(default_checkpoint())
    transfer_sock = ipc_path(run_dir, "transfer")
    transfer = ["--transfer-backend", str(options.transfer_backend)]
    if options.transfer_timeout is not None:
        transfer += ["--transfer-timeout", str(options.transfer_timeout)]
    peers = {
        "d": ["--transfer-listen", f"ipc://{transfer_sock}"],
        "p": ["--transfer-peer", f"ipc://{transfer_sock}"],
    }
    mems, models, schedulers = {}, {}, {}
    for node, role in PD_NODES:
        decode = node == "d"
        pool = [*options.memsvc_args, *(options.decode_memsvc_args if decode else [])]
        mems[node] = service_spec(
            run_dir,
            f"memsvc-{node}",
            "memsvc",
            [
                *pool_layout_args(checkpoint, pool),
                *pool,
                "--pd-role",
                role,
                *transfer,
                *peers[node],
                *logging_args,
            ],
            kind="memsvc",
            extra_files=(transfer_sock,) if decode else (),
        )

    def via(spec: ProcessSpec) -> str:
        return options.via.get(spec.name, spec.address)

    for node, _ in PD_NODES:
        models[node] = service_spec(
            run_dir,
            f"model_svc-{node}",
            "model_svc",
            [
                "--memsvc",
                via(mems[node]),
                "--memsvc-ready-file",
                str(mems[node].ready_file),
                "--checkpoint",
                checkpoint,
                "--threads",
                str(worker_threads(len(PD_NODES))),
                *options.model_args,
                *logging_args,
            ],
            kind="model_svc",
            starts_early=True,
        )
    for node, role in PD_NODES:
        session_file = run_dir / f"scheduler-{node}.session"
        extra = options.decode_scheduler_args if node == "d" else []
        schedulers[node] = service_spec(
            run_dir,
            f"scheduler-{node}",
            "scheduler_svc",
            [
                "--mode",
                role,
                "--memsvc",
                via(mems[node]),
                "--worker",
                via(models[node]),
                "--memsvc-session-file",
                str(session_file),
                *tokenizer_args(checkpoint),
                *options.scheduler_args,
                *extra,
                *logging_args,
            ],
            kind="scheduler_svc",
            env=dict(options.env),
            extra_files=(session_file,),
            drains=any(a == "--migrate-to" or a.startswith("--migrate-to=") for a in extra),
        )
    router = service_spec(
        run_dir,
        "router",
        "scheduler_svc.pd.router",
        [
            "--prefill",
            via(schedulers["p"]),
            "--decode",
            via(schedulers["d"]),
            *options.router_args,
            *logging_args,
        ],
    )
    return [*mems.values(), *models.values(), *schedulers.values(), router]


def build_process_list(mode: str, run_dir: Path, options: StackOptions) -> list[ProcessSpec]:
    """The processes of a ``mode`` stack, in start order (the one place a mode is defined)."""
    from model_svc.errors import CheckpointError

    builders = {"normal": normal_stack, "pd": pd_stack}
    if mode not in builders:
        raise StackUnavailableError(f"unknown stack mode {mode!r}")
    try:
        specs = builders[mode](run_dir, options)
    except (PoolMismatchError, CheckpointError) as exc:
        raise StackUnavailableError(str(exc)) from None
    if options.curve is None:
        return specs
    curve = tuple(options.curve.service_args())  # every service takes all four flags
    return [replace(spec, command=(*spec.command, *curve)) for spec in specs]
