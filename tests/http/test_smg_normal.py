"""SGLang's router (SMG 1.13.0, unmodified) in front of two normal-mode ``kvstack serve`` nodes.

SMG registers each node as it registers an SGLang server (``/health``,
``/v1/models``, ``/version``, ``/server_info``, ``/model_info``), health-checks them
every second, and re-serializes every body it forwards, adding SGLang fields
(``model``, ``log_metrics``, ``background``, ``return_bytes``... on ``/generate``;
``logprobs``, ``echo``, ``stream`` on the OpenAI routes). Through it, SGLang-native
and OpenAI requests, streamed or not, must answer exactly what one node answers
alone (greedy, so token for token), under both the cache-aware and the round-robin
policy. Last, one node is killed under SMG while requests run on both: what ran on
it ends with an explicit error or completes elsewhere with the right output, and the
other node keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from typing import Any

import aiohttp
import pytest

from kvstack.up.cli import pid_alive
from memsvc.core.backends.shm import list_segments, segment_owner_pid
from model_svc.tiny import write_tiny_checkpoint
from tests.http.test_http_front import POOL, Front, start_front, stop_and_check_clean
from tests.smg import Smg, start_smg

TEXTS = ["Hello there", "The quick brown fox", "kvstack behind SGLang's router", "abc" * 9]
GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
LONG = 500  # output tokens of a request still running when its node is killed


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Any:
    workdir = tmp_path_factory.mktemp("smg-normal")
    checkpoint = write_tiny_checkpoint(workdir / "ckpt")
    started: list[Front] = []
    try:
        for name in ("a", "b"):
            started.append(
                start_front(
                    workdir,
                    name,
                    "--checkpoint",
                    str(checkpoint),
                    "--served-model-name",
                    "tiny",
                    *POOL,
                )
            )
        yield workdir, started
    finally:
        for front in started:
            if front.proc.poll() is None:
                stop_and_check_clean(front)
            else:
                _reaped(front)


def _reaped(front: Front, timeout: float = 30) -> None:
    """A killed node's services stop by their lifeline and leave no shared memory."""
    services = front.info["services"]
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in services.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [name for name, pid in services.items() if pid_alive(pid)]
    for name in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(services[name], signal.SIGKILL)
    segments = [s for s in list_segments() if segment_owner_pid(s) in services.values()]
    for segment in segments:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{segment}")
    assert not left, f"services of a killed node still running: {left}"
    assert not segments, f"a killed node left shared memory: {segments}"


@pytest.fixture(scope="module", params=["cache_aware", "round_robin"])
def smg(request: pytest.FixtureRequest, nodes) -> Any:
    workdir, fronts = nodes
    urls = [front.url for front in fronts]
    router = start_smg(
        workdir, "--worker-urls", *urls, "--policy", request.param, num_workers=len(urls)
    )
    try:
        yield router
    finally:
        router.stop()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, Any]:
    async with http.post(url, json=body) as response:
        if not body.get("stream"):
            return response.status, await response.json(content_type=None)
        events = []
        async for line in response.content:
            line = line.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                events.append(json.loads(line[5:]))
        return response.status, events


async def post_once_smg_has_a_worker(
    http: aiohttp.ClientSession, url: str, body: dict, within_s: float = 30.0
) -> tuple[int, Any]:
    """``post``, sent again while SMG answers 503 ``no_available_workers``: right after a
    node's death its circuit breaker may hold back every worker for a moment (seen once
    on a loaded CI machine, the survivor included), then lets the healthy one through."""
    deadline = time.monotonic() + within_s
    while True:
        status, answer = await post(http, url, body)
        busy = status == 503 and "no_available_workers" in json.dumps(answer)
        if not busy or time.monotonic() > deadline:
            return status, answer
        await asyncio.sleep(0.5)


def requests() -> list[tuple[str, dict]]:
    """(route, body): SGLang-native and OpenAI requests, streamed and not (chat needs a
    chat template, which the tiny model's byte tokenizer has not: the SmolLM2 test)."""
    out = []
    for text in TEXTS:
        out.append(("/generate", {"text": text, "sampling_params": GREEDY}))
        out.append(("/generate", {"text": text, "sampling_params": GREEDY, "stream": True}))
        completion = {"model": "tiny", "prompt": text, "max_tokens": 10, "temperature": 0.0}
        out.append(("/v1/completions", completion))
        out.append(("/v1/completions", {**completion, "stream": True}))
    out.append(("/generate", {"input_ids": [5, 6, 7, 8, 9], "sampling_params": GREEDY}))
    return out


