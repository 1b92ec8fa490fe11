"""``kvstack up --nodes 2``: two tiny nodes, the Mooncake master and SMG under one supervisor.

One cluster serves the module's tests, in order (``make test`` keeps a file's
tests on one worker): ``kvstack status`` lists every process healthy; a request
through SMG completes; a node's scheduler SIGKILLed, then another node's HTTP
front, are restarted while requests keep completing through SMG, token for
token; each node's pool ends whole; a PD cluster (``--prefill-nodes 1
--decode-nodes 1``, SMG with ``--pd-disaggregation``) answers as the normal one;
SIGTERM leaves no process (SMG and the master included) and no shared-memory
segment. The cluster is always reaped, whatever
happens (:class:`~tests.supervisor.test_supervisor.UpProcess`).

Needs the ``cluster`` extra (``smg``, ``mooncake-transfer-engine-non-cuda``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstack.up.cli import pid_alive
from kvstack.up.cluster import workers_ready
from memsvc.core.backends.shm import list_segments, segment_owner_pid
from tests.mooncake_master import require_mooncake
from tests.procs import wait_for
from tests.smg import smg_binary
from tests.supervisor.test_supervisor import POOL, UpProcess, kvstack

pytestmark = pytest.mark.timeout(600)

NODES = 2
CAPACITY = 256  # POOL: 64 pages of 4 tokens
NAMES = ["mooncake-master"]
NAMES += [
    f"node{i}/{s}" for i in range(NODES) for s in ("memsvc", "model_svc", "scheduler_svc", "http")
]
NAMES += ["smg"]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [f"Prompt {i}: kvstack nodes behind SGLang's router. " * 3 for i in range(4)]


def post(url: str, text: str, timeout: float = 60) -> dict:
    body = json.dumps({"text": text, "sampling_params": GREEDY}).encode()
    request = urllib.request.Request(f"{url}/generate", body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        assert response.status == 200
        return json.load(response)


def memsvc_tokens(front: str) -> dict[str, float]:
    """The node's memsvc_tokens gauge by state, through its front's merged /metrics."""
    with urllib.request.urlopen(f"{front}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        s.labels["state"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "memsvc_tokens"
        for s in f.samples
    }


def status_of(cluster: UpProcess, *args: str):
    """``kvstack status``, with room for a loaded machine (it pings ten processes)."""
    run_dir = str(cluster.run_dir)
    return kvstack("status", "--run-dir", run_dir, "--timeout", "10", *args, timeout=300)


class Cluster(UpProcess):
    def procs(self) -> dict[str, dict]:
        return {p["name"]: p for p in self.state()["processes"]}

    def url(self) -> str:
        return self.procs()["smg"]["address"]

    def every_pid(self) -> set[int]:
        """Every process it started: the supervised ones, and SMG's and the master's own
        (their wrapper's children)."""
        self.state()
        children = {p["ready"].get("child_pid") for p in self.procs().values()}
        return self.pids | {pid for pid in children if pid}

    def restarted(self, name: str, restarts: int) -> dict | None:
        state = self.healthy()
        if state and {p["name"]: p["restarts"] for p in state["processes"]}[name] == restarts:
            return state
        return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    smg_binary()
    require_mooncake()
    run_dir = Path(tempfile.mkdtemp(prefix="kvcl-", dir="/tmp"))  # short: ipc:// paths
    up = Cluster(
        run_dir,
        "--nodes",
        str(NODES),
        "--smg-port",
        "0",
        *POOL,
        "--backoff-initial",
        "0.2",
        "--health-interval",
        "1",
    )
    try:
        wait_for(up.healthy, 400, f"a healthy cluster:\n{up.output()}")
        wait_for(lambda: "cluster stack running" in up.output(), 120, "SMG's workers ready")
        yield up
    finally:
        with contextlib.suppress(OSError, ValueError, KeyError):
            up.pids = up.every_pid()
        up.reap()
        logs = tmp_path_factory.mktemp("cluster-logs")  # pytest keeps them for a while
        for log in run_dir.rglob("*.log"):
            shutil.copy(log, logs / str(log.relative_to(run_dir)).replace("/", "-"))
        shutil.rmtree(run_dir, ignore_errors=True)


def test_status_lists_every_process_and_smg_serves(cluster: Cluster) -> None:
    status = status_of(cluster)
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.strip().endswith("healthy")
    lines = status.stdout.splitlines()
    assert "mode cluster" in lines[0]
    for name in NAMES:
        assert any(line.startswith(f"{name} ") for line in lines), (name, status.stdout)
    assert f"workers ready {NODES}/{NODES}" in status.stdout
    state = json.loads(status_of(cluster, "--json").stdout)
    assert [p["name"] for p in state["processes"]] == NAMES
    assert all(p["healthy"] and p["alive"] for p in state["processes"])

    reply = post(cluster.url(), PROMPTS[0])
    assert len(reply["output_ids"]) == GREEDY["max_new_tokens"]
    fronts = [cluster.procs()[f"node{i}/http"]["address"] for i in range(NODES)]
    direct = [post(front, PROMPTS[0])["output_ids"] for front in fronts]
    assert direct == [reply["output_ids"]] * NODES  # each node gives SMG's answer


def test_killed_processes_restart_while_smg_keeps_serving(cluster: Cluster) -> None:
    url = cluster.url()
    want = {text: post(url, text)["output_ids"] for text in PROMPTS}
    stop = threading.Event()
    answers: list[tuple[str, object]] = []

    def load() -> None:
        i = 0
        while not stop.is_set():
            text = PROMPTS[i % len(PROMPTS)]
            i += 1
            try:
                answers.append((text, post(url, text)["output_ids"]))
            except Exception as exc:  # any failure counts
                answers.append((text, exc))

    thread = threading.Thread(target=load, name="load")
    thread.start()
    try:
        wait_for(lambda: len(answers) >= 3, 60, "requests through SMG")
        for name in ("node0/scheduler_svc", "node1/http"):
            old = cluster.procs()[name]["pid"]
            before = len(answers)
            os.kill(old, signal.SIGKILL)
            wait_for(lambda n=name: cluster.restarted(n, 1), 240, f"{name} restarted")
            assert cluster.procs()[name]["pid"] != old
            assert f"{name} exited with code -9" in cluster.output()
            wait_for(lambda b=before: len(answers) >= b + 3, 60, "requests after the restart")
    finally:
        stop.set()
        thread.join(120)
    failed = [(text[:10], out) for text, out in answers if out != want[text]]
    assert not failed, failed
    wait_for(lambda: workers_ready(url) == (NODES, NODES), 60, "SMG sees both nodes again")
    for i in range(NODES):  # every page free or cached: nothing held by a dead request
        front = cluster.procs()[f"node{i}/http"]["address"]
        tokens = wait_for(lambda f=front: memsvc_tokens(f), 30, "memsvc's metrics")
        assert tokens.get("used", 0) == 0, (i, tokens)
        assert tokens["available"] + tokens["evictable"] == CAPACITY, (i, tokens)


def test_pd_cluster_pairs_under_smg(cluster: Cluster) -> None:
    """``--prefill-nodes 1 --decode-nodes 1``: both PD nodes and SMG (--pd-disaggregation)
    listed healthy, a request through SMG token-identical to the normal cluster's answer,
    and a stop that leaves no process nor segment."""
    run_dir = Path(tempfile.mkdtemp(prefix="kvpd-", dir="/tmp"))
    pd = Cluster(run_dir, "--prefill-nodes", "1", "--decode-nodes", "1", "--smg-port", "0", *POOL)
    try:
        wait_for(pd.healthy, 400, f"a healthy PD cluster:\n{pd.output()}")
        wait_for(lambda: "cluster stack running" in pd.output(), 120, "SMG's workers ready")
        names = [p["name"] for p in json.loads(status_of(pd, "--json").stdout)["processes"]]
        services = ("memsvc", "model_svc", "scheduler_svc", "http")
        assert names == [
            "mooncake-master",
            *(f"{node}/{s}" for node in ("prefill0", "decode0") for s in services),
            "smg",
        ]
        with urllib.request.urlopen(f"{pd.url()}/workers", timeout=10) as response:
            stats = json.load(response)["stats"]
        assert (stats["prefill_count"], stats["decode_count"]) == (1, 1), stats
        assert workers_ready(pd.url()) == (2, 2)
        for text in PROMPTS[:2]:
            assert post(pd.url(), text)["output_ids"] == post(cluster.url(), text)["output_ids"]
        pids = pd.every_pid()
        pd.proc.send_signal(signal.SIGTERM)
        assert pd.proc.wait(120) == 0, pd.output()
        assert not [pid for pid in pids if pid_alive(pid)]
        assert not [n for n in list_segments() if segment_owner_pid(n) in pids]
        assert not list(run_dir.rglob("*.sock")) and not list(run_dir.rglob("*.ready"))
    finally:
        with contextlib.suppress(OSError, ValueError, KeyError):
            pd.pids = pd.every_pid()
        pd.reap()
        shutil.rmtree(run_dir, ignore_errors=True)


def test_stop_leaves_no_process_and_no_segment(cluster: Cluster) -> None:
    pids = cluster.every_pid()
    assert len(pids) >= len(NAMES) + 2  # SMG's and the master's own processes too
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(120) == 0, cluster.output()
    assert not [pid for pid in pids if pid_alive(pid)]
    assert not [n for n in list_segments() if segment_owner_pid(n) in pids]
    run_dir = cluster.run_dir
    assert not list(run_dir.rglob("*.sock")) and not list(run_dir.rglob("*.ready"))


def test_bad_cluster_shapes_are_refused(tmp_path: Path) -> None:
    for args, says in [
        (("--prefill-nodes", "1"), "--prefill-nodes P and --decode-nodes D"),
        (("--nodes", "2", "--decode-nodes", "1"), "--prefill-nodes P and --decode-nodes D"),
        (("--nodes", "2", "--mode", "pd"), "not --mode pd"),
    ]:
        result = kvstack("up", *args, "--run-dir", str(tmp_path))
        assert result.returncode == 2 and says in result.stderr, (args, result.stderr)
        assert not (tmp_path / "state.json").exists()


def test_each_node_gets_its_own_kv_events_endpoints(tmp_path: Path) -> None:
    """A --kv-events-config given to a cluster: node I's endpoints offset by I (SGLang's
    per-DP-rank offsets), so that every node's memsvc binds its own publisher."""
    from kvstack.stack.spec import StackOptions
    from kvstack.up.cluster import ClusterOptions, cluster_stack

    smg_binary()
    require_mooncake()
    config = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:41000"}
    config["replay_endpoint"] = "tcp://127.0.0.1:42000"
    options = StackOptions(memsvc_args=[*POOL, "--kv-events-config", json.dumps(config)])
    specs = cluster_stack(tmp_path, options, ClusterOptions(prefill_nodes=1, decode_nodes=2))
    seen = []
    for spec in specs:
        if spec.kind == "memsvc":
            command = list(spec.command)
            given = json.loads(command[command.index("--kv-events-config") + 1])
            seen.append((given["endpoint"], given["replay_endpoint"]))
    assert seen == [
        (f"tcp://127.0.0.1:{41000 + i}", f"tcp://127.0.0.1:{42000 + i}") for i in range(3)
    ]
