"""Health checks of the stack's processes: one round trip each, a reason when unhealthy.

Each takes the stack's client keys (``curve``) when its sockets have CURVE on.
"""

from __future__ import annotations

from collections.abc import Callable

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


HealthCheck = Callable[[str, float, CurveClientKeys | None], str]
HEALTH_CHECKS: dict[str, HealthCheck] = {
    "memsvc": ping_memsvc,
    "model_svc": ping_model,
    "scheduler_svc": ping_scheduler,
    "router": ping_router,
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
