"""The tenant side channel, closed, through HTTP on SmolLM2 (issue 30, item 5).

Tenant A caches a long prompt. Another tenant (another ``cache_salt``, or none)
sending the same prompt gets ``cached_tokens`` 0 and no hit in any tier
(``cached_tokens_details``); A again hits, in the device tree and, once A's
prefix has been pushed out of the device, in the host and disk tiers. The same
holds for the default namespace against a salted one, for ``extra_key``, for a
batch ``/generate`` with a salt per prompt, for the OpenAI routes, for the
per-tenant ``/flush_cache`` and in PD mode. These are cache facts, not times:
``bench/tenancy.py`` measures what they mean for time to first token.
"""

from __future__ import annotations

import itertools
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.http.test_http_front import Front, start_front, stop_front
from tests.http.test_openai_smollm2 import memsvc_tokens
from tests.http.test_sglang_api import get, post

pytestmark = pytest.mark.timeout(900)

PAGE = 16
CAPACITY = 1024
POOL = ["--max-total-tokens", str(CAPACITY), "--page-size", str(PAGE)]
HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", "1"]
HICACHE += ["--hicache-disable-load-cost-model", "--hicache-storage-backend", "file"]
ONE = {"max_new_tokens": 1, "temperature": 0.0}
FLOOD = 6  # long prompts of other traffic: about 1800 tokens through a 1024-token device pool
_serial = itertools.count()


def long_text(tag: str) -> str:
    """A long prompt no other test sends (its first words differ)."""
    from kvstack.demo.workload import PASSAGE

    words = PASSAGE.split()
    return f"Case {tag} #{next(_serial)}. Summarize:\n\n" + " ".join(words)


def check_pool(front: Front) -> None:
    """Every page free or cached, none held by a request."""
    tokens = memsvc_tokens(front)
    assert tokens.get("used", 0) == 0, tokens
    assert tokens["available"] + tokens["evictable"] == CAPACITY, tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_checkpoint: Path) -> Any:
    workdir = tmp_path_factory.mktemp("tenancy")
    storage = ["--hicache-storage-dir", str(workdir / "disk")]
    args = ["--model-path", str(smollm2_checkpoint), *POOL, *HICACHE, *storage]
    front = start_front(workdir, "tenancy", *args, timeout=300)
    try:
        yield front
        check_pool(front)
    finally:
        assert stop_front(front, signal.SIGTERM) == 0, front.log()


def generate(front: Front, text: Any, **keys: Any) -> Any:
    """``/generate``'s answer (a list for a batch); one token, greedy."""
    status, reply = post(front, "/generate", {"text": text, "sampling_params": ONE, **keys})
    assert status == 200, reply
    return reply