def output_of(route: str, body: dict, status: int, answer: Any) -> Any:
    """What must match token for token: the ids (native) or the text (OpenAI)."""
    assert status == 200, (route, body, answer)
    if route == "/generate":
        last = answer[-1] if body.get("stream") else answer
        return last["output_ids"], last["meta_info"]["finish_reason"]
    if body.get("stream"):
        choices = [c for event in answer for c in event["choices"]]
        key = "text" if route == "/v1/completions" else "delta"
        parts = [c.get(key) if key == "text" else c[key].get("content") for c in choices]
        return "".join(p or "" for p in parts), choices[-1]["finish_reason"]
    choice = answer["choices"][0]
    text = choice["text"] if route == "/v1/completions" else choice["message"]["content"]
    return text, choice["finish_reason"]


# What SMG 1.13.0 sent a worker for ``{"text": "Hello there", "sampling_params": {...}}``
# (recorded from a real run against a logging worker).
SMG_GENERATE = {
    "text": "Hello there",
    "model": "unknown",
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 2},
    "return_text_in_logprobs": False,
    "stream": False,
    "log_metrics": True,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}


def test_smgs_generate_body_is_accepted_and_its_model_dropped() -> None:
    from kvstack.serve.errors import ApiError
    from kvstack.serve.sglang.protocol import parse_generate

    batch = parse_generate(SMG_GENERATE)
    assert [one.text for one in batch.items] == ["Hello there"] and not batch.stream
    assert parse_generate({**SMG_GENERATE, "model": None}).items[0].text == "Hello there"
    for field, value in (("model", 5), ("background", True), ("return_entropy", True)):
        with pytest.raises(ApiError) as caught:
            parse_generate({**SMG_GENERATE, field: value})
        assert caught.value.status == 400 and field in caught.value.message


def test_smg_registers_both_nodes_with_their_model_and_context_len(smg: Smg, nodes) -> None:
    _, fronts = nodes
    workers = {w["url"]: w for w in smg.workers()}
    assert set(workers) == {front.url for front in fronts}
    for worker in workers.values():
        assert worker["is_healthy"] and worker["status"] == "ready"
        assert worker["model_id"] == "tiny"
        assert worker["models"][0]["context_length"] == 2048  # /v1/models' max_model_len
        assert worker["labels"]["served_model_name"] == "tiny"  # from /server_info
    time.sleep(3)  # three of SMG's health checks later, still healthy
    assert all(w["is_healthy"] for w in smg.workers()), smg.log()[-3000:]


def test_requests_through_smg_answer_as_one_node(smg: Smg, nodes) -> None:
    _, fronts = nodes
    single = fronts[0].url

    async def go() -> list[tuple[Any, Any]]:
        async with aiohttp.ClientSession() as http:
            pairs = []
            for route, body in requests():
                alone = output_of(route, body, *await post(http, single + route, body))
                routed = output_of(route, body, *await post(http, smg.url + route, body))
                pairs.append(((route, body.get("stream", False)), (alone, routed)))
            return pairs

    pairs = run(go())
    assert len(pairs) == 4 * len(TEXTS) + 1
    for where, (alone, routed) in pairs:
        assert routed == alone, where
        assert alone[1] is not None, where  # a finished answer, not an empty one


