"""Two ``kvstack serve`` nodes sharing the storage tier on one Mooncake master (issue 31).

A prompt prefilled on node A is a storage hit on node B (``cached_tokens_details``
in ``/generate``'s meta_info): B's match continues the prompt's hash chain through
the shared store and loads A's pages, verified; B's output is token-identical to
A's. Both nodes end idle (every page free or cached), the master is always reaped.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model_svc.tiny import write_tiny_checkpoint
from tests.http.test_http_front import start_front, stop_and_check_clean
from tests.http.test_openai_smollm2 import memsvc_tokens
from tests.http.test_sglang_api import post
from tests.mooncake_master import start_master

pytestmark = pytest.mark.timeout(300)

PAGE, CAPACITY = 4, 1024
POOL = ["--page-size", str(PAGE), "--num-pages", str(CAPACITY // PAGE), "--max-context-len", "2048"]
HICACHE = ["--enable-hierarchical-cache", "--hicache-write-policy", "write_through"]
HICACHE += ["--hicache-disable-load-cost-model", "--hicache-storage-backend", "mooncake"]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def generate(front, text: str) -> dict:
    status, reply = post(front, "/generate", {"text": text, "sampling_params": GREEDY})
    assert status == 200, reply
    return reply


def details(reply: dict) -> dict[str, int]:
    return reply["meta_info"].get("cached_tokens_details") or {}


def storage_writes(front) -> tuple[float, float]:
    """Node ``front``'s storage writes: (bytes issued, bytes whose write completed)."""

    async def scrape() -> str:
        async with aiohttp.ClientSession() as http, http.get(f"{front.url}/metrics") as response:
            return await response.text()

    values = {
        s.name: s.value
        for f in text_string_to_metric_families(asyncio.run(scrape()))
        for s in f.samples
        if s.name.startswith("kvstack_hicache_storage_writ")
    }
    issued = values.get("kvstack_hicache_storage_write_bytes_total", 0.0)
    return issued, values.get("kvstack_hicache_storage_written_bytes_total", 0.0)


def wait_for_storage_writes(front, timeout_s: float = 60.0) -> None:
    """Wait until every page ``front`` issued to the shared tier is in it: its copy
    thread writes after the request has answered."""
    deadline = time.monotonic() + timeout_s
    while True:
        issued, written = storage_writes(front)
        if issued > 0 and written >= issued:
            return
        assert time.monotonic() < deadline, (
            f"node {front.url}'s storage writes did not complete in {timeout_s} s: "
            f"{written:.0f} of {issued:.0f} bytes written"
        )
        time.sleep(0.05)


def check_pool(front) -> None:
    tokens = memsvc_tokens(front)
    assert tokens.get("used", 0) == 0, tokens
    assert tokens["available"] + tokens["evictable"] == CAPACITY, tokens


def test_a_prompt_prefilled_on_node_a_is_a_storage_hit_on_node_b(tmp_path, monkeypatch):
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt")
    with start_master(tmp_path) as master:
        config = tmp_path / "mooncake.json"
        config.write_text(json.dumps(master.config("serve")))
        monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(config))
        args = ["--checkpoint", str(checkpoint), "--served-model-name", "tiny", *POOL, *HICACHE]
        fronts = []
        try:
            for name in ("a", "b"):
                fronts.append(start_front(tmp_path, name, *args, timeout=180))
            a, b = fronts
            text = "kvstack nodes share one tier on Mooncake Store. " * 4
            first = generate(a, text)
            assert not details(first).get("storage"), first["meta_info"]
            wait_for_storage_writes(a)
            again = generate(b, text)
            prompt = int(again["meta_info"]["prompt_tokens"])
            storage = details(again).get("storage", 0)
            assert storage >= (prompt - 1) // PAGE * PAGE - PAGE, again["meta_info"]
            assert again["meta_info"]["cached_tokens"] == storage  # B held none of it
            assert again["output_ids"] == first["output_ids"]
            other = generate(b, "Another prompt, never seen by either node, " * 3)
            assert not details(other).get("storage"), other["meta_info"]
            for front in fronts:
                check_pool(front)
        finally:
            for front in fronts:
                if front.proc.poll() is None:
                    stop_and_check_clean(front)
                else:
                    front.proc.send_signal(signal.SIGKILL)