def hits(reply: dict[str, Any]) -> tuple[int, dict[str, int]]:
    """``cached_tokens`` and the hit of each tier (all 0 when SGLang shows no details)."""
    meta = reply["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    tiers = {tier: int(details.get(tier, 0)) for tier in ("device", "host", "storage")}
    return int(meta["cached_tokens"]), tiers


def assert_no_hit(reply: dict[str, Any]) -> None:
    cached, tiers = hits(reply)
    assert cached == 0 and not any(tiers.values()), (cached, tiers)


def assert_hit(reply: dict[str, Any]) -> int:
    cached, tiers = hits(reply)
    prompt = int(reply["meta_info"]["prompt_tokens"])
    # the whole prompt but its last (partial) page and token, found in some tier
    assert cached >= (prompt - 1) // PAGE * PAGE - PAGE, (cached, prompt, tiers)
    assert sum(tiers.values()) == cached, (cached, tiers)
    return cached


def test_another_salt_sees_nothing_the_same_salt_hits(server: Front) -> None:
    text = long_text("salts")
    assert_no_hit(generate(server, text, cache_salt="tenant-a"))  # cold: A caches it
    assert_no_hit(generate(server, text, cache_salt="tenant-b"))
    assert_no_hit(generate(server, text, cache_salt="tenant-a", extra_key="x"))
    assert_no_hit(generate(server, text, extra_key="tenant-a"))  # extra_key is not the salt
    assert_hit(generate(server, text, cache_salt="tenant-a"))
    assert_hit(generate(server, text, cache_salt="tenant-b"))  # B's own copy, cached above
    check_pool(server)


def test_the_default_namespace_and_a_salted_one_do_not_share(server: Front) -> None:
    text = long_text("default")
    assert_no_hit(generate(server, text))  # the unsalted clients' namespace caches it
    assert_no_hit(generate(server, text, cache_salt="tenant-a"))
    assert_hit(generate(server, text, cache_salt=""))  # "" is no salt (SGLang's rule)
    assert_hit(generate(server, text))
    salted = long_text("salted-first")
    assert_no_hit(generate(server, salted, cache_salt="tenant-a"))
    assert_no_hit(generate(server, salted))
    check_pool(server)


def test_no_tier_serves_another_tenants_kv(server: Front) -> None:
    """A's prefix pushed off the device (into the host and disk tiers) by other
    traffic: B still finds nothing in any tier, A finds it below the device."""
    text = long_text("tiers")
    assert_no_hit(generate(server, text, cache_salt="tenant-a"))
    for i in range(FLOOD):
        generate(server, long_text(f"flood{i}"))
    assert_no_hit(generate(server, text, cache_salt="tenant-b"))
    cached, tiers = hits(generate(server, text, cache_salt="tenant-a"))
    assert cached > 0 and tiers["host"] + tiers["storage"] > 0, (cached, tiers)
    check_pool(server)


def test_a_batch_gives_each_prompt_its_own_salt(server: Front) -> None:
    text = long_text("batch")
    first = generate(server, [text, text], cache_salt=["tenant-x", "tenant-y"])
    assert all(r["meta_info"]["cached_tokens"] == 0 for r in first)  # no tenant had it
    again = generate(server, [text, text, text], cache_salt=["tenant-x", "tenant-z", "tenant-y"])
    assert_hit(again[0])
    assert_no_hit(again[1])
    assert_hit(again[2])
    status, reply = post(server, "/generate", {"text": [text, text], "cache_salt": ["a"]})
    assert status == 400, reply
    assert (
        reply["error"]["message"] == "The length of cache_salt should be equal to the batch size."
    )
    check_pool(server)


def test_the_openai_routes_cache_in_their_salts_namespace(server: Front, hf_tokenizer: Any) -> None:
    text = long_text("completions")
    status, reply = post(
        server, "/v1/completions", {"prompt": text, "max_tokens": 1, "cache_salt": "tenant-a"}
    )
    assert status == 200, reply
    assert_no_hit(generate(server, text, cache_salt="tenant-b"))
    assert_no_hit(generate(server, text))
    assert_hit(generate(server, text, cache_salt="tenant-a"))

    content = long_text("chat")
    messages = [{"role": "user", "content": content}]
    body = {"messages": messages, "max_tokens": 1, "cache_salt": "tenant-a"}
    status, reply = post(server, "/v1/chat/completions", body)
    assert status == 200, reply
    rendered = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    ids = hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]

    def probe(**keys: Any) -> dict[str, Any]:
        status, reply = post(
            server, "/generate", {"input_ids": ids, "sampling_params": ONE, **keys}
        )
        assert status == 200, reply
        return reply

    assert_no_hit(probe(cache_salt="tenant-b"))
    assert_no_hit(probe())
    assert hits(probe(cache_salt="tenant-a"))[0] >= len(ids) - 2 * PAGE
    status, reply = post(server, "/v1/chat/completions", {**body, "cache_salt": ["a"]})
    assert status == 400 and reply["param"] == "cache_salt", reply
    check_pool(server)


def test_flush_cache_with_a_salt_flushes_that_tenant_alone(server: Front) -> None:
    text = long_text("flush")
    for salt in ("tenant-a", "tenant-b"):
        assert_no_hit(generate(server, text, cache_salt=salt))
    status, reply = post(server, "/flush_cache?cache_salt=tenant-a", None)
    assert status == 200, reply
    assert_no_hit(generate(server, text, cache_salt="tenant-a"))  # in no tier any more
    assert_hit(generate(server, text, cache_salt="tenant-b"))
    status, reply = post(server, "/flush_cache", {"cache_salt": "tenant-b"})  # a JSON body
    assert status == 200, reply
    assert_no_hit(generate(server, text, cache_salt="tenant-b"))
    status, _ = get(server, "/flush_cache?cache_salt=tenant-a")
    assert status == 200
    status, reply = post(server, "/flush_cache", {"cache_salt": 3})
    assert status == 400, reply
    check_pool(server)


@pytest.fixture(scope="module")
def pd_server(tmp_path_factory: pytest.TempPathFactory, smollm2_checkpoint: Path) -> Any:
    workdir = tmp_path_factory.mktemp("tenancy-pd")
    # a larger pool than normal mode's: fewer LRU evictions between the test's probes
    pool = ["--max-total-tokens", "4096", "--page-size", str(PAGE)]
    args = ["--mode", "pd", "--model-path", str(smollm2_checkpoint), *pool]
    front = start_front(workdir, "tenancy-pd", *args, timeout=300)
    try:
        yield front
    finally:
        assert stop_front(front, signal.SIGTERM) == 0, front.log()


def test_pd_mode_keeps_tenants_apart(pd_server: Front) -> None:
    text = long_text("pd")
    assert_no_hit(generate(pd_server, text, cache_salt="tenant-a"))
    assert_no_hit(generate(pd_server, text, cache_salt="tenant-b"))
    assert_no_hit(generate(pd_server, text))
    cached, _ = hits(generate(pd_server, text, cache_salt="tenant-a"))
    assert cached > 0
    assert hits(generate(pd_server, text, cache_salt="tenant-b"))[0] > 0
    status, reply = post(pd_server, "/flush_cache", {"cache_salt": "tenant-a"})
    assert status == 200, reply
    assert_no_hit(generate(pd_server, text, cache_salt="tenant-a"))
    # B's copy outlives A's flush and A's re-prefill (it went missing in about 1 run of
    # 3 while an abort from the router could free a sent request's KV unpublished).
    assert hits(generate(pd_server, text, cache_salt="tenant-b"))[0] > 0
