"""A decode slot reserved ahead (the overlap schedule) and handed back unwritten.

The scheduler reserves step t+1's slot while step t runs. A request that
finishes at step t (or whose reservation must be given back before a retract)
hands its KV back with token ids one short of its ``kv_len``: the last
position's slot, and its page if that slot opened one, is freed, nothing of it
enters the tree.
"""

from __future__ import annotations

import numpy as np
import pytest

from memsvc.core.errors import InvalidArgumentError
from tests.core.test_pool import snapshot
from tests.helpers import small_layout

PAGE = 4


def running_request(pool, rid: str, prompt_len: int, decoded: int) -> np.ndarray:
    """Open ``rid``, prefill ``prompt_len`` tokens, decode ``decoded`` more, reserve one
    slot ahead; returns the token ids of its written KV (``kv_len - 1`` of them)."""
    pool.open_request(rid)
    tokens = np.arange(1000, 1000 + prompt_len + decoded)
    assert pool.match_prefix(rid, tokens[: prompt_len - 1]) == 0
    assert pool.alloc_extend([(rid, prompt_len)]) is not None
    for _ in range(decoded + 1):  # the last one is the reservation ahead
        assert pool.alloc_decode([rid]) is not None
    assert pool.request(rid).kv_len == tokens.size + 1
    return tokens


# kv_len before the reservation: a multiple of the page (the reserved slot opens a
# page, which must be freed) or not (the slot is on the request's last page).
@pytest.mark.parametrize("written", [8, 9, 11])
def test_release_one_short_frees_the_reserved_slot(make_pool, written: int) -> None:
    pool = make_pool(small_layout(page_size=PAGE, num_pages=16))
    tokens = running_request(pool, "a", 6, written - 6)
    assert tokens.size == written
    pages_before = np.count_nonzero(pool.allocator.owners() == pool.request("a").row)

    pool.release("a", tokens, is_insert=True)

    cached = written // PAGE * PAGE
    assert pool.evictable_size() == cached and pool.protected_size() == 0
    assert pool.available_size() + pool.evictable_size() == pool.capacity
    pool.check_integrity(idle=True)
    pool.open_request("b")  # the tree holds exactly the written, page-aligned tokens
    assert pool.match_prefix("b", np.append(tokens, 7)) == cached
    assert pages_before == -(-(written + 1) // PAGE)  # the reservation's page was counted
    pool.release("b", is_insert=False)
    pool.check_integrity(idle=True)


@pytest.mark.parametrize("written", [8, 10])
def test_publish_one_short_gives_the_slot_back_and_the_request_decodes_on(
    make_pool, written: int
) -> None:
    pool = make_pool(small_layout(page_size=PAGE, num_pages=16))
    tokens = running_request(pool, "a", 5, written - 5)
    available = pool.available_size()

    assert pool.cache_unfinished("a", tokens) == written // PAGE * PAGE
    assert pool.request("a").kv_len == written
    # The page the reservation opened (written % PAGE == 0) is free again.
    assert pool.available_size() == available + (PAGE if written % PAGE == 0 else 0)
    pool.check_integrity()
    assert pool.alloc_decode(["a"]) is not None  # the same position, reserved again
    pool.release("a", np.append(tokens, 5), is_insert=True)
    pool.check_integrity(idle=True)


def test_token_ids_two_short_are_refused_and_change_nothing(make_pool) -> None:
    pool = make_pool(small_layout(page_size=PAGE, num_pages=16))
    tokens = running_request(pool, "a", 6, 3)
    before = snapshot(pool)
    for call in (
        lambda: pool.release("a", tokens[:-1], is_insert=True),
        lambda: pool.cache_unfinished("a", tokens[:-1]),
        lambda: pool.release("a", np.append(tokens, [1, 2]), is_insert=True),
    ):
        with pytest.raises(InvalidArgumentError, match="has KV for 10 tokens"):
            call()
        assert snapshot(pool) == before
    pool.release("a", is_insert=False)
    pool.check_integrity(idle=True)
