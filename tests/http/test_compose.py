"""docker/compose.yaml against the code, without Docker.

Every service whose command is a kvstack entry point must run: its ``--help``
exits 0 in this venv and lists every flag the command uses, and its parser
accepts the command's values. Every address a service connects to must be one
another service listens on (same port, running in the same profiles, started
first), memsvc and model_svc must share /dev/shm (or, on a GPU, the host's IPC
namespace), and every kvstack service needs a healthcheck and a restart policy.
Both the CPU file and the GPU variant (compose.gpu.yaml over it) are checked.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from memsvc.core import PoolLayout
from tests.procs import REPO

DOCKER = REPO / "docker"
KVSTACK_PACKAGES = ("memsvc", "model_svc", "scheduler_svc")
CONSOLE_SCRIPTS = {"memsvc", "model_svc", "scheduler_svc"}
LOCAL_HOSTS = {"0.0.0.0", "127.0.0.1", "localhost", "*", "::"}
ADDRESS = re.compile(r"^(tcp|http)://([\w.*-]+):(\d+)(/.*)?$")
SIZE_UNITS = {"b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20}
SIZE_UNITS |= {"g": 1 << 30, "gb": 1 << 30}


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((DOCKER / name).read_text())


def variants() -> dict[str, dict[str, dict[str, Any]]]:
    """The services of the CPU file, and of the GPU override merged over it."""
    base = load("compose.yaml")["services"]
    override = load("compose.gpu.yaml")["services"]
    assert set(override) <= set(base), "the GPU file overrides services the base lacks"
    gpu = {  # the cluster profile is CPU only: the GPU file overrides none of it
        name: {**spec, **override.get(name, {})}
        for name, spec in base.items()
        if "cluster" not in spec.get("profiles", [])
    }
    return {"cpu": base, "gpu": gpu}


VARIANTS = variants()


def entry_point(command: Any) -> tuple[tuple[str, ...], list[str]] | None:
    """(how to run it here, its arguments) for a kvstack command; None for anything else."""
    if not isinstance(command, list) or not command:
        return None
    if command[0] in ("python", "python3") and command[1:2] == ["-m"]:
        module, rest = command[2], command[3:]
        if module.split(".")[0] not in KVSTACK_PACKAGES:
            return None
        if module == "kvstack.cli":
            return (module, rest[0]), rest[1:]
        return (module,), rest
    if command[0] == "kvstack":
        return ("kvstack.cli", command[1]), command[2:]
    if command[0] in CONSOLE_SCRIPTS:
        return (command[0],), command[1:]
    return None


def kind(spec: dict[str, Any]) -> str | None:
    """Which entry point a service runs: "memsvc", "model_svc", "serve"...; None: not ours."""
    entry = entry_point(spec.get("command"))
    return entry[0][-1] if entry else None


def kvstack_services(variant: str) -> list[str]:
    return [n for n, s in VARIANTS[variant].items() if entry_point(s.get("command"))]


CASES = [(v, name) for v in VARIANTS for name in kvstack_services(v)]


@functools.cache
def run_help(entry: tuple[str, ...]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *entry, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )


def flags(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def option(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (the last one), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
    return value


def options(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def parse_error(entry: tuple[str, ...], args: list[str]) -> str | None:
    """What the entry point's own argparse says about ``args`` (None: accepted).

    Only for entry points with a ``build_parser``; the others are covered by ``--help``.
    """
    module = importlib.import_module(entry[0] if "." in entry[0] else f"{entry[0]}.__main__")
    build = getattr(module, "build_parser", None)
    if build is None:
        return None
    argv = [*entry[1:], *args]
    parser = build(argv) if entry[0] == "kvstack.cli" else build()
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            parser.parse_args(argv)
        except SystemExit:
            return stderr.getvalue().strip() or "rejected"
    return None


@pytest.mark.parametrize(("variant", "service"), CASES, ids=[f"{v}:{s}" for v, s in CASES])
def test_command_runs_here(variant: str, service: str) -> None:
    """--help exits 0 and names every flag; the parser takes the command's values."""
    command = VARIANTS[variant][service]["command"]
    # compose's schema: an exec-form command is a list of strings (quote the numbers)
    assert all(isinstance(c, str) for c in command), f"{service}: non-string items in {command}"
    entry, args = entry_point(command)
    shown = run_help(entry)
    if shown.returncode != 0:
        pytest.fail(f"{service}: `python -m {' '.join(entry)} --help` failed:\n{shown.stderr}")
    problems = []
    missing = [
        f for f in flags(args) if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", shown.stdout)
    ]
    if missing:
        problems.append(f"not in `{' '.join(entry)} --help`: {missing}")
    error = parse_error(entry, args)
    if error is not None:
        problems.append(f"its parser says: {error.splitlines()[-1]}")
    assert not problems, f"{service}: " + "; ".join(problems)


