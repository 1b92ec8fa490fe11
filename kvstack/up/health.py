"""Health checks of the stack's processes: one round trip each, a reason when unhealthy.

Each takes the stack's client keys (``curve``) when its sockets have CURVE on. A
cluster's (``kvstack up --nodes``) HTTP fronts, SMG and Mooncake master are pinged
over HTTP and TCP (none of them speaks CURVE).
"""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Callable
from urllib.parse import urlsplit

from memsvc.curve import CurveClientKeys


def ping_memsvc(address: str, timeout_s: float, curve: CurveClientKeys | None) -> str:
    """hello + heartbeat + goodbye: memsvc serves sessions."""
    from memsvc.client import MemClient

    with MemClient(
        address,
        role="worker",
        name="kvstack-health",
        heartbeat=False,
        timeout_s=timeout_s,
        retries=0,
        curve=curve,
    ) as mem:
        mem.heartbeat()
        return f"epoch {mem.epoch}"


def ping_model(address: str, timeout_s: float, curve: CurveClientKeys | None) -> str:
    from model_svc.client import ModelClient

    with ModelClient(address, timeout_s=timeout_s, retries=0, curve=curve) as model:
        return f"pool epoch {model.info()['pool_epoch']}"


def ping_scheduler(address: str, timeout_s: float, curve: CurveClientKeys | None) -> str:
    from scheduler_svc.client import GenerateClient

    with GenerateClient(address, timeout_s=timeout_s, resubmits=0, curve=curve) as client:
        info = client.info()
    return f"running {info['num_running']}, waiting {info['num_waiting']}"


def ping_router(address: str, timeout_s: float, curve: CurveClientKeys | None) -> str:
    """The router's ``info``: it answers only with the decode node's (and says the prefill's)."""
    from scheduler_svc.client import GenerateClient

    with GenerateClient(address, timeout_s=timeout_s, resubmits=0, curve=curve) as client:
        info = client.info()
    if not info.get("ok"):
        raise RuntimeError(f"{info.get('code')}: {info.get('message')}")
    prefill = "answers" if info.get("prefill") else "SILENT"
    flights = (info.get("router") or {}).get("flights", 0)
    return f"decode running {info['num_running']}, prefill {prefill}, in flight {flights}"


def ping_http(address: str, timeout_s: float, curve: CurveClientKeys | None) -> str:
    """A node's HTTP front: ``GET /health`` is 200 (its scheduler answers)."""
    with urllib.request.urlopen(f"{address}/health", timeout=timeout_s) as response:
        return f"/health {response.status}"


def ping_smg(address: str, timeout_s: float, curve: CurveClientKeys | None) -> str:
    """SGLang's router: ``GET /workers``; healthy while it has a worker to route to."""
    with urllib.request.urlopen(f"{address}/workers", timeout=timeout_s) as response:
        workers = json.load(response)["workers"]
    ready = [w for w in workers if w.get("is_healthy") and w.get("status") == "ready"]
    if not ready:
        raise RuntimeError(f"no worker ready (0/{len(workers)})")
    return f"workers ready {len(ready)}/{len(workers)}"


def ping_tcp(address: str, timeout_s: float, curve: CurveClientKeys | None) -> str:
    """The Mooncake master: its RPC port accepts a connection."""
    parts = urlsplit(address)
    socket.create_connection((parts.hostname, parts.port), timeout_s).close()
    return "accepts connections"


HealthCheck = Callable[[str, float, CurveClientKeys | None], str]
HEALTH_CHECKS: dict[str, HealthCheck] = {
    "memsvc": ping_memsvc,
    "model_svc": ping_model,
    "scheduler_svc": ping_scheduler,
    "router": ping_router,
    "http": ping_http,
    "smg": ping_smg,
    "mooncake_master": ping_tcp,
}


def check(
    kind: str, address: str, timeout_s: float, curve: CurveClientKeys | None = None
) -> tuple[bool, str]:
    """(healthy, detail) of one process; never raises."""
    ping = HEALTH_CHECKS.get(kind)
    if ping is None:
        return True, "no health check"
    try:
        return True, ping(address, timeout_s, curve)
    except Exception as exc:  # any failure to answer is "unhealthy", with its reason
        return False, f"{type(exc).__name__}: {exc}"
