"""Paged attention over the shared pool against the dense reference.

Both run in float32 (the pool has no float64) and the greedy tokens must be
identical. The tiny model's top-two logit gaps are far above float32 noise
(logits spread over several nats), so no tie flips; the logits themselves are
also compared, to 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from model_svc.reference import dense_logits, generate_dense
from model_svc.tiny import BOS_ID

NUM_NEW = 20


def encode(text: str) -> list[int]:
    return [BOS_ID, *text.encode()]


PROMPTS = {
    "short": encode("Hi"),
    "one": [BOS_ID],
    "medium": encode("The quick brown fox jumps over the lazy dog."),
    "long": encode("kvstack keeps the KV cache in its own process; " * 2),
    "utf8": encode("naïve café — ünïcödé"),
}


@pytest.fixture(scope="module")
def dense_outputs(tiny_model) -> dict[str, list[int]]:
    return {rid: generate_dense(tiny_model, ids, NUM_NEW) for rid, ids in PROMPTS.items()}


@pytest.mark.parametrize("page_size", [1, 16])
def test_batched_greedy_matches_dense(bound_pool, dense_outputs, page_size: int) -> None:
    bp = bound_pool(page_size)
    outputs = bp.generate(PROMPTS, NUM_NEW)
    assert outputs == dense_outputs
    for rid, output in outputs.items():
        bp.finish(rid, PROMPTS[rid], output)
    bp.pool.check_integrity(idle=True)


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_matches_dense(bound_pool, dense_outputs, page_size: int) -> None:
    bp = bound_pool(page_size)
    prompts = {rid: PROMPTS[rid] for rid in ("short", "medium", "utf8")}
    # 45 and 29 tokens in chunks of 17: 3 and 2 chunks, not page-aligned; "short" in one.
    outputs = bp.generate(prompts, NUM_NEW, chunk_size=17)
    assert outputs == {rid: dense_outputs[rid] for rid in prompts}
    for rid, output in outputs.items():
        bp.pool.release(rid, is_insert=False)
        assert output
    bp.pool.check_integrity(idle=True)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_reuse_matches_dense(bound_pool, tiny_model, page_size: int) -> None:
    bp = bound_pool(page_size)
    shared = encode("A shared system prompt, long enough for two pages. ")
    first, second, third = [*shared, *b"First?"], [*shared, *b"Second!"], [*shared, 65]

    out_first = bp.generate({"first": first}, NUM_NEW)["first"]
    bp.finish("first", first, out_first)

    # A finished request's KV, inserted into the tree, serves the next one.
    hit = bp.admit("second", second)
    assert hit >= len(shared) // page_size * page_size > 0
    out_second = bp.continue_decode(bp.prefill({"second": second}, {"second": hit}), NUM_NEW)
    out_second = out_second["second"]

    # A running request's KV, published with cache_unfinished, serves a third one
    # while both keep decoding in one batch.
    bp.pool.cache_unfinished("second", second + out_second[:-1])
    out_third = bp.generate({"third": third}, NUM_NEW // 2)["third"]
    both = bp.continue_decode({"second": out_second, "third": out_third}, NUM_NEW + 5)

    assert out_first == generate_dense(tiny_model, first, NUM_NEW)
    assert both["second"] == generate_dense(tiny_model, second, NUM_NEW + 5)
    assert both["third"] == generate_dense(tiny_model, third, NUM_NEW + 5)
    for rid, prompt in (("second", second), ("third", third)):
        bp.pool.check_integrity()
        bp.finish(rid, prompt, both[rid])
    bp.pool.check_integrity(idle=True)


def test_extend_and_decode_logits_match_dense(bound_pool, tiny_model) -> None:
    bp = bound_pool(16)
    prompts = {rid: PROMPTS[rid] for rid in ("medium", "long", "one")}
    for rid, ids in prompts.items():
        assert bp.admit(rid, ids) == 0
    logits = bp.extend(list(prompts.items()))
    nexts = [int(row.argmax()) for row in logits]
    decoded = bp.decode(list(prompts), nexts)
    for i, ids in enumerate(prompts.values()):
        want = dense_logits(tiny_model, [*ids, nexts[i]])
        torch.testing.assert_close(logits[i], want[-2], rtol=0, atol=1e-4)
        torch.testing.assert_close(decoded[i], want[-1], rtol=0, atol=1e-4)
    for rid in prompts:
        bp.pool.release(rid, is_insert=False)
    bp.pool.check_integrity(idle=True)