def served(spec: dict[str, Any]) -> dict[str, set[int]]:
    """The ports a service listens on: ZMQ ("tcp") and HTTP ("http")."""
    entry = entry_point(spec.get("command"))
    if entry is None:
        return {"tcp": set(), "http": set()}
    args = entry[1]
    zmq_ports, http_ports = set(), set()
    for flag in ("--listen", "--transfer-listen"):
        match = ADDRESS.match(option(args, flag) or "")
        if match:
            zmq_ports.add(int(match.group(3)))
    for flag in ("--metrics-port", "--port"):
        if option(args, flag) is not None:
            http_ports.add(int(option(args, flag)))
    return {"tcp": zmq_ports, "http": http_ports}


def depends_on(spec: dict[str, Any]) -> set[str]:
    deps = spec.get("depends_on", [])
    return set(deps)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_address_meets_its_listener(variant: str) -> None:
    services = VARIANTS[variant]
    problems = []
    for name, spec in services.items():
        entry = entry_point(spec.get("command"))
        if entry is None:
            continue
        args = entry[1]
        listen = ADDRESS.match(option(args, "--listen") or "")
        remote = listen and listen.group(2) not in ("127.0.0.1", "localhost")
        if remote and "--allow-remote" not in args:
            problems.append(f"{name}: listens on {listen.group(0)} without --allow-remote")
        for arg in args:
            match = ADDRESS.match(arg)
            if not match or match.group(2) in LOCAL_HOSTS:
                continue
            scheme, host, port = match.group(1), match.group(2), int(match.group(3))
            target = services.get(host)
            if target is None:
                problems.append(f"{name}: {arg} names no service")
                continue
            if port not in served(target)[scheme]:
                problems.append(
                    f"{name}: {arg}, but {host} serves {scheme} on {sorted(served(target)[scheme])}"
                )
            if not set(spec.get("profiles", [])) <= set(target.get("profiles", [])):
                problems.append(f"{name}: {host} does not run in all of its profiles")
            if scheme == "tcp" and host not in depends_on(spec):
                problems.append(f"{name}: connects to {host} but does not depend on it")
        for mapping in spec.get("ports", []):
            container_port = int(str(mapping).rsplit(":", 1)[-1])
            if container_port not in served(spec)["http"]:
                problems.append(f"{name}: publishes {mapping}, but serves {served(spec)['http']}")
    assert not problems, "\n".join(problems)


def test_prometheus_scrapes_the_front_of_every_profile() -> None:
    services = VARIANTS["cpu"]
    config = load("prometheus.yml")
    targets = [
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    ]
    profiles = set()
    for target in targets:
        host, port = target.rsplit(":", 1)
        assert host in services, f"prometheus scrapes {target}: no such service"
        entry = entry_point(services[host].get("command"))
        assert entry is not None and entry[0] == ("kvstack.cli", "serve"), target
        assert option(entry[1], "--port") == port, target
        profiles |= set(services[host]["profiles"])
    assert profiles >= {"normal", "pd"}
    assert set(services["prometheus"]["profiles"]) >= {"normal", "pd"}
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]


