"""SWAPageAllocator: full and SWA pages in lockstep, against a model, and unit cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from memsvc.core.allocator import OWNER_TREE
from memsvc.core.errors import DoubleFreeError, InvalidArgumentError, PageOwnershipError
from memsvc.core.swa_allocator import SWAPageAllocator
from memsvc.core.swa_check import _check_mapping


def assert_mapping(allocator: SWAPageAllocator) -> None:
    problems: list[str] = []
    _check_mapping(allocator, problems)
    assert not problems, problems


class AllocatorMachine(RuleBasedStateMachine):
    """The model: full page -> (owner, has an SWA page)."""

    @initialize(
        num_pages=st.integers(1, 12),
        swa_num_pages=st.integers(1, 12),
        page_size=st.sampled_from([1, 4]),
    )
    def setup(self, num_pages: int, swa_num_pages: int, page_size: int) -> None:
        self.allocator = SWAPageAllocator(num_pages, swa_num_pages, page_size)
        self.pages: dict[int, tuple[int, bool]] = {}

    def model_free(self) -> tuple[int, int]:
        full = self.allocator.num_pages - len(self.pages)
        swa = self.allocator.swa.num_pages - sum(has for _, has in self.pages.values())
        return full, swa

    @rule(num_pages=st.integers(0, 6), owner=st.integers(1, 3))
    def alloc(self, num_pages: int, owner: int) -> None:
        full, swa = self.model_free()
        pages = self.allocator.alloc_pages(num_pages, owner)
        if num_pages > min(full, swa):
            assert pages is None
            return
        assert pages is not None and pages.size == num_pages
        assert not set(pages.tolist()) & set(self.pages)
        swa_pages = self.allocator.full_to_swa_page[pages]
        assert (swa_pages != 0).all() and np.unique(swa_pages).size == num_pages
        for page in pages.tolist():
            self.pages[page] = (owner, True)

    @precondition(lambda self: self.pages)
    @rule(data=st.data())
    def free(self, data) -> None:
        owner = data.draw(st.sampled_from(sorted({o for o, _ in self.pages.values()})))
        held = sorted(p for p, (o, _) in self.pages.items() if o == owner)
        chosen = data.draw(st.lists(st.sampled_from(held), min_size=1, unique=True))
        self.allocator.free_pages(np.array(chosen), owner=owner)
        for page in chosen:
            del self.pages[page]
        assert not self.allocator.full_to_swa_page[chosen].any()

    @precondition(lambda self: self.pages)
    @rule(data=st.data())
    def free_swa(self, data) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.pages)), min_size=1, unique=True))
        freed = self.allocator.free_swa_pages(np.array(chosen))
        assert freed == sum(self.pages[p][1] for p in chosen)
        for page in chosen:
            self.pages[page] = (self.pages[page][0], False)

    @precondition(lambda self: self.pages)
    @rule(data=st.data())
    def to_tree(self, data) -> None:
        owner = data.draw(st.sampled_from(sorted({o for o, _ in self.pages.values()})))
        held = [p for p, (o, _) in self.pages.items() if o == owner]
        self.allocator.set_owner(np.array(held), OWNER_TREE, expected=owner)
        for page in held:
            self.pages[page] = (OWNER_TREE, self.pages[page][1])

    @invariant()
    def sizes_and_mapping(self) -> None:
        if not hasattr(self, "allocator"):
            return
        allocator, ps = self.allocator, self.allocator.page_size
        full, swa = self.model_free()
        assert allocator.full_available_size() == full * ps
        assert allocator.swa_available_size() == swa * ps
        assert allocator.available_size() == min(full, swa) * ps
        owners = allocator.owners()
        for page, (owner, has_swa) in self.pages.items():
            assert owners[page] == owner
            assert bool(allocator.full_to_swa_page[page]) == has_swa
        assert allocator.num_tree_swa_pages == sum(
            has for owner, has in self.pages.values() if owner == OWNER_TREE
        )
        assert_mapping(allocator)


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)
TestAllocatorProperties = AllocatorMachine.TestCase


def test_allocation_is_all_or_nothing_over_both_pools() -> None:
    allocator = SWAPageAllocator(num_pages=8, swa_num_pages=3, page_size=4)
    assert allocator.available_size() == 12 and allocator.full_available_size() == 32
    assert allocator.alloc_pages(4) is None  # the SWA pool is short: nothing taken
    assert allocator.full_available_size() == 32 and allocator.swa_available_size() == 12
    pages = allocator.alloc_pages(3, owner=1)
    assert pages.tolist() == [1, 2, 3]
    assert allocator.full_to_swa_page[1:4].tolist() == [1, 2, 3]
    # the window frees page 1's SWA page: the SWA pool can give one more, the full pool many
    assert allocator.free_swa_pages(np.array([1])) == 1
    assert allocator.free_swa_pages(np.array([1])) == 0  # already a tombstone
    assert allocator.available_size() == 4 and allocator.full_available_size() == 20
    more = allocator.alloc_pages(1, owner=2)
    assert allocator.full_to_swa_page[more].tolist() == [1]  # reused
    assert_mapping(allocator)
    with pytest.raises(PageOwnershipError):
        allocator.free_pages(pages, owner=2)
    allocator.free_pages(pages, owner=1)
    with pytest.raises(DoubleFreeError):
        allocator.free_pages(pages)
    with pytest.raises(InvalidArgumentError):
        allocator.free_swa_pages(pages)  # not allocated
    allocator.free_pages(more)
    assert allocator.full_available_size() == 32 and allocator.swa_available_size() == 12
    assert not allocator.full_to_swa_page.any()
    assert_mapping(allocator)
