"""``kvstack serve`` end to end: a real server process (and its stack), driven over HTTP.

One server (memsvc, model_svc, scheduler_svc behind the HTTP front) serves the
whole module; fronts of its scheduler (``--scheduler``) are started beside it,
as docker compose runs them. Outputs are judged against what the scheduler's
own ZMQ client returns for the same prompt. The server's teardown checks that
SIGTERM stops every process it started and leaves no shared memory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstack.serve import cli as serve_cli
from kvstack.serve.backends import ServeError, start_stack
from kvstack.serve.metrics import merge_metrics, parse_metrics
from kvstack.serve.streaming import StreamText
from kvstack.up.cli import pid_alive
from memsvc.core.backends.shm import list_segments, segment_owner_pid
from memsvc.lifeline import child_env
from model_svc.tiny import write_tiny_checkpoint
from model_svc.tokenizer import ByteTokenizer
from scheduler_svc.client import AsyncGenerateClient, GenerateResult
from tests.procs import REPO
from tests.supervisor.test_supervisor import kvstack

CAPACITY = 1024
POOL = ["--page-size", "4", "--num-pages", "256", "--max-context-len", "2048"]
LONG = 900  # output tokens of a request meant to be cut short: seconds of decoding
GREEDY = {"max_new_tokens": 12, "ignore_eos": True}


@dataclass
class Front:
    """A ``kvstack serve`` process and what its ready file says."""

    proc: subprocess.Popen
    info: dict[str, Any]
    log_path: Path

    @property
    def url(self) -> str:
        return self.info["address"]

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


def start_front(
    workdir: Path, name: str, *args: str, timeout: float = 120, nofile: int | None = None
) -> Front:
    """``kvstack serve *args``, once its ready file says it listens; ``nofile``: its
    open-file limit (RLIMIT_NOFILE, soft and hard)."""
    ready = workdir / f"{name}.ready"
    log_path = workdir / f"{name}.log"
    command = [
        sys.executable,
        "-m",
        "kvstack.cli",
        "serve",
        "--port",
        "0",
        "--ready-file",
        str(ready),
        "--log-level",
        "WARNING",
        *args,
    ]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **child_env(), "PYTHONPATH": str(REPO)},
            preexec_fn=None if nofile is None else functools.partial(_limit_files, nofile),
        )
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_front(Front(proc, {}, log_path), signal.SIGTERM)
            pytest.fail(f"kvstack serve {name} did not start:\n{log_path.read_text()}")
        time.sleep(0.05)
    return Front(proc, json.loads(ready.read_text()), log_path)


def _limit_files(nofile: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))


def stop_front(front: Front, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    """``sig``, then SIGKILL (and a failed test) if it does not exit in ``timeout``."""
    if front.proc.poll() is None:
        front.proc.send_signal(sig)
        try:
            front.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            front.proc.kill()
            front.proc.wait()
            for pid in front.info.get("services", {}).values():
                _kill(pid)
            pytest.fail(f"kvstack serve ignored signal {sig}:\n{front.log()}")
    return front.proc.returncode


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def stop_and_check_clean(front: Front) -> dict[str, int]:
    """SIGTERM the front; it must exit 0 having stopped every service it started and left
    none of their shared memory (what is left is killed, then the test fails). Returns
    the services it had started, by name."""
    code = stop_front(front, signal.SIGTERM)
    services = front.info["services"]
    left = [name for name, pid in services.items() if pid_alive(pid)]
    for name in left:
        _kill(services[name])
    segments = [s for s in list_segments() if segment_owner_pid(s) in services.values()]
    assert code == 0, front.log()
    assert not left, f"still running after SIGTERM: {left}"
    assert not segments, f"shared memory left behind: {segments}"
    return services


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    workdir = tmp_path_factory.mktemp("serve")
    checkpoint = write_tiny_checkpoint(workdir / "ckpt")
    front = start_front(workdir, "server", "--checkpoint", str(checkpoint), *POOL)
    try:
        yield front
    finally:
        services = stop_and_check_clean(front)
        assert set(services) == {"memsvc", "model_svc", "scheduler_svc"}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def read_events(response: aiohttp.ClientResponse) -> list[Any]:
    """The ``data:`` events of a server-sent-event stream, ``"[DONE]"`` as a string."""
    events = []
    async for line in response.content:
        if line.startswith(b"data: "):
            data = line[len(b"data: ") :].strip()
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


async def zmq_generate(scheduler: str, **kwargs: Any) -> GenerateResult:
    async with AsyncGenerateClient(scheduler, timeout_s=60) as client:
        return await client.generate(**kwargs)


# -- generate ---------------------------------------------------------------------------------


def test_generate_by_input_ids_matches_the_zmq_client(server: Front) -> None:
    prompt = [11, 22, 33, 44, 55]

    async def go() -> tuple[int, dict, GenerateResult]:
        async with aiohttp.ClientSession() as http:
            body = {"input_ids": prompt, "sampling_params": GREEDY, "rid": "ids-1"}
            async with http.post(f"{server.url}/generate", json=body) as response:
                got = (response.status, await response.json())
        want = await zmq_generate(server.info["scheduler"], input_ids=prompt, sampling=GREEDY)
        return (*got, want)

    status, got, want = run(go())
    assert status == 200, got
    assert got["output_ids"] == want.output_ids and len(got["output_ids"]) == 12
    assert got["text"] == want.text == ByteTokenizer().decode(want.output_ids)
    meta = got["meta_info"]
    assert meta["id"] == "ids-1"
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 12
    assert meta["num_retractions"] == 0 and meta["cached_tokens"] >= 0
    assert meta["e2e_latency"] > 0


def test_generate_by_text(server: Front) -> None:
    async def go() -> tuple[int, dict, GenerateResult]:
        async with aiohttp.ClientSession() as http:
            body = {"text": "Hello", "sampling_params": GREEDY}
            async with http.post(f"{server.url}/generate", json=body) as response:
                got = (response.status, await response.json())
        want = await zmq_generate(server.info["scheduler"], text="Hello", sampling=GREEDY)
        return (*got, want)

    status, got, want = run(go())
    assert status == 200, got
    assert got["meta_info"]["prompt_tokens"] == 6  # bos + 5 bytes
    assert got["output_ids"] == want.output_ids
    assert got["text"] == want.text
    assert len(got["meta_info"]["id"]) >= 16  # a rid was made up


def test_streaming_chunks_build_the_output(server: Front) -> None:
    prompt = [7, 8, 9]
    sampling = {"max_new_tokens": 20, "ignore_eos": True}

    async def go() -> tuple[str, list, dict]:
        async with aiohttp.ClientSession() as http:
            body = {"input_ids": prompt, "sampling_params": sampling, "stream": True}
            async with http.post(f"{server.url}/generate", json=body) as response:
                assert response.status == 200
                kind = response.headers["Content-Type"]
                events = await read_events(response)
            body["stream"] = False
            async with http.post(f"{server.url}/generate", json=body) as response:
                whole = await response.json()
        return kind, events, whole

    kind, events, whole = run(go())
    assert kind.startswith("text/event-stream")
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    assert len(chunks) >= 2, chunks
    # SGLang's default: each chunk holds the whole output so far
    for before, after in itertools.pairwise(chunks):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert after["text"].startswith(before["text"])
        assert before["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert last["output_ids"] == whole["output_ids"] and len(whole["output_ids"]) == 20
    assert last["text"] == whole["text"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert last["meta_info"]["completion_tokens"] == 20


def test_abort_a_long_streaming_request(server: Front) -> None:
    sampling = {"max_new_tokens": LONG, "ignore_eos": True}

    async def go() -> tuple[dict, dict, list]:
        async with aiohttp.ClientSession() as http:
            body = {"input_ids": [1, 2, 3], "sampling_params": sampling, "stream": True}
            body["rid"] = "long"
            async with http.post(f"{server.url}/generate", json=body) as response:
                assert response.status == 200
                first = await response.content.readline()
                assert first.startswith(b"data: {"), first
                async with http.post(f"{server.url}/abort_request", json={"rid": "long"}) as r:
                    aborted = await r.json()
                async with http.post(f"{server.url}/abort_request", json={"rid": "nope"}) as r:
                    unknown = await r.json()
                events = await read_events(response)
        return aborted, unknown, events

    aborted, unknown, events = run(go())
    assert aborted == {"rid": "long", "found": True}
    assert unknown == {"rid": "nope", "found": False}
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(last["output_ids"]) < LONG  # the partial output
    assert last["meta_info"]["completion_tokens"] == len(last["output_ids"])


def test_a_client_that_goes_away_aborts_its_request(server: Front) -> None:
    sampling = {"max_new_tokens": LONG, "ignore_eos": True}

    async def go() -> tuple[dict, dict]:
        async with AsyncGenerateClient(server.info["scheduler"], timeout_s=10) as scheduler:
            before = (await scheduler.info())["stats"]
            async with aiohttp.ClientSession() as http:
                body = {"input_ids": [4, 5, 6], "sampling_params": sampling, "stream": True}
                response = await http.post(f"{server.url}/generate", json=body)
                assert (await response.content.readline()).startswith(b"data: {")
                response.close()  # hang up mid-stream
            for _ in range(200):
                info = await scheduler.info()
                if info["stats"]["aborted_reqs"] > before["aborted_reqs"]:
                    break
                await asyncio.sleep(0.05)
            return before, info

    before, after = run(go())
    assert after["stats"]["aborted_reqs"] == before["aborted_reqs"] + 1
    assert after["stats"]["finished_reqs"] == before["finished_reqs"]
    assert after["num_running"] == after["num_waiting"] == 0


BAD_REQUESTS = [
    ("malformed json", b'{"input_ids": [1, 2', 400, "malformed_json"),
    ("not an object", b"[1, 2, 3]", 400, "invalid_request"),
    ("no input", {"sampling_params": GREEDY}, 400, "invalid_request"),
    ("both inputs", {"text": "a", "input_ids": [1]}, 400, "invalid_request"),
    # found by tests/fuzz: a batch of texts beside a shorter list of ids was a 500
    ("batch and ids", {"text": ["a", "b"], "input_ids": [1]}, 400, "invalid_request"),
    ("empty ids", {"input_ids": []}, 400, "invalid_request"),
    ("ids of strings", {"input_ids": ["1"]}, 400, "invalid_request"),
    (
        "max_new_tokens a string",
        {"text": "a", "sampling_params": {"max_new_tokens": "5"}},
        400,
        "invalid_request",
    ),
    (
        "negative max_new_tokens",
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        400,
        "invalid_request",
    ),
    (
        "temperature a bool",
        {"text": "a", "sampling_params": {"temperature": True}},
        400,
        "invalid_request",
    ),
    ("unknown field", {"text": "a", "evil": 1}, 400, "invalid_request"),
    (
        "unknown sampling param",
        {"text": "a", "sampling_params": {"stop_words": ["x"]}},
        400,
        "invalid_request",
    ),
    (
        "sglang field kvstack does not honour",
        {"text": "a", "sampling_params": {"logit_bias": {"1": 2.0}}},
        400,
        "unsupported_field",
    ),
    ("id out of the vocabulary", {"input_ids": [1, 99999]}, 400, "bad_request"),
    ("can never fit", {"input_ids": [1] * (CAPACITY + 88)}, 400, "too_large"),
]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_generate_requests_get_a_4xx_json_error(server: Front, body, status, code) -> None:
    async def go() -> tuple[int, dict, int]:
        async with aiohttp.ClientSession() as http:
            kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
            async with http.post(f"{server.url}/generate", **kwargs) as response:
                got = (response.status, await response.json())
            async with http.get(f"{server.url}/health") as response:
                return (*got, response.status)

    got_status, reply, health = run(go())
    assert (got_status, reply["error"]["code"]) == (status, code), reply
    assert reply["error"]["message"]
    assert health == 200  # and the server keeps serving


def test_other_http_errors_are_json_too(server: Front) -> None:
    async def go() -> list[tuple[int, dict]]:
        out = []
        async with aiohttp.ClientSession() as http:
            for method, path, body in [
                ("GET", "/nope", None),
                ("GET", "/generate", None),
                ("POST", "/abort_request", {}),
                ("POST", "/abort_request", {"rid": 5}),
            ]:
                async with http.request(method, f"{server.url}{path}", json=body) as response:
                    out.append((response.status, await response.json()))
        return out

    (missing, missing_body), (wrong, _), (no_rid, _), (bad_rid, _) = run(go())
    assert missing == 404 and missing_body["error"]["code"] == "not_found"
    assert wrong == 405 and no_rid == 400 and bad_rid == 400


# -- health, info, metrics ----------------------------------------------------------------------


def test_health_and_server_info(server: Front) -> None:
    async def go() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{server.url}/health") as response:
                health = response.status
            async with http.get(f"{server.url}/get_server_info") as response:
                return health, await response.json()

    health, info = run(go())
    assert health == 200
    assert info["capacity"] == info["max_total_num_tokens"] == CAPACITY
    assert info["page_size"] == 4 and info["max_context_len"] == 2048
    assert info["retraction_policy"] == "length"
    assert info["schedule_conservativeness"] == 1.0
    assert info["mode"] == "normal"
    assert info["scheduler_address"] == server.info["scheduler"]


def families(text: str) -> dict[str, Any]:
    found = list(text_string_to_metric_families(text))
    names = [f.name for f in found]
    assert len(names) == len(set(names)), f"a family appears twice: {sorted(names)}"
    return {f.name: f for f in found}


def sample_value(family: Any, name: str, **labels: str) -> float:
    for sample in family.samples:
        if sample.name == name and labels.items() <= sample.labels.items():
            return sample.value
    raise AssertionError(f"no {name}{labels} in {family.samples}")


def test_metrics_of_every_service_in_one_exposition(server: Front) -> None:
    async def go() -> str:
        async with aiohttp.ClientSession() as http:
            body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}}
            async with http.post(f"{server.url}/generate", json=body) as response:
                assert response.status == 200
            async with http.get(f"{server.url}/metrics") as response:
                assert response.status == 200
                return await response.text()

    text = run(go())
    found = families(text)
    for name in ("memsvc_tokens", "memsvc_op_seconds", "kvstack_kv_tokens"):
        assert name in found, name
    generated = sample_value(
        found["kvstack_generated_tokens"], "kvstack_generated_tokens_total", service="scheduler"
    )
    assert generated >= 3
    assert (
        sample_value(found["memsvc_ops"], "memsvc_ops_total", service="memsvc", op="decode_step")
        > 0
    )
    assert (
        sample_value(
            found["kvstack_http_requests"],
            "kvstack_http_requests_total",
            service="http",
            endpoint="/generate",
            status="200",
        )
        >= 1
    )
    up = found["kvstack_http_metrics_source_up"]
    assert sample_value(up, "kvstack_http_metrics_source_up", source="memsvc") == 1
    assert sample_value(up, "kvstack_http_metrics_source_up", source="scheduler") == 1


# -- fronting a running scheduler -------------------------------------------------------------


def test_fronting_a_running_scheduler(server: Front, tmp_path: Path) -> None:
    """What compose runs: a front given the scheduler's address, and one whose scheduler is
    gone (503s); both stop on SIGINT."""
    scheduler_metrics = server.info["metrics"]["scheduler"]
    fronts = [
        start_front(
            tmp_path,
            "front",
            "--scheduler",
            server.info["scheduler"],
            "--metrics-url",
            f"scheduler={scheduler_metrics}",
        ),
        start_front(
            tmp_path,
            "orphan",
            "--scheduler",
            f"ipc://{tmp_path}/nobody.sock",
            "--model-path",
            "tiny",  # nobody to ask which model it is
            "--control-timeout",
            "0.5",
            "--request-timeout",
            "0.5",
            "--metrics-url",
            "dead=http://127.0.0.1:9/metrics",
        ),
    ]
    try:

        async def go() -> dict[str, Any]:
            out: dict[str, Any] = {}
            front, orphan = (f.url for f in fronts)
            async with aiohttp.ClientSession() as http:
                body = {"input_ids": [9, 9, 9], "sampling_params": GREEDY}
                async with http.post(f"{front}/generate", json=body) as response:
                    out["generate"] = await response.json()
                async with http.get(f"{front}/health") as response:
                    out["health"] = response.status
                for name, url in (("model", front), ("server_model", server.url)):
                    async with http.get(f"{url}/get_model_info") as response:
                        out[name] = await response.json()
                async with http.get(f"{front}/metrics") as response:
                    out["metrics"] = await response.text()
                async with http.get(f"{orphan}/health") as response:
                    out["orphan_health"] = (response.status, await response.json())
                async with http.post(f"{orphan}/generate", json=body) as response:
                    out["orphan_generate"] = (response.status, await response.json())
                async with http.get(f"{orphan}/metrics") as response:
                    out["orphan_metrics"] = await response.text()
            out["want"] = await zmq_generate(
                server.info["scheduler"], input_ids=[9, 9, 9], sampling=GREEDY
            )
            return out

        out = run(go())
    finally:
        codes = [stop_front(front, signal.SIGINT, timeout=20) for front in fronts]
    assert out["generate"]["output_ids"] == out["want"].output_ids
    assert out["health"] == 200
    # no --model-path: the front serves (and decodes with) what the scheduler says it serves
    assert out["model"]["model_path"] == out["server_model"]["model_path"]
    assert out["model"]["model_path"] != "tiny" and Path(out["model"]["model_path"]).is_dir()
    found = families(out["metrics"])
    assert "kvstack_generated_tokens" in found and "memsvc_tokens" not in found
    assert out["orphan_health"][0] == 503
    assert out["orphan_health"][1]["error"]["code"] == "scheduler_unavailable"
    assert out["orphan_generate"][0] == 503
    up = families(out["orphan_metrics"])["kvstack_http_metrics_source_up"]
    assert sample_value(up, "kvstack_http_metrics_source_up", source="dead") == 0
    assert codes == [0, 0], [f.log() for f in fronts]


def serve_fails(*args: str) -> str:
    """``kvstack serve ARGS`` must give up with exit status 2; returns its stderr."""
    done = kvstack("serve", "--port", "0", *args, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    return done.stderr


def test_fronting_a_silent_scheduler_without_a_model_path_is_a_clear_error(
    tmp_path: Path,
) -> None:
    """Which tokenizer to decode with is the scheduler's to say; if it does not answer
    within --ready-timeout, the front cannot know and says so."""
    started = time.monotonic()
    err = serve_fails("--scheduler", f"ipc://{tmp_path}/nobody.sock", "--ready-timeout", "1")
    assert time.monotonic() - started < 60
    assert "did not answer within 1 s" in err and "--model-path" in err, err


def test_a_service_not_ready_within_ready_timeout_stops_serve(tmp_path: Path) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt")
    err = serve_fails("--model-path", str(checkpoint), "--ready-timeout", "0.01")
    assert "error: memsvc" in err and "not ready" in err, err


# -- pieces, in process ---------------------------------------------------------------------


def test_merge_metrics_gives_one_help_and_type_per_family() -> None:
    texts = []
    for value in (2, 5):
        registry = CollectorRegistry()
        Counter("kvstack_x", "Some things", ["kind"], registry=registry).labels("a").inc(value)
        texts.append(generate_latest(registry).decode())
    merged = merge_metrics(
        [("prefill", parse_metrics(texts[0])), ("decode", parse_metrics(texts[1]))]
    ).decode()
    assert merged.count("# TYPE kvstack_x_total counter") == 1
    assert merged.count("# HELP kvstack_x_total") == 1
    family = families(merged)["kvstack_x"]
    assert sample_value(family, "kvstack_x_total", service="prefill", kind="a") == 2
    assert sample_value(family, "kvstack_x_total", service="decode", kind="a") == 5
    gauge = "# TYPE kvstack_x gauge\nkvstack_x 1.0\n"
    clash = merge_metrics([("a", parse_metrics(texts[0])), ("b", parse_metrics(gauge))])
    family = families(clash.decode())["kvstack_x"]
    assert family.type == "counter" and {s.labels["service"] for s in family.samples} == {"a"}
    with pytest.raises(ValueError):
        parse_metrics("not { metrics\n")


def test_stream_text_never_splits_a_character() -> None:
    tokenizer = ByteTokenizer()
    text = "héllo wörld ✓"
    ids = list(text.encode())
    pieces = [ids[i : i + 2] for i in range(0, len(ids), 2)]  # cuts inside characters
    result = GenerateResult("r", ids, text, {})

    cumulative = StreamText(tokenizer, incremental=False)
    shown = [cumulative.chunk(p) for p in pieces] + [cumulative.done(result)]
    assert shown[-1] == {"text": text, "output_ids": ids}
    for payload in shown:
        assert "\ufffd" not in payload["text"] and text.startswith(payload["text"])

    incremental = StreamText(tokenizer, incremental=True)
    deltas = [incremental.chunk(p) for p in pieces] + [incremental.done(result)]
    assert "".join(d["text"] for d in deltas) == text
    assert [t for d in deltas for t in d["output_ids"]] == ids
    assert all("\ufffd" not in d["text"] for d in deltas)


def test_pd_mode_starts_a_pd_stack_and_fronts_its_router(checkpoint) -> None:
    class Svc:
        def __init__(self, name: str, port: int) -> None:
            self.name, self.address, self.metrics_port = name, f"ipc://{name}", port
            self.proc = argparse.Namespace(pid=port)

    calls = []

    class FakeLauncher:
        def start_pd_stack(self, checkpoint, pool, scheduler, **kwargs):
            calls.append((pool, scheduler))
            names = ["memsvc-p", "memsvc-d", "scheduler-p", "scheduler-d", "router"]
            return {n: Svc(n, 9000 + i) for i, n in enumerate(names)}

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    argv = ["--mode", "pd", "--checkpoint", str(checkpoint), "--page-size", "4"]
    args = parser.parse_args([*argv, "--num-pages", "64", "--schedule-conservativeness", "0.5"])
    backend = start_stack(FakeLauncher(), "pd", args)
    assert backend.scheduler == "ipc://router"
    assert set(backend.metrics) == {"memsvc-p", "memsvc-d", "scheduler-p", "scheduler-d"}
    ((pool, scheduler),) = calls
    assert pool[:6] == ["--page-size", "4", "--num-pages", "64", "--dtype", "float32"]
    assert "--schedule-conservativeness" in scheduler
    with pytest.raises(ServeError, match="unknown"):
        start_stack(FakeLauncher(), "bogus", args)
