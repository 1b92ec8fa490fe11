"""PageAllocator and the page arithmetic of extend / decode."""

from __future__ import annotations

import numpy as np
import pytest

from memsvc.core.allocator import (
    OWNER_TREE,
    PageAllocator,
    ceil_div,
    extend_slots,
    num_new_pages,
)
from memsvc.core.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidPageError,
    PageOwnershipError,
)


def assert_all_free(alloc: PageAllocator) -> None:
    assert alloc.available_size() == alloc.capacity
    assert sorted(alloc.free_page_list()) == list(range(1, alloc.num_pages + 1))


@pytest.mark.parametrize("page_size", [1, 16])
def test_alloc_takes_whole_pages_and_never_page_zero(page_size: int) -> None:
    alloc = PageAllocator(num_pages=8, page_size=page_size)
    slots = alloc.alloc(3 * page_size)
    assert slots is not None and slots.size == 3 * page_size
    pages = np.unique(slots // page_size)
    assert pages.size == 3 and 0 not in pages
    # each page's slots are its page_size consecutive offsets
    assert np.array_equal(slots % page_size, np.tile(np.arange(page_size), 3))
    assert alloc.available_size() == 5 * page_size
    alloc.free(slots)
    assert_all_free(alloc)


def test_alloc_is_all_or_nothing() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    assert alloc.alloc(10) is None
    assert alloc.alloc_pages(5) is None
    assert alloc.available_size() == 8
    taken = alloc.alloc(8)
    assert taken is not None and alloc.available_size() == 0
    assert alloc.alloc(2) is None
    alloc.free(taken)
    assert_all_free(alloc)


def test_freed_pages_are_reused_first() -> None:
    alloc = PageAllocator(num_pages=8, page_size=1)
    first = alloc.alloc_pages(3)
    assert first.tolist() == [1, 2, 3]
    alloc.free_pages(np.array([2]))
    assert alloc.alloc_pages(1).tolist() == [2]
    alloc.free_pages(np.array([1, 2, 3]))
    assert_all_free(alloc)


def test_alloc_needs_page_aligned_non_negative_size() -> None:
    alloc = PageAllocator(num_pages=4, page_size=4)
    with pytest.raises(InvalidArgumentError):
        alloc.alloc(3)
    with pytest.raises(InvalidArgumentError):
        alloc.alloc(-4)
    with pytest.raises(InvalidArgumentError):
        alloc.alloc_pages(-1)
    with pytest.raises(InvalidArgumentError):
        PageAllocator(num_pages=0, page_size=4)
    assert_all_free(alloc)


def test_bad_frees_raise_typed_errors_and_change_nothing() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    mine = alloc.alloc_pages(2, owner=7)
    tree = alloc.alloc_pages(1, owner=OWNER_TREE)
    free_before = alloc.free_page_list()
    owners_before = alloc.owners().copy()

    with pytest.raises(InvalidPageError):
        alloc.free_pages(np.array([0]))  # the reserved page
    with pytest.raises(InvalidPageError):
        alloc.free_pages(np.array([5]))  # past the end
    with pytest.raises(InvalidPageError):
        alloc.free(np.array([1]))  # slot 1 is on page 0
    with pytest.raises(DoubleFreeError):
        alloc.free_pages(np.array([int(mine[0]), 4]))  # 4 was never allocated
    with pytest.raises(PageOwnershipError, match="radix tree"):
        alloc.free_pages(tree, owner=7)  # a page held by the tree
    with pytest.raises(PageOwnershipError):
        alloc.set_owner(tree, 7, expected=7)

    assert alloc.free_page_list() == free_before
    assert np.array_equal(alloc.owners(), owners_before)
    alloc.free_pages(mine, owner=7)
    alloc.free_pages(tree, owner=OWNER_TREE)
    with pytest.raises(DoubleFreeError):
        alloc.free_pages(mine)
    assert_all_free(alloc)


def test_owner_view_is_read_only() -> None:
    alloc = PageAllocator(num_pages=2, page_size=1)
    with pytest.raises(ValueError):
        alloc.owners()[1] = 5


# -- page arithmetic: SGLang's alloc_extend / alloc_decode formulas ------------


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("start", "num_tokens"), [(0, 1), (0, 16), (0, 37), (5, 11), (16, 1), (15, 1), (17, 40)]
)
def test_extend_slots_three_parts(page_size: int, start: int, num_tokens: int) -> None:
    end = start + num_tokens
    pages_needed = num_new_pages(page_size, start, end)
    assert pages_needed == ceil_div(end, page_size) - ceil_div(start, page_size)
    last_page = 3
    last_slot = last_page * page_size + (start - 1) % page_size if start else 0
    new_pages = np.arange(10, 10 + pages_needed)
    slots = extend_slots(new_pages, page_size, start, num_tokens, last_slot)
    pos = np.arange(start, end)
    # every position sits at offset pos % page_size of its page
    assert np.array_equal(slots % page_size, pos % page_size)
    pages = slots // page_size
    in_old = pos < ceil_div(start, page_size) * page_size
    assert (pages[in_old] == last_page).all()  # part 1: rest of the partial page
    assert np.array_equal(np.unique(pages[~in_old]), new_pages)  # parts 2 and 3


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_pages_consumed_match_sglang(page_size: int) -> None:
    # alloc_decode consumes a page exactly when (seq_len_after - 1) % page_size == 0
    for kv_len in range(0, 3 * page_size + 2):
        expected = 1 if kv_len % page_size == 0 else 0
        assert num_new_pages(page_size, kv_len, kv_len + 1) == expected
