"""PD behind SGLang's router: SMG 1.13.0 (unmodified) over 1 prefill + 2 decode kvstack nodes.

``kvstack serve --mode prefill`` and ``--mode decode`` are SMG's prefill and
decode workers (``smg launch --pd-disaggregation --prefill URL PORT --decode
URL --decode URL``), the bootstrap port being the prefill node's HTTP port.
SMG sends each request to the prefill node and to one decode node with
``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``; the decode node
registers the room with the prefill node, whose memsvc sends the prompt's KV to
that decode node's memsvc (zmq). Requests must answer, token for token, what
one normal-mode node answers, both decode nodes must have taken transfers, and
the prefill node must have sent one per request.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model_svc.tiny import write_tiny_checkpoint
from tests.http.test_http_front import POOL, Front, start_front, stop_and_check_clean
from tests.http.test_smg_normal import output_of, post, requests, run
from tests.procs import at_once
from tests.smg import start_smg

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    workdir = tmp_path_factory.mktemp("smg-pd")
    checkpoint = write_tiny_checkpoint(workdir / "ckpt")
    # four stacks start at once: their services may take minutes on busy cores
    args = ["--checkpoint", str(checkpoint), "--served-model-name", "tiny", *POOL]
    args += ["--ready-timeout", "400"]
    roles = {"prefill": "prefill", "decode1": "decode", "decode2": "decode", "single": "normal"}
    fronts: dict[str, Front] = {}
    router = None

    def start(name: str) -> Front:
        front = start_front(workdir, name, "--mode", roles[name], *args, timeout=480)
        fronts[name] = front
        return front

    try:
        at_once([lambda name=name: start(name) for name in roles])
        prefill = fronts["prefill"].url
        router = start_smg(
            workdir,
            "--pd-disaggregation",
            "--prefill",
            prefill,
            prefill.rsplit(":", 1)[1],  # the bootstrap port: the prefill node's HTTP port
            "--decode",
            fronts["decode1"].url,
            "--decode",
            fronts["decode2"].url,
            "--policy",
            "round_robin",
            num_workers=3,
        )
        yield fronts, router
    finally:
        if router is not None:
            router.stop()
        for front in fronts.values():
            stop_and_check_clean(front)


def memsvc_ops(front: Front, op: str) -> float:
    async def scrape() -> str:
        async with aiohttp.ClientSession() as http, http.get(f"{front.url}/metrics") as response:
            return await response.text()

    return sum(
        s.value
        for f in text_string_to_metric_families(asyncio.run(scrape()))
        if f.name == "memsvc_ops"
        for s in f.samples
        if s.name == "memsvc_ops_total" and s.labels.get("op") == op and s.labels["result"] == "ok"
    )


def test_smg_registers_the_prefill_and_decode_nodes(cluster) -> None:
    fronts, router = cluster
    workers = {w["url"]: w for w in router.workers()}
    prefill = workers[fronts["prefill"].url]
    assert prefill["worker_type"] == "prefill"
    assert prefill["bootstrap_port"] == int(fronts["prefill"].url.rsplit(":", 1)[1])
    for name in ("decode1", "decode2"):
        assert workers[fronts[name].url]["worker_type"] == "decode"
        assert workers[fronts[name].url]["labels"]["disaggregation_mode"] == "decode"
    assert all(w["is_healthy"] for w in workers.values())


def test_requests_through_smg_pd_answer_as_one_node(cluster) -> None:
    fronts, router = cluster
    single = fronts["single"].url
    sent_before = memsvc_ops(fronts["prefill"], "pd_send")
    expected_before = [memsvc_ops(fronts[n], "pd_expect") for n in ("decode1", "decode2")]

    async def go() -> list[tuple[Any, Any, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            out = []
            for route, body in requests():
                alone = output_of(route, body, *await post(http, single + route, body))
                routed = output_of(route, body, *await post(http, router.url + route, body))
                out.append(((route, body.get("stream", False)), alone, routed))
            return out

    pairs = run(go())
    for where, alone, routed in pairs:
        assert routed == alone, where
    # every request's KV went from the prefill node to one of the decode nodes
    assert memsvc_ops(fronts["prefill"], "pd_send") - sent_before == len(pairs)
    expected = [
        memsvc_ops(fronts[n], "pd_expect") - before
        for n, before in zip(("decode1", "decode2"), expected_before, strict=True)
    ]
    assert sum(expected) == len(pairs) and min(expected) > 0, expected


def test_a_node_not_in_pd_refuses_smgs_bootstrap_fields(cluster) -> None:
    fronts, _ = cluster
    body = {
        "text": "hi",
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 8998,
        "bootstrap_room": 12345,
    }

    async def go() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as http:
            return await post(http, fronts["single"].url + "/generate", body)

    status, answer = run(go())
    assert status == 400 and answer["error"]["code"] == "unsupported_field", answer


def test_a_decode_node_whose_prefill_node_is_gone_answers_an_error(cluster, tmp_path: Path) -> None:
    """A decode half whose bootstrap port answers nothing: a 502, not a hang."""
    fronts, _ = cluster
    body = {
        "text": "hi",
        "sampling_params": {"max_new_tokens": 2},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 9,  # discard: nothing listens
        "bootstrap_room": 777,
    }

    async def go() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as http:
            return await post(http, fronts["decode1"].url + "/generate", body)

    status, answer = run(go())
    assert status == 502 and answer["error"]["code"] == "bootstrap_failed", answer
