"""The services' tuning flags, as ``kvstack serve`` and ``kvstack up`` take and forward them.

Nothing is declared here: each flag is a field of its service's config
(:class:`MemsvcConfig`, :class:`SchedulerServiceConfig`, :class:`RouterConfig`)
marked ``forward``, with its name, help, choices and default
(:mod:`memsvc.settings`). A flag is forwarded only when the user set it (on
the command line or in ``--config``), so each service keeps its own default.
``--help`` shows them in argparse groups, one per concern (:data:`GROUPS`).

The PD transfer flags (``--transfer-backend``, ``--transfer-timeout``) are
memsvc's too, but go to it only in PD mode and through the launcher, which
wires the transfer socket (:func:`transfer_options`).
"""

from __future__ import annotations

import argparse
from typing import Any

from memsvc import config as memsvc_config
from memsvc.config import MemsvcConfig
from memsvc.settings import Flag, flags, group_of, to_argv
from scheduler_svc.config import FAULTS, SchedulerServiceConfig
from scheduler_svc.pd.router import RouterConfig

MEMSVC = "memsvc"
SCHEDULER = "scheduler"
ROUTER = "router"
CONFIGS: dict[str, type] = {
    MEMSVC: MemsvcConfig,
    SCHEDULER: SchedulerServiceConfig,
    ROUTER: RouterConfig,
}
SERVICE_NAMES = {MEMSVC: "memsvc", SCHEDULER: "scheduler_svc", ROUTER: "the PD router"}
TRANSFER = ("transfer_backend", "transfer_timeout")  # memsvc's, through the PD launchers

PD_GROUP = "PD disaggregation (--mode pd)"
# (service, the group of its own --help) -> the group in serve's and up's --help
GROUPS: dict[tuple[str, str | None], str] = {
    (MEMSVC, memsvc_config.POOL): "KV pool and host store (memsvc)",
    (MEMSVC, memsvc_config.MEMORY): "KV pool and host store (memsvc)",
    (MEMSVC, memsvc_config.HICACHE): "hierarchical cache (memsvc)",
    (MEMSVC, memsvc_config.PD): PD_GROUP,
    (MEMSVC, memsvc_config.EVENTS): "KV cache events (memsvc)",
    (SCHEDULER, None): "scheduling and retract (scheduler_svc)",
    (SCHEDULER, FAULTS): "fault tolerance (scheduler_svc)",
    (ROUTER, None): PD_GROUP,
}


def forwarded(service: str) -> list[Flag]:
    """The flags of ``service`` that ``serve`` and ``up`` take."""
    return [flag for flag in flags(CONFIGS[service]) if flag.forward]


def add_service_flags(parser: argparse.ArgumentParser) -> None:
    """Every forwarded flag of every service, in :data:`GROUPS`; unset, none is in the
    namespace (``SUPPRESS``), and ``--help`` says whose default applies."""
    groups: dict[str, Any] = {}
    for service in CONFIGS:
        for flag in forwarded(service):
            help = flag.help
            if "default" not in help:
                help = f"{help} (default: {SERVICE_NAMES[service]}'s own)"
            group = group_of(parser, groups, GROUPS[service, flag.group])
            flag.add_to(group, default=argparse.SUPPRESS, help=help)


def given(args: argparse.Namespace, service: str) -> dict[str, Any]:
    """The forwarded flags of ``service`` the user set, by ``dest``."""
    return {flag.dest: getattr(args, flag.dest) for flag in forwarded(service) if flag.dest in args}


def service_argv(args: argparse.Namespace, service: str) -> list[str]:
    """The flags of ``service`` the user set, as that service takes them (the PD transfer
    flags aside: :func:`transfer_options`)."""
    values = {k: v for k, v in given(args, service).items() if k not in TRANSFER}
    return to_argv(CONFIGS[service], values)


def transfer_options(args: argparse.Namespace) -> dict[str, Any]:
    """``transfer_backend`` / ``transfer_timeout`` the user set (for the PD launchers)."""
    return {name: getattr(args, name) for name in TRANSFER if name in args}
