"""``kvstack up --nodes N``: a whole cluster on one machine, as one supervised process list.

In start order:

- ``mooncake-master``: the Mooncake Store master (``mooncake_master`` from the
  ``cluster`` extra) on a free loopback port, the nodes' shared KV tier;
- per node ``nodeI``: its memsvc (hierarchical cache on, ``--hicache-storage-backend
  mooncake`` with the master's address in ``--hicache-storage-backend-extra-config``,
  metrics on a free port), model_svc and scheduler_svc, wired as a normal-mode stack
  in ``RUN_DIR/nodeI/`` (:func:`kvstack.stack.spec.normal_stack`), and its HTTP front
  (``kvstack serve --scheduler``) on a free loopback port, SGLang's API; a
  ``--kv-events-config`` given is node I's, its endpoints' ports offset by I
  (:func:`per_node_events`);
- ``smg``: SGLang's router, SMG (the ``smg`` package), unmodified, over the nodes'
  HTTP fronts (``smg launch --worker-urls ...``), on ``--port``, its Prometheus
  exporter on a free port.

SMG and the master write no ready file: :mod:`kvstack.up.external` runs them and
writes one once they answer. Every port is fixed when the list is built, so a
restarted process comes back where SMG and the other services look for it.

PD mode (``--prefill-nodes P --decode-nodes D``): ``prefillI`` and ``decodeI``
nodes instead, each a PD node as ``kvstack serve --mode prefill|decode`` runs one
(memsvc ``--pd-role``, the decode memsvc listening for KV on
``RUN_DIR/decodeI/transfer.sock``, which its front names with
``--transfer-listen``; scheduler_svc ``--mode``), the shared tier on the prefill
nodes, and SMG with ``--pd-disaggregation``: each prefill front with its HTTP
port as its bootstrap port (docs/cluster.md).
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


@dataclass(frozen=True)
class ClusterOptions:
    """The cluster's shape and SMG's settings (the nodes' services take :class:`StackOptions`)."""

    nodes: int = 0  # normal-mode nodes
    prefill_nodes: int = 0  # PD mode: prefill and decode nodes instead
    decode_nodes: int = 0
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


def per_node_events(memsvc_args: list[str], index: int) -> list[str]:
    """``memsvc_args`` with node ``index``'s ``--kv-events-config``: its endpoints offset
    by ``index`` as SGLang offsets them per DP rank (node 0 keeps them), so that every
    node can bind its own publisher."""
    from memsvc.kv_events import kv_events_config_for_node

    out = list(memsvc_args)
    for i, arg in enumerate(out):
        if arg == "--kv-events-config" and i + 1 < len(out):
            out[i + 1] = kv_events_config_for_node(out[i + 1], index)
        elif arg.startswith("--kv-events-config="):
            text = arg.split("=", 1)[1]
            out[i] = f"--kv-events-config={kv_events_config_for_node(text, index)}"
    return out


def node_specs(
    run_dir: Path,
    name: str,
    index: int,
    options: StackOptions,
    cluster: ClusterOptions,
    tier: list[str],
    role: str = "normal",
) -> list[ProcessSpec]:
    """One node in ``RUN_DIR/NAME/`` and its HTTP front, named ``NAME/...``: a normal-mode
    node, or (``role`` prefill / decode) a PD node for SMG's ``--pd-disaggregation``."""
    node_dir = make_private_dirs(run_dir / name)
    metrics = free_port()
    memsvc_args = [*tier, "--metrics-port", str(metrics), "--metrics-host", LOOPBACK]
    scheduler_args: list[str] = []
    front_args: list[str] = []
    transfer_sock: tuple[Path, ...] = ()
    if role != "normal":
        memsvc_args += ["--pd-role", role, "--transfer-backend", str(options.transfer_backend)]
        if options.transfer_timeout is not None:
            memsvc_args += ["--transfer-timeout", str(options.transfer_timeout)]
        scheduler_args = ["--mode", role]
        front_args = ["--mode", role]
    if role == "decode":
        transfer_sock = (node_dir / "transfer.sock",)
        listen = f"ipc://{transfer_sock[0]}"
        memsvc_args += ["--transfer-listen", listen]
        front_args += ["--transfer-listen", listen]
    node = replace(
        options,
        memsvc_args=[*memsvc_args, *per_node_events(options.memsvc_args, index)],
        scheduler_args=[*options.scheduler_args, *scheduler_args],
    )
    services = normal_stack(node_dir, node)
    services[0] = replace(services[0], extra_files=(*services[0].extra_files, *transfer_sock))
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
        *front_args,
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
    return [replace(spec, name=f"{name}/{spec.name}") for spec in (*services, http)]


def smg_spec(run_dir: Path, cluster: ClusterOptions, workers: list[str]) -> ProcessSpec:
    """SMG over ``workers``: ``--worker-urls`` those of a normal-mode cluster; in PD mode
    ``--pd-disaggregation``, each prefill front with its HTTP port as its bootstrap port
    (kvstack's decode front registers there, docs/cluster.md), then the decode fronts."""
    port = cluster.port or free_port()
    if cluster.prefill_nodes:
        prefill, decode = workers[: cluster.prefill_nodes], workers[cluster.prefill_nodes :]
        route = ["--pd-disaggregation"]
        for url in prefill:
            route += ["--prefill", url, url.rsplit(":", 1)[1]]
        for url in decode:
            route += ["--decode", url]
    else:
        route = ["--worker-urls", *workers]
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
        *route,
        "--policy",
        cluster.policy,
        "--health-check-interval-secs",
        str(SMG_HEALTH_INTERVAL_S),
        *cluster.smg_args,
    ]
    address = f"http://{LOOPBACK}:{port}"
    return external_spec(run_dir, "smg", "smg", address, f"{address}/health", command)


def check_shape(cluster: ClusterOptions) -> bool:
    """Refuse a cluster of no node, or one that mixes the modes; True: a PD cluster."""
    pd = bool(cluster.prefill_nodes or cluster.decode_nodes)
    if pd and (cluster.nodes or cluster.prefill_nodes < 1 or cluster.decode_nodes < 1):
        raise StackUnavailableError(
            "PD mode needs --prefill-nodes P and --decode-nodes D, each at least 1, and no --nodes"
        )
    if not pd and cluster.nodes < 1:
        raise StackUnavailableError(f"--nodes must be at least 1 (got {cluster.nodes})")
    return pd


def cluster_stack(
    run_dir: Path, options: StackOptions, cluster: ClusterOptions
) -> list[ProcessSpec]:
    """The master, the nodes and SMG, in start order (stopped in the reverse order)."""
    pd = check_shape(cluster)
    if options.curve is not None:
        raise StackUnavailableError(
            "--curve-dir with --nodes: SMG and the Mooncake master speak no CURVE; "
            "run a cluster without it (every port is on loopback)"
        )
    master = master_spec(run_dir)
    tier = shared_tier_args(master)
    if pd:  # the shared tier on the prefill nodes, which compute the prompts' KV
        roles = [(f"prefill{i}", "prefill", tier) for i in range(cluster.prefill_nodes)]
        roles += [(f"decode{i}", "decode", []) for i in range(cluster.decode_nodes)]
    else:
        roles = [(f"node{i}", "normal", tier) for i in range(cluster.nodes)]
    nodes = [
        node_specs(run_dir, name, i, options, cluster, t, role)
        for i, (name, role, t) in enumerate(roles)
    ]
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