def shm_bytes(size: str) -> int:
    match = re.fullmatch(r"(\d+)\s*([a-z]*)", str(size).lower())
    assert match, f"unreadable shm_size {size!r}"
    return int(match.group(1)) * SIZE_UNITS[match.group(2) or "b"]


def pool_bytes(args: list[str]) -> int:
    """The shared memory a memsvc command's pool takes (KV buffer + req_to_token table)."""
    defaults = {"--num-layers": 4, "--num-kv-heads": 2, "--head-dim": 64, "--page-size": 16}
    defaults |= {"--num-pages": 1024, "--max-running-requests": 256, "--max-context-len": 4096}
    values = {f: int(option(args, f) or d) for f, d in defaults.items()}
    layout = PoolLayout(
        num_layers=values["--num-layers"],
        num_kv_heads=values["--num-kv-heads"],
        head_dim=values["--head-dim"],
        page_size=values["--page-size"],
        num_pages=values["--num-pages"],
        dtype=option(args, "--dtype") or "float32",
        max_running_requests=values["--max-running-requests"],
        max_context_len=values["--max-context-len"],
    )
    table = (layout.max_running_requests + 1) * layout.max_context_len * 4
    return layout.kv_bytes + table


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_model_svc_shares_memory_with_its_memsvc(variant: str) -> None:
    services = VARIANTS[variant]
    workers = [n for n in kvstack_services(variant) if kind(services[n]) == "model_svc"]
    assert workers
    for name in workers:
        spec = services[name]
        memsvc = ADDRESS.match(option(entry_point(spec["command"])[1], "--memsvc")).group(2)
        owner = services[memsvc]
        if variant == "gpu":
            assert spec.get("ipc") == owner.get("ipc") == "host", name
            assert "devices" in str(spec.get("deploy")) and "devices" in str(owner.get("deploy"))
            continue
        assert spec.get("ipc") == f"service:{memsvc}", f"{name} must join {memsvc}'s IPC namespace"
        assert owner.get("ipc") == "shareable", f"{memsvc} must be ipc: shareable"
        need = pool_bytes(entry_point(owner["command"])[1])
        assert shm_bytes(owner.get("shm_size", "64m")) > need, (
            f"{memsvc}: shm_size {owner.get('shm_size')} under the pool's {need} bytes"
        )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kvstack_services_have_healthchecks_and_restart(variant: str) -> None:
    services = VARIANTS[variant]
    problems = []
    for name in kvstack_services(variant):
        spec = services[name]
        entry, args = entry_point(spec["command"])
        check = " ".join(spec.get("healthcheck", {}).get("test", []))
        if spec.get("restart") not in ("always", "unless-stopped", "on-failure"):
            problems.append(f"{name}: restart policy {spec.get('restart')!r}")
        ready = option(args, "--ready-file")
        if entry == ("kvstack.cli", "serve"):
            if f":{option(args, '--port')}/health" not in check:
                problems.append(f"{name}: healthcheck {check!r} does not ask /health")
        elif not ready or ready not in check:
            problems.append(f"{name}: healthcheck {check!r} does not look at --ready-file {ready}")
        for dep in depends_on(spec):
            if "healthcheck" not in services[dep]:
                problems.append(f"{name}: waits for {dep}, which has no healthcheck")
    for profile, wanted in {
        "normal": {"memsvc", "model_svc", "scheduler_svc", "serve"},
        "pd": {"memsvc", "model_svc", "scheduler_svc", "scheduler_svc.pd.router", "serve"},
        "cluster": {"memsvc", "model_svc", "scheduler_svc", "serve"},
    }.items():
        if profile == "cluster" and variant == "gpu":
            continue  # CPU only (variants())
        kinds = {kind(s) for s in services.values() if profile in s.get("profiles", [])}
        kinds.discard(None)
        if kinds != wanted:
            problems.append(f"profile {profile}: runs {sorted(kinds)}, wants {sorted(wanted)}")
    assert not problems, "\n".join(problems)


