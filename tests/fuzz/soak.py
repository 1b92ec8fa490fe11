"""``python -m tests.fuzz.soak --messages N [--seed S] [--sockets memsvc,scheduler,...]``.

Sockets: memsvc, scheduler, http, model_svc, transfer, router (all by default). Starts each
socket's service in a temporary folder, sends it N seeded fuzz messages
(:mod:`tests.fuzz.runner`), and prints one JSON object per socket,
then a total: messages, crashes, hangs, inconsistencies (and internal errors,
reply codes, the first findings). Exits non-zero if any figure but
``messages`` is not 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvstack.stack.launch import Launcher
from tests.fuzz.http_target import HttpTarget
from tests.fuzz.model_target import ModelTarget
from tests.fuzz.runner import Figures, fuzz
from tests.fuzz.targets import MemsvcTarget, RouterTarget, SchedulerTarget
from tests.fuzz.transfer_target import TransferTarget


def _memsvc(launcher: Launcher, workdir: Path) -> MemsvcTarget:
    return MemsvcTarget(launcher)


def _scheduler(launcher: Launcher, workdir: Path) -> SchedulerTarget:
    from model_svc.tiny import write_tiny_checkpoint  # imports torch: only when used

    return SchedulerTarget(launcher, write_tiny_checkpoint(workdir / "ckpt"))


def _http(launcher: Launcher, workdir: Path) -> HttpTarget:
    from model_svc.tiny import write_tiny_checkpoint

    return HttpTarget(launcher, write_tiny_checkpoint(workdir / "ckpt"))


def _model(launcher: Launcher, workdir: Path) -> ModelTarget:
    from model_svc.tiny import write_tiny_checkpoint

    return ModelTarget(launcher, write_tiny_checkpoint(workdir / "ckpt"))


def _router(launcher: Launcher, workdir: Path) -> RouterTarget:
    from model_svc.tiny import write_tiny_checkpoint

    return RouterTarget(launcher, write_tiny_checkpoint(workdir / "ckpt"))


def _transfer(launcher: Launcher, workdir: Path) -> TransferTarget:
    return TransferTarget(launcher)


SOCKETS: dict[str, Callable] = {
    "memsvc": _memsvc,
    "scheduler": _scheduler,
    "http": _http,
    "model_svc": _model,
    "transfer": _transfer,
    "router": _router,
}


def soak(socket: str, num_messages: int, seed: int, batch: int) -> Figures:
    with tempfile.TemporaryDirectory(prefix="kvstack-fuzz-") as tmp, Launcher(tmp) as launcher:
        target = SOCKETS[socket](launcher, Path(tmp))
        try:
            figures = fuzz(target, num_messages, seed, batch=batch)
        finally:
            target.close()
    if launcher.leaked_segments:
        figures.findings.append(f"shm segments left: {launcher.leaked_segments}")
        figures.inconsistencies += 1
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.soak", description=__doc__)
    parser.add_argument("--messages", type=int, default=10_000, help="messages per socket")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=200, help="messages between checks")
    parser.add_argument("--sockets", default=",".join(SOCKETS), help="comma-separated")
    args = parser.parse_args(argv)
    sockets = args.sockets.split(",")
    unknown = set(sockets) - set(SOCKETS)
    if unknown:
        parser.error(f"unknown sockets {sorted(unknown)}; choose from {sorted(SOCKETS)}")
    total = Figures("total")
    for socket in sockets:
        figures = soak(socket, args.messages, args.seed, args.batch)
        print(json.dumps(figures.as_json()), flush=True)
        for name in ("messages", "crashes", "hangs", "inconsistencies", "internal_errors"):
            setattr(total, name, getattr(total, name) + getattr(figures, name))
        total.seconds += figures.seconds
    summary = total.as_json()
    del summary["codes"], summary["findings"]
    print(json.dumps(summary), flush=True)
    return 0 if total.clean else 1


if __name__ == "__main__":
    sys.exit(main())
