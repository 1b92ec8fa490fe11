"""``kvstack up --nodes N``: a whole cluster on one machine, as one supervised process list.

In start order:

- ``mooncake-master``: the Mooncake Store master (``mooncake_master`` from the
  ``cluster`` extra) on a free loopback port, the nodes' shared KV tier;
- per node ``nodeI``: its memsvc (hierarchical cache on, ``--hicache-storage-backend
  mooncake`` with the master's address in ``--hicache-storage-backend-extra-config``,
  metrics on a free port), model_svc and scheduler_svc, wired as a normal-mode stack
  in ``RUN_DIR/nodeI/`` (:func:`kvstack.stack.spec.normal_stack`), and its HTTP front
  (``kvstack serve --scheduler``) on a free loopback port, SGLang's API;
- ``smg``: SGLang's router, SMG (the ``smg`` package), unmodified, over the nodes'
  HTTP fronts (``smg launch --worker-urls ...``), on ``--port``, its Prometheus
  exporter on a free port.

SMG and the master write no ready file: :mod:`kvstack.up.external` runs them and
writes one once they answer. Every port is fixed when the list is built, so a
restarted process comes back where SMG and the other services look for it.

PD mode (``--prefill-nodes`` / ``--decode-nodes``) is refused: kvstack's nodes do
not pair a transfer by SMG's ``bootstrap_room`` yet (docs/cluster.md).
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from kvstack.stack.spec import ProcessSpec, StackOptions, StackUnavailableError, normal_stack
from memsvc.cli import make_private_dirs

LOOPBACK = "127.0.0.1"
SMG_HEALTH_INTERVAL_S = 5  # SMG's default, 60 s, would keep a restarted node out a minute
PD_MISSING = (
    "PD mode under SMG (--prefill-nodes / --decode-nodes) is not available yet: kvstack's "
    "nodes do not pair a KV transfer by SMG's bootstrap_host/bootstrap_port/bootstrap_room "
    "(a prefill-role and a decode-role `kvstack serve`, memsvc sending to the decode memsvc "
    "a request names; docs/cluster.md). Use --nodes N (normal mode), or `kvstack up --mode "
    "pd` (one prefill and one decode node behind kvstack's own router)"
)


@dataclass(frozen=True)
class ClusterOptions:
    """The cluster's shape and SMG's settings (the nodes' services take :class:`StackOptions`)."""

    nodes: int
    port: int = 30000  # SMG's; 0: a free one
    policy: str = "cache_aware"
    smg_args: tuple[str, ...] = ()
    served_model_name: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def program(name: str, where: Path | None = None) -> str:
    """An executable of the ``cluster`` extra: beside this Python, else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name) or (str(where) if where is not None and where.exists() else None)
    if found is None:
        raise StackUnavailableError(
            f"{name} is not installed: `kvstack up --nodes` needs the cluster extra "
            "(pip install 'kvstack[cluster]': smg, mooncake-transfer-engine-non-cuda)"
        )
    return found


def mooncake_master_binary() -> str:
    try:
        import mooncake
    except ImportError:
        return program("mooncake_master")
    return program("mooncake_master", Path(mooncake.__file__).parent / "mooncake_master")


def external_spec(
    run_dir: Path, name: str, kind: str, address: str, wait: str, command: list[str]
) -> ProcessSpec:
    """A program that is not kvstack's, run by :mod:`kvstack.up.external`."""
    ready = run_dir / f"{name}.ready"
    wrapper = (sys.executable, "-m", "kvstack.up.external", "--ready-file", str(ready))
    wrapper += ("--address", address, "--wait", wait, "--")
    return ProcessSpec(name, kind, (*wrapper, *command), address, ready, run_dir / f"{name}.log")


def master_spec(run_dir: Path) -> ProcessSpec:
    rpc, metrics = free_port(), free_port()
    command = [
        mooncake_master_binary(),
        f"--rpc_port={rpc}",
        f"--rpc_address={LOOPBACK}",
        f"--metrics_port={metrics}",
        f"--metrics_host={LOOPBACK}",
    ]
    address = f"tcp://{LOOPBACK}:{rpc}"
    return external_spec(run_dir, "mooncake-master", "mooncake_master", address, address, command)


def shared_tier_args(master: ProcessSpec) -> list[str]:
    """memsvc's hierarchical cache on the master's shared tier (SGLang's config keys)."""
    config = {
        "master_server_address": master.address.removeprefix("tcp://"),
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "local_hostname": LOOPBACK,
    }
    return [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "mooncake",
        "--hicache-storage-backend-extra-config",
        json.dumps(config),
    ]


def node_specs(
    run_dir: Path, index: int, options: StackOptions, cluster: ClusterOptions, tier: list[str]
) -> list[ProcessSpec]:
    """One normal-mode node in ``RUN_DIR/nodeI/`` and its HTTP front, named ``nodeI/...``."""
    node_dir = make_private_dirs(run_dir / f"node{index}")
    metrics = free_port()
    memsvc_args = [*tier, "--metrics-port", str(metrics), "--metrics-host", LOOPBACK]
    node = replace(options, memsvc_args=[*memsvc_args, *options.memsvc_args])
    services = normal_stack(node_dir, node)
    scheduler = services[-1]
    port = free_port()
    ready = node_dir / "http.ready"
    front = [
        sys.executable,
        "-m",
        "kvstack.cli",
        "serve",
        "--scheduler",
        scheduler.address,
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--ready-file",
        str(ready),
        "--metrics-url",
        f"memsvc=http://{LOOPBACK}:{metrics}/metrics",
    ]
    if options.checkpoint:
        front += ["--checkpoint", options.checkpoint]
    if cluster.served_model_name:
        front += ["--served-model-name", cluster.served_model_name]
    if options.log_level:
        front += ["--log-level", options.log_level]
    http = ProcessSpec(
        "http", "http", tuple(front), f"http://{LOOPBACK}:{port}", ready, node_dir / "http.log"
    )
    return [replace(spec, name=f"node{index}/{spec.name}") for spec in (*services, http)]


def smg_spec(run_dir: Path, cluster: ClusterOptions, workers: list[str]) -> ProcessSpec:
    port = cluster.port or free_port()
    command = [
        program("smg"),
        "launch",
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--prometheus-host",
        LOOPBACK,
        "--prometheus-port",
        str(free_port()),
        "--worker-urls",
        *workers,
        "--policy",
        cluster.policy,
        "--health-check-interval-secs",
        str(SMG_HEALTH_INTERVAL_S),
        *cluster.smg_args,
    ]
    address = f"http://{LOOPBACK}:{port}"
    return external_spec(run_dir, "smg", "smg", address, f"{address}/health", command)


def cluster_stack(
    run_dir: Path, options: StackOptions, cluster: ClusterOptions
) -> list[ProcessSpec]:
    """The master, the nodes and SMG, in start order (stopped in the reverse order)."""
    if cluster.nodes < 1:
        raise StackUnavailableError(f"--nodes must be at least 1 (got {cluster.nodes})")
    if options.curve is not None:
        raise StackUnavailableError(
            "--curve-dir with --nodes: SMG and the Mooncake master speak no CURVE; "
            "run a cluster without it (every port is on loopback)"
        )
    master = master_spec(run_dir)
    tier = shared_tier_args(master)
    nodes = [node_specs(run_dir, i, options, cluster, tier) for i in range(cluster.nodes)]
    fronts = [node[-1].address for node in nodes]
    smg = smg_spec(run_dir, cluster, fronts)
    return [master, *(spec for node in nodes for spec in node), smg]


def workers_ready(address: str, timeout_s: float = 2.0) -> tuple[int, int]:
    """(ready, registered) workers SMG at ``address`` reports; (0, 0) if it does not answer."""
    try:
        with urllib.request.urlopen(f"{address}/workers", timeout=timeout_s) as response:
            workers = json.load(response)["workers"]
    except (OSError, ValueError, KeyError):
        return 0, 0
    ready = [w for w in workers if w.get("is_healthy") and w.get("status") == "ready"]
    return len(ready), len(workers)
