"""Start kvstack stacks as child processes and always reap them.

:class:`Launcher` starts services (:mod:`kvstack.stack.process`: each one up once
it has written its ready file) and whole stacks of them (normal, PD, a PD pair of
decode nodes), and stops everything it started, last first, on exit: SIGTERM,
then SIGKILL after a grace period, so no process or shared-memory segment
outlives it; a kvstack segment a stopped service left is unlinked, and its name
kept in :attr:`Launcher.leaked_segments` for the caller to report.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstack.stack.model_pool import pool_layout_args, worker_threads
from kvstack.stack.process import (
    Service,
    Starting,
    await_service,
    model_ready_timeout,
    spawn_service,
)
from memsvc.curve import KeyFolder
from memsvc.transfer_backend import TransferBackend


class Launcher:
    """Starts services in ``workdir``; ``with Launcher(dir) as up: up.start(...)``.

    ``stop_timeout``: seconds each service gets after SIGTERM before SIGKILL.
    ``curve``: every service it starts serves and connects with these keys
    (CURVE on every socket); its clients need ``curve.client_keys()``.
    ``ready_timeout``: seconds each service may take to start (``--ready-timeout``);
    None: :func:`start_service`'s default, model_svc's grown with its checkpoint.
    """

    def __init__(
        self,
        workdir: str | Path,
        *,
        stop_timeout: float = 30,
        curve: KeyFolder | None = None,
        ready_timeout: float | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.stop_timeout = stop_timeout
        self.curve = curve
        self.ready_timeout = ready_timeout
        self.services: list[Service] = []
        # Spawned by :meth:`spawn`, not yet awaited: killed by :meth:`stop_all`.
        self.starting: list[Starting] = []
        # Every segment a service stopped by :meth:`stop_all` left (unlinked).
        self.leaked_segments: list[str] = []

    def start(self, module: str, *args: str, **kwargs: Any) -> Service:
        return self.await_started(self.spawn(module, *args, **kwargs))

    def spawn(self, module: str, *args: str, **kwargs: Any) -> Starting:
        """Start a service without waiting for it; :meth:`await_started` does."""
        if self.curve is not None:  # every kvstack service takes the four flags
            args = (*args, *self.curve.service_args())
        if self.ready_timeout is not None:
            kwargs["timeout"] = self.ready_timeout
        starting = spawn_service(self.workdir, module, *args, **kwargs)
        self.starting.append(starting)
        return starting

    def await_started(self, starting: Starting) -> Service:
        """``starting`` once it serves (:func:`await_service`); it then stops with the rest."""
        try:
            service = await_service(starting)
        finally:
            self.starting.remove(starting)
        self.services.append(service)
        return service

    def start_normal_stack(
        self,
        checkpoint: str | Path,
        pool: list[str],
        scheduler: list[str] = (),
        *,
        model: Sequence[str] = (),
        suffix: str = "",
        env: dict[str, str] | None = None,
        log_level: str | None = None,
    ) -> tuple[Service, Service, Service]:
        """memsvc + model_svc + scheduler_svc in normal mode, wired together.

        memsvc's layout comes from the checkpoint (``pool`` may repeat it, not
        contradict it). ``model``: extra model_svc flags (``--device cuda``
        with a cuda pool; ``--threads N``, by default every usable core).
        ``log_level``, if given, is passed to each as ``--log-level``.
        """
        logging = ["--log-level", log_level] if log_level else []
        layout = pool_layout_args(checkpoint, pool)
        mem_starting = self.spawn("memsvc", *layout, *pool, *logging, name=f"memsvc{suffix}")
        model_starting = self.spawn_model(mem_starting, checkpoint, 1, model, logging, suffix)
        mem = self.await_started(mem_starting)
        model = self.await_started(model_starting)
        sched = self.start(
            "scheduler_svc",
            "--memsvc",
            mem.address,
            "--worker",
            model.address,
            *scheduler,
            *logging,
            name=f"scheduler_svc{suffix}",
            env=env,
        )
        return mem, model, sched

    def spawn_model(
        self,
        mem: Starting,
        checkpoint: str | Path,
        num_workers: int,
        model: Sequence[str],
        logging: list[str],
        suffix: str,
    ) -> Starting:
        """model_svc for memsvc ``mem``, spawned while ``mem`` starts: it imports torch and
        loads the model meanwhile, and connects once ``mem`` has written its ready file."""
        return self.spawn(
            "model_svc",
            "--memsvc",
            mem.address,
            "--memsvc-ready-file",
            str(mem.ready),
            "--checkpoint",
            str(checkpoint),
            "--threads",
            str(worker_threads(num_workers)),
            *model,
            *logging,
            name=f"model_svc{suffix}",
            timeout=model_ready_timeout(checkpoint),
        )

    def start_pd_stack(
        self,
        checkpoint: str | Path,
        pool: list[str],
        scheduler: list[str] = (),
        *,
        decode_pool: list[str] | None = None,
        decode_scheduler: list[str] = (),
        migrate_to_pool: list[str] | None = None,
        migrate: bool = True,
        transfer_backend: TransferBackend | str = TransferBackend.AUTO,
        transfer_timeout: float = 5.0,
        model: Sequence[str] = (),
        router: Sequence[str] = (),
        suffix: str = "",
        log_level: str | None = None,
    ) -> dict[str, Service]:
        """A prefill node, a decode node and the router, wired together; returns them by name.

        ``pool`` / ``scheduler`` apply to both nodes; ``decode_pool`` /
        ``decode_scheduler`` add to (and win over) them on the decode node.
        ``migrate_to_pool``: a second decode node (``memsvc-d2``, ``model_svc-d2``,
        ``scheduler-d2``; ``pool`` and these flags), which the first one moves its
        retracted requests to (``--migrate-to``; not with ``migrate=False``: the
        same nodes, none moved); the router does not send it any.
        Each memsvc's layout comes from the checkpoint; the workers split
        the usable cores (``model`` may set ``--threads``). ``router``: extra router flags.
        """
        logging = ["--log-level", log_level] if log_level else []
        transfer = [
            "--transfer-backend",
            str(transfer_backend),
            "--transfer-timeout",
            str(transfer_timeout),
        ]
        listen = f"ipc://{self.workdir}/transfer{suffix}.sock"
        nodes = [
            ("d", "decode", [*pool, *(decode_pool or [])], ["--transfer-listen", listen]),
            ("p", "prefill", pool, ["--transfer-peer", listen]),
        ]
        decode_scheduler = list(decode_scheduler)
        if migrate_to_pool is not None:
            listen2 = f"ipc://{self.workdir}/transfer-d2{suffix}.sock"
            nodes.insert(
                0, ("d2", "decode", [*pool, *migrate_to_pool], ["--transfer-listen", listen2])
            )
        up: dict[str, Service] = {}
        for node, role, node_pool, extra in nodes:
            mem_starting = self.spawn(
                "memsvc",
                *pool_layout_args(checkpoint, node_pool),
                *node_pool,
                "--pd-role",
                role,
                *transfer,
                *extra,
                *logging,
                name=f"memsvc-{node}{suffix}",
            )
            model_starting = self.spawn_model(
                mem_starting, checkpoint, len(nodes), model, logging, f"-{node}{suffix}"
            )
            up[f"memsvc-{node}"] = self.await_started(mem_starting)
            up[f"model_svc-{node}"] = self.await_started(model_starting)
            node_scheduler = [*scheduler, *decode_scheduler] if node == "d" else list(scheduler)
            if node == "d" and "scheduler-d2" in up and migrate:
                node_scheduler += ["--migrate-to", up["scheduler-d2"].address]
            up[f"scheduler-{node}"] = self.start(
                "scheduler_svc",
                "--mode",
                role,
                "--memsvc",
                up[f"memsvc-{node}"].address,
                "--worker",
                up[f"model_svc-{node}"].address,
                *node_scheduler,
                *logging,
                name=f"scheduler-{node}{suffix}",
            )
        up["router"] = self.start(
            "scheduler_svc.pd.router",
            "--prefill",
            up["scheduler-p"].address,
            "--decode",
            up["scheduler-d"].address,
            *router,
            *logging,
            name=f"router{suffix}",
        )
        return up

    def stop_all(self) -> None:
        """Stop every service, last started first; each one even if stopping another raised."""
        services, self.services = self.services, []
        starting, self.starting = self.starting, []
        with contextlib.ExitStack() as stack:
            for spawned in starting:  # a start given up: nothing to stop cleanly
                stack.callback(spawned.kill)
            for service in services:  # unwound last first
                stack.callback(self._stop, service)

    def _stop(self, service: Service) -> None:
        service.stop(timeout=self.stop_timeout)
        self.leaked_segments += service.leaked_segments

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