def test_the_policy_decides_where_a_repeated_prompt_goes(smg: Smg, nodes) -> None:
    """Round robin spreads four identical requests over both nodes; cache-aware routing
    sends them all where their prefix is cached."""
    _, fronts = nodes
    policy = smg.proc.args[smg.proc.args.index("--policy") + 1]

    async def count(http: aiohttp.ClientSession, url: str) -> float:
        async with http.get(f"{url}/metrics") as response:
            text = await response.text()
        lines = [line for line in text.splitlines() if line.startswith("sglang:num_requests_total")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    async def go() -> list[float]:
        async with aiohttp.ClientSession() as http:
            before = [await count(http, f.url) for f in fronts]
            for _ in range(4):
                body = {"text": TEXTS[1] * 3, "sampling_params": GREEDY}
                status, _ = await post(http, smg.url + "/generate", body)
                assert status == 200
            after = [await count(http, f.url) for f in fronts]
            return [b - a for a, b in zip(before, after, strict=True)]

    grew = run(go())
    assert sum(grew) == 4, grew
    if policy == "round_robin":
        assert grew == [2, 2], grew
    else:
        assert sorted(grew) == [0, 4], grew


def test_a_node_killed_under_smg(nodes) -> None:
    """A third node joins node a behind a round-robin SMG and is killed (SIGKILL: its
    services follow by their lifeline) while long requests run on both. Each request
    either completes with exactly the output one node gives, or ends with an explicit
    error (a non-200 answer, or an ``error`` event in place of the stream's end); node a
    keeps serving through SMG, and SMG marks the dead node unhealthy."""
    workdir, fronts = nodes
    args = ["--checkpoint", str(workdir / "ckpt"), "--served-model-name", "tiny", *POOL]
    doomed = start_front(workdir, "c", *args)
    router: Smg | None = None
    try:
        router = start_smg(
            workdir,
            "--worker-urls",
            fronts[0].url,
            doomed.url,
            "--policy",
            "round_robin",
            num_workers=2,
        )
        _kill_under_smg(router, fronts[0], doomed)
    finally:
        if router is not None:
            router.stop()
        if doomed.proc.poll() is None:
            doomed.proc.kill()
            doomed.proc.wait()
        _reaped(doomed)


def _kill_under_smg(router: Smg, survivor: Front, doomed: Front) -> None:
    sampling = {"max_new_tokens": LONG, "temperature": 0.0, "ignore_eos": True}
    bodies = [
        {"text": f"long request {i}", "sampling_params": sampling, "stream": i % 2 == 0}
        for i in range(4)
    ]

    async def server_info(http: aiohttp.ClientSession, front: Front) -> dict:
        async with http.get(f"{front.url}/server_info") as response:
            return await response.json()

    async def running(http: aiohttp.ClientSession, front: Front) -> int:
        info = await server_info(http, front)
        return info.get("num_running", 0) + info.get("num_waiting", 0)

    async def served(http: aiohttp.ClientSession, front: Front) -> int:
        """Requests ``front`` has running, waiting or finished."""
        info = await server_info(http, front)
        finished = info["stats"]["finished_reqs"]
        return info.get("num_running", 0) + info.get("num_waiting", 0) + finished

    async def go() -> tuple[list, list, list, int]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            want = await asyncio.gather(
                *(post(http, survivor.url + "/generate", {**b, "stream": False}) for b in bodies)
            )
            before = await served(http, survivor)
            # (SMG may answer 503 no_available_workers while the node that just joined is
            # not healthy yet, or its breaker holds workers back: sent again meanwhile)
            url = router.url + "/generate"
            send = post_once_smg_has_a_worker
            tasks = [asyncio.ensure_future(send(http, url, b)) for b in bodies]
            # Both nodes got some (not necessarily at the same moment: on a loaded machine
            # the survivor's may be done before the doomed node's start), and the doomed
            # node is running its own when it is killed. A batch that ended before that
            # was seen (ci24, ci25: every answer a 200, neither node seen serving one)
            # is sent again.
            deadline = time.monotonic() + 120
            while True:
                survivor_had = await served(http, survivor) > before
                on_doomed = await running(http, doomed)
                if survivor_had and on_doomed:
                    break
                answered = [str(t.result())[:200] for t in tasks if t.done()]
                assert time.monotonic() < deadline, (
                    f"the requests did not reach both nodes: survivor had some {survivor_had}, "
                    f"the doomed node runs {on_doomed}; SMG answered {answered}"
                )
                if len(answered) == len(tasks):
                    tasks = [asyncio.ensure_future(send(http, url, b)) for b in bodies]
                await asyncio.sleep(0.05)
            doomed.proc.send_signal(signal.SIGKILL)
            got = await asyncio.gather(*tasks, return_exceptions=True)
            after = [
                await post_once_smg_has_a_worker(
                    http, router.url + "/generate", {"text": t, "sampling_params": GREEDY}
                )
                for t in TEXTS
            ]
            return want, got, after, on_doomed

    want, got, after, on_doomed = run(go())
    assert on_doomed > 0
    outcomes = []
    for body, (status, alone), result in zip(bodies, want, got, strict=True):
        assert status == 200
        assert not isinstance(result, BaseException), result  # SMG answers, never hangs up
        code, answer = result
        if code != 200:
            outcomes.append("error status")
            continue
        if body["stream"]:
            last = answer[-1]
            if "error" in last:  # SMG's stream_error event, in place of the finish
                assert all(e["meta_info"]["finish_reason"] is None for e in answer[:-1])
                outcomes.append("error event")
                continue
            answer = last
        assert answer["output_ids"] == alone["output_ids"], body
        assert answer["meta_info"]["finish_reason"] == alone["meta_info"]["finish_reason"]
        outcomes.append("complete")
    print("outcomes of the requests in flight at the kill:", outcomes)
    for status, answer in after:  # the survivor serves everything now
        assert status == 200, answer
        assert len(answer["output_ids"]) == GREEDY["max_new_tokens"]
    deadline = time.monotonic() + 30
    while True:
        health = {w["url"]: w["is_healthy"] for w in router.workers()}
        if health.get(survivor.url) and not health.get(doomed.url, False):
            break
        assert time.monotonic() < deadline, (health, router.log()[-3000:])
        time.sleep(0.5)