def test_dockerfiles_install_with_the_constraints() -> None:
    cpu = (DOCKER / "Dockerfile").read_text()
    gpu = (DOCKER / "Dockerfile.gpu").read_text()
    assert cpu.startswith("#") and "FROM python:3.11-slim" in cpu
    assert "https://download.pytorch.org/whl/cpu" in cpu
    assert re.search(r"FROM \$\{CUDA_IMAGE\}", gpu) and "nvidia/cuda:" in gpu
    for text in (cpu, gpu):
        installs = [line for line in text.splitlines() if "pip install" in line]
        assert installs and all("-c constraints.txt" in line for line in installs), installs
    assert "gpu]" in gpu  # the cupy-cuda12x extra
    assert Path(DOCKER / "prometheus.yml").is_file()


def test_dockerfiles_copy_every_package_the_project_installs() -> None:
    """An image without one of the packages would install a `kvstack` that cannot import."""
    import tomllib

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {pattern.rstrip("*") for pattern in include["packages"]["find"]["include"]}
    assert packages == {"kvstack", "scheduler_svc", "model_svc", "memsvc"}
    for name in ("Dockerfile", "Dockerfile.gpu"):
        copied = set(re.findall(r"^COPY (\w+) \./\1$", (DOCKER / name).read_text(), re.M))
        assert copied == packages, name


def test_cluster_profile_wires_smg_and_the_mooncake_master() -> None:
    """SMG routes to every node's front; every node's memsvc keeps its tier on the master,
    named by the bundled tiny model's digest (what the image's checkpoint hashes to)."""
    import json
    import tempfile

    from kvstack.model.digest import model_digest
    from model_svc.tiny import write_tiny_checkpoint

    services = VARIANTS["cpu"]
    cluster = {n: s for n, s in services.items() if "cluster" in s.get("profiles", [])}
    by_kind: dict[str, list[str]] = {}
    for name, spec in cluster.items():
        by_kind.setdefault(kind(spec) or spec["command"][0], []).append(name)
    assert len(by_kind["serve"]) >= 2 and by_kind["mooncake_master"] == ["mooncake-master"]
    master = cluster["mooncake-master"]
    rpc = next(a.split("=", 1)[1] for a in master["command"] if a.startswith("--rpc_port="))
    assert rpc in " ".join(master["healthcheck"]["test"])
    smg = cluster[by_kind["smg"][0]]["command"]
    assert smg[:2] == ["smg", "launch"]
    urls = smg[smg.index("--worker-urls") + 1 : smg.index("--policy")]
    fronts = {
        f"http://{name}:{option(entry_point(cluster[name]['command'])[1], '--port')}"
        for name in by_kind["serve"]
    }
    assert set(urls) == fronts
    assert set(cluster[by_kind["smg"][0]]["depends_on"]) == set(by_kind["serve"])
    with tempfile.TemporaryDirectory() as tmp:
        tiny = model_digest(write_tiny_checkpoint(Path(tmp) / "tiny"))
    for name in by_kind["memsvc"]:
        args = entry_point(cluster[name]["command"])[1]
        assert option(args, "--hicache-storage-backend") == "mooncake", name
        assert "--enable-hierarchical-cache" in args, name
        config = json.loads(option(args, "--hicache-storage-backend-extra-config"))
        assert config["master_server_address"] == f"mooncake-master:{rpc}", name
        assert config["local_hostname"] == name  # where the other nodes reach its segment
        assert option(args, "--model-digest") == tiny, name
        assert "mooncake-master" in depends_on(cluster[name]), name
