"""KVPool: request lifecycle, decode-memory check, release rules, integrity."""

from __future__ import annotations

import numpy as np
import pytest

from memsvc.core.allocator import OWNER_TREE
from memsvc.core.errors import (
    DuplicateRequestError,
    IntegrityError,
    InvalidArgumentError,
    OutOfRowsError,
    UnknownRequestError,
)
from tests.helpers import small_layout


def snapshot(pool) -> tuple:
    return (
        pool.available_size(),
        pool.evictable_size(),
        pool.protected_size(),
        tuple(sorted(pool.open_rids())),
        tuple(pool.allocator.owners().tolist()),
        pool.host_store.used_bytes,
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_request_lifecycle_with_prefix_reuse(make_pool, page_size: int) -> None:
    pool = make_pool(small_layout(page_size=page_size, num_pages=512 // page_size))
    prompt = np.arange(100, 100 + 3 * page_size + 5)

    pool.open_request("a")
    assert pool.match_prefix("a", prompt[:-1]) == 0
    pool.alloc_extend([("a", prompt.size)])
    generated = [7, 8, 9]
    for _ in generated:
        assert pool.alloc_decode(["a"]) is not None
    tokens = np.concatenate([prompt, generated])
    assert pool.request("a").kv_len == tokens.size
    pool.check_integrity()

    aligned = tokens.size // page_size * page_size
    assert pool.cache_unfinished("a", tokens) == aligned
    assert pool.protected_size() == aligned and pool.evictable_size() == 0
    pool.check_integrity()

    pool.open_request("b")
    hit = pool.match_prefix("b", prompt[:-1])
    assert hit == (prompt.size - 1) // page_size * page_size
    assert np.array_equal(pool.slots("b"), pool.slots("a", 0, hit))
    pool.check_integrity()

    pool.release("a", tokens, is_insert=True)
    pool.release("b", is_insert=False)
    assert pool.protected_size() == 0 and pool.evictable_size() == aligned
    pool.check_integrity(idle=True)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_tokens_required_counts_requests_opening_a_page(make_pool, page_size) -> None:
    pool = make_pool(small_layout(page_size=page_size, num_pages=1024 // page_size))
    lengths = {"a": page_size, "b": page_size + 1, "c": 2 * page_size, "d": 3}
    for rid, n in lengths.items():
        pool.open_request(rid)
        pool.alloc_extend([(rid, n)])
    expected = page_size * sum(1 for n in lengths.values() if n % page_size == 0)
    assert pool.decode_tokens_required(lengths) == expected
    if page_size == 1:
        assert expected == len(lengths)  # page_size 1: simply the batch size
    pages_before = pool.allocator.num_free_pages
    assert pool.alloc_decode(list(lengths)) is not None
    assert pages_before - pool.allocator.num_free_pages == expected // page_size
    for rid in lengths:
        pool.release(rid, is_insert=False)
    pool.check_integrity(idle=True)


def fill_tree_with_one_page_leaves(pool, num_leaves: int) -> None:
    """``num_leaves`` single-page evictable leaves under the root."""
    ps = pool.page_size
    for i in range(num_leaves):
        rid = f"leaf{i}"
        pool.open_request(rid)
        pool.alloc_extend([(rid, ps)])
        pool.release(rid, np.full(ps, 1000 + i), is_insert=True)


def test_check_decode_mem_evicts_only_the_shortfall(make_pool) -> None:
    pool = make_pool(small_layout(page_size=4, num_pages=12))
    fill_tree_with_one_page_leaves(pool, 8)
    pool.open_request("x")
    pool.alloc_extend([("x", 12)])  # 3 pages; 1 page left free
    pool.open_request("y")
    pool.alloc_extend([("y", 4)])  # the last free page
    assert pool.available_size() == 0 and pool.evictable_size() == 32
    # both at a page boundary: the step needs 2 pages, all of it from the tree
    assert pool.check_decode_mem(["x", "y"])
    assert pool.available_size() == 8 and pool.evictable_size() == 24
    # a second check with room already there evicts nothing
    assert pool.check_decode_mem(["x", "y"])
    assert pool.evictable_size() == 24
    # LRU: the oldest leaves went first
    assert pool.tree.match_prefix(np.full(4, 1000)).slots.size == 0
    assert pool.tree.match_prefix(np.full(4, 1007)).slots.size == 4
    pool.release("x", is_insert=False)
    pool.release("y", is_insert=False)
    pool.check_integrity(idle=True)


def test_check_decode_mem_fails_without_changing_requests(make_pool) -> None:
    pool = make_pool(small_layout(page_size=4, num_pages=4))
    for rid in ("a", "b"):
        pool.open_request(rid)
        pool.alloc_extend([(rid, 8)])
    assert not pool.check_decode_mem(["a", "b"])
    before = snapshot(pool)
    assert pool.alloc_decode(["a", "b"]) is None
    assert snapshot(pool) == before
    assert pool.check_decode_mem(["a"]) is False
    pool.release("b", is_insert=False)
    assert pool.check_decode_mem(["a"])
    pool.release("a", is_insert=False)
    pool.check_integrity(idle=True)


def test_alloc_extend_is_all_or_nothing_across_the_batch(make_pool) -> None:
    pool = make_pool(small_layout(page_size=4, num_pages=6))
    pool.open_request("a")
    pool.open_request("b")
    before = snapshot(pool)
    assert pool.alloc_extend([("a", 8), ("b", 17)]) is None
    assert snapshot(pool) == before and pool.request("a").kv_len == 0
    out = pool.alloc_extend([("a", 8), ("b", 16)])
    assert out.size == 24
    assert np.array_equal(out, np.concatenate([pool.slots("a"), pool.slots("b")]))
    pool.release("a", is_insert=False)
    pool.release("b", is_insert=False)
    pool.check_integrity(idle=True)


def test_retract_release_keeps_the_prefix_unlocked_and_frees_the_rest(make_pool) -> None:
    """release(is_insert=False): nothing inserted, tree prefix stays but unlocked."""
    pool = make_pool(small_layout(page_size=4, num_pages=32))
    prompt = np.arange(1, 14)  # 13 tokens
    pool.open_request("a")
    pool.alloc_extend([("a", prompt.size)])
    pool.cache_unfinished("a", prompt)  # 12 tokens published, 1 own tail token
    for _ in range(6):
        pool.alloc_decode(["a"])
    tokens = np.concatenate([prompt, np.arange(50, 56)])
    assert pool.protected_size() == 12 and pool.held_size() == 8  # tail page + 1 new page
    pool.release("a", is_insert=False)
    assert pool.protected_size() == 0 and pool.evictable_size() == 12
    assert pool.available_size() == pool.capacity - 12
    # re-admission finds the prompt prefix again: only the tail is recomputed
    pool.open_request("a")
    assert pool.match_prefix("a", tokens[:-1]) == 12
    pool.release("a", is_insert=False)
    pool.check_integrity(idle=True)


def test_insert_frees_duplicates_and_tail(make_pool) -> None:
    pool = make_pool(small_layout(page_size=4, num_pages=32))
    tokens = np.arange(1, 11)  # 10 tokens: 8 aligned + 2 tail
    for rid in ("a", "b"):  # the same text computed twice, no sharing
        pool.open_request(rid)
        pool.alloc_extend([(rid, tokens.size)])
    pool.release("a", tokens, is_insert=True)
    assert pool.evictable_size() == 8
    pool.release("b", tokens, is_insert=True)  # b's 8 aligned tokens are duplicates
    assert pool.evictable_size() == 8
    assert pool.available_size() == pool.capacity - 8
    pool.check_integrity(idle=True)


def test_disabled_radix_cache_reuses_nothing(make_pool) -> None:
    pool = make_pool(small_layout(page_size=4), disable_radix_cache=True)
    tokens = np.arange(1, 20)
    pool.open_request("a")
    pool.alloc_extend([("a", tokens.size)])
    assert pool.cache_unfinished("a", tokens) == 0
    pool.release("a", tokens, is_insert=True)
    assert pool.evictable_size() == 0 and pool.available_size() == pool.capacity
    pool.open_request("b")
    assert pool.match_prefix("b", tokens) == 0
    pool.release("b", is_insert=False)
    pool.check_integrity(idle=True)


def test_bad_input_raises_typed_errors_and_changes_nothing(make_pool) -> None:
    pool = make_pool(small_layout(page_size=4, max_running_requests=2, max_context_len=16))
    pool.open_request("a")
    pool.alloc_extend([("a", 5)])
    pool.open_request("b")
    before = snapshot(pool)
    bad_calls = [
        (DuplicateRequestError, lambda: pool.open_request("a")),
        (OutOfRowsError, lambda: pool.open_request("c")),
        (UnknownRequestError, lambda: pool.alloc_extend([("zzz", 1)])),
        (UnknownRequestError, lambda: pool.release("zzz")),
        (InvalidArgumentError, lambda: pool.alloc_extend([("b", -1)])),
        (InvalidArgumentError, lambda: pool.alloc_extend([("b", 17)])),  # > max_context_len
        (InvalidArgumentError, lambda: pool.alloc_extend([("b", 1), ("b", 1)])),
        (InvalidArgumentError, lambda: pool.release("a", [1, 2], is_insert=True)),
        (InvalidArgumentError, lambda: pool.release("a", is_insert=True)),
        (InvalidArgumentError, lambda: pool.cache_unfinished("a", [[1, 2]])),
        (InvalidArgumentError, lambda: pool.match_prefix("a", [1, 2, 3])),  # holds KV
        (InvalidArgumentError, lambda: pool.slots("a", 0, 6)),
        (InvalidArgumentError, lambda: pool.evict(-1)),
    ]
    for error, call in bad_calls:
        with pytest.raises(error):
            call()
        assert snapshot(pool) == before, f"{error.__name__} call changed state"
    pool.check_integrity()
    pool.release("a", is_insert=False)
    pool.release("b", is_insert=False)
    pool.check_integrity(idle=True)


# -- the integrity check itself must be able to fail -----------------------------


def test_integrity_catches_a_page_freed_behind_the_pools_back(make_pool) -> None:
    pool = make_pool()
    pool.open_request("a")
    slots = pool.alloc_extend([("a", 8)])
    pool.allocator.free(slots[:1])  # the request still points at it
    with pytest.raises(IntegrityError, match="holds pages it does not own"):
        pool.check_integrity()


def test_integrity_catches_a_leaked_page(make_pool) -> None:
    pool = make_pool()
    pool.allocator.alloc_pages(1, owner=5)  # nobody in row 5
    with pytest.raises(IntegrityError, match="closed rows"):
        pool.check_integrity()


def test_integrity_catches_a_page_in_tree_and_free_list(make_pool) -> None:
    pool = make_pool()
    pool.open_request("a")
    pool.alloc_extend([("a", 8)])
    pool.release("a", np.arange(8), is_insert=True)
    node = next(pool.tree.iter_nodes())
    pool.allocator.free_pages(node.value[:1] // pool.page_size, owner=OWNER_TREE)
    with pytest.raises(IntegrityError, match="tree nodes and owner tags disagree"):
        pool.check_integrity()


def test_integrity_catches_wrong_lock_counts_and_busy_idle(make_pool) -> None:
    pool = make_pool()
    pool.open_request("a")
    pool.alloc_extend([("a", 8)])
    pool.cache_unfinished("a", np.arange(8))
    with pytest.raises(IntegrityError, match="idle but 1 requests are open"):
        pool.check_integrity(idle=True)
    pool.request("a").last_node = pool.tree.root  # forget the lock it holds
    with pytest.raises(IntegrityError, match="lock_ref"):
        pool.check_integrity()


# -- retract (the core of the memsvc `retract` op) -------------------------------


def open_running(pool, lengths: dict[str, int]) -> list[int]:
    rows = []
    for rid, n in lengths.items():
        rows.append(pool.open_request(rid))
        pool.alloc_extend([(rid, n)])
    return rows


def test_retract_always_takes_one_when_memory_is_fine(make_pool) -> None:
    pool = make_pool(small_layout(page_size=4, num_pages=64))
    rows = open_running(pool, {"keep": 8, "victim": 8})
    result = pool.retract(rows, offload=False, retract_decode_steps=20)
    assert result.retracted == ["victim"] and not result.last_does_not_fit
    assert pool.open_rids() == ["keep"]
    pool.release("keep", is_insert=False)
    pool.check_integrity(idle=True)


def test_retract_pops_from_the_end_until_the_step_fits(make_pool) -> None:
    pool = make_pool(small_layout(page_size=4, num_pages=8))
    rows = open_running(pool, {"a": 8, "b": 8, "c": 8, "d": 8})  # all 8 pages used
    result = pool.retract(rows, offload=False, retract_decode_steps=0)
    # each of the 4 needs a page; releasing d (2 pages) leaves 3 needing 3 pages: not enough;
    # releasing c too frees 4 pages for 2 requests needing 2.
    assert result.retracted == ["d", "c"]
    assert result.tokens_gained == 16 and not result.last_does_not_fit
    assert pool.alloc_decode(["a", "b"]) is not None
    for rid in ("a", "b"):
        pool.release(rid, is_insert=False)
    pool.check_integrity(idle=True)


def test_retract_never_takes_the_last_and_reports_it_does_not_fit(make_pool) -> None:
    pool = make_pool(small_layout(page_size=4, num_pages=4))
    rows = open_running(pool, {"big": 12, "small": 4})
    result = pool.retract(rows, offload=False, retract_decode_steps=20)
    assert result.retracted == ["small"]
    # big needs a 4th page for its next token; small's one page is free now: it fits
    assert not result.last_does_not_fit
    pool.alloc_decode(["big"])
    for _ in range(3):
        pool.alloc_decode(["big"])
    assert pool.available_size() == 0
    lone = pool.retract([pool.request("big").row], offload=False, retract_decode_steps=20)
    assert lone.retracted == [] and lone.last_does_not_fit
    assert pool.open_rids() == ["big"]
    pool.release("big", is_insert=False)
    pool.check_integrity(idle=True)


def test_retract_offload_parks_kv_and_reports_store_full(make_pool) -> None:
    layout = small_layout(page_size=4, num_pages=8)
    pool = make_pool(layout, host_store_bytes=2 * layout.bytes_per_page)
    rows = open_running(pool, {"a": 8, "b": 8, "c": 8, "d": 8})
    result = pool.retract(rows, offload=True, retract_decode_steps=0)
    assert result.retracted == ["d"] and result.offload_failed == ["c"]
    assert "d" in pool.host_store and "c" not in pool.host_store
    assert result.offloaded_bytes == 2 * layout.bytes_per_page  # d's, not the failed c's
    pool.alloc_extend([("a", 8), ("b", 8)])  # take the 4 freed pages
    pool.open_request("d")
    assert pool.load("d") is None  # no room: nothing changed
    assert "d" in pool.host_store and pool.request("d").kv_len == 0
    pool.release("b", is_insert=False)
    assert pool.load("d").size == 8
    for rid in ("a", "d"):
        pool.release(rid, is_insert=False)
    pool.check_integrity(idle=True)


def test_retract_evicts_remaining_times_decode_steps_after_each_release(make_pool) -> None:
    pool = make_pool(small_layout(page_size=1, num_pages=64))
    fill_tree_with_one_page_leaves(pool, 40)  # 40 evictable tokens
    rows = open_running(pool, {"a": 4, "b": 4, "c": 4})  # 12 used, 12 free
    result = pool.retract(rows, offload=False, retract_decode_steps=10)
    assert result.retracted == ["c"]
    # after releasing c: 16 free; 2 remain x 10 steps = 20 wanted, so 4 are evicted
    assert pool.available_size() == 20 and pool.evictable_size() == 36
    for rid in ("a", "b"):
        pool.release(rid, is_insert=False)
    pool.check_integrity(idle=True)


# -- where kvstack keeps a difference from SGLang on purpose (docs/sglang-differences.md) --


def test_allocation_evicts_only_the_pages_it_takes(make_pool) -> None:
    """SGLang's decode allocation evicts room for batch × page_size and its extend for
    extend + batch × page_size; memsvc knows the exact page count first and evicts only
    the shortfall of that (the same fit, more of the cache kept)."""
    pool = make_pool(small_layout(page_size=4, num_pages=13))
    fill_tree_with_one_page_leaves(pool, 8)
    pool.open_request("x")
    pool.alloc_extend([("x", 12)])  # at a page boundary: its next token opens a page
    pool.open_request("y")
    pool.alloc_extend([("y", 5)])  # inside a page
    assert pool.available_size() == 0 and pool.evictable_size() == 32
    assert pool.alloc_decode(["x", "y"]) is not None
    assert pool.evictable_size() == 28  # one page, not 2 × 4 tokens
    assert pool.alloc_extend([("y", 3)]) is not None  # 6 -> 9 tokens: one new page
    assert pool.evictable_size() == 24  # not 3 + 2 × 4 tokens' worth
    pool.release("x", is_insert=False)
    pool.release("y", is_insert=False)
    pool.check_integrity(idle=True)


def test_publish_splits_at_the_prompt_only_where_the_prompt_was_published(make_pool) -> None:
    """SGLang 0.5.23 splits a published key at the prompt boundary. kvstack publishes the
    prompt as soon as its prefill completes, so that boundary already exists for a
    request's first attempt (its output leaf is evicted before its prompt); a retracted
    request re-prefilled from nothing publishes prompt and output as one node."""
    pool = make_pool(small_layout(page_size=4, num_pages=16))
    prompt = np.arange(100, 108)
    pool.open_request("a")
    pool.match_prefix("a", prompt[:-1])
    pool.alloc_extend([("a", prompt.size)])
    pool.cache_unfinished("a", prompt)
    output = np.arange(500, 505)
    for _ in output:
        pool.alloc_decode(["a"])
    pool.release("a", np.concatenate([prompt, output]), is_insert=True)
    assert pool.evict(1) == 4  # the output's page went; the prompt is still cached
    assert pool.tree.match_prefix(prompt).slots.size == 8
    assert pool.evict(pool.capacity) == 8

    fill = np.concatenate([prompt, output])  # a cold re-prefill of prompt + output
    pool.open_request("b")
    pool.match_prefix("b", fill[:-1])
    pool.alloc_extend([("b", fill.size)])
    pool.cache_unfinished("b", fill)
    pool.release("b", is_insert=False)
    assert pool.evict(1) == 12  # one node: the prompt goes with the output
    pool.check_integrity(idle=True)
