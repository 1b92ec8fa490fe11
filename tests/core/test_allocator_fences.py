"""PageAllocator with copies in flight, as a hypothesis state machine.

Copies are stand-in fences that finish only when the test says so (or when
the allocator waits on them, which finishes them and every older one: copies
complete in issue order). The invariant: a page is never handed out while a
copy issued before it was freed is still running.
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from memsvc.core.allocator import OWNER_FREE, OWNER_PENDING, PageAllocator

NUM_PAGES = 12


class Copies:
    """Fences finishing in issue order."""

    def __init__(self) -> None:
        self.issued = 0
        self.finished = 0  # fences 1..finished are done

    def issue(self) -> ManualFence:
        self.issued += 1
        return ManualFence(self, self.issued)

    def finish_up_to(self, serial: int) -> None:
        self.finished = max(self.finished, serial)


class ManualFence:
    def __init__(self, copies: Copies, serial: int) -> None:
        self.copies, self.serial = copies, serial

    def done(self) -> bool:
        return self.serial <= self.copies.finished

    def wait(self) -> None:
        self.copies.finish_up_to(self.serial)

    def error(self) -> BaseException | None:
        return None


class AllocatorWithCopies(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES, page_size=4)
        self.copies = Copies()
        self.held: list[np.ndarray] = []
        # page -> serial of the newest copy issued before it was freed
        self.freed_behind: dict[int, int] = {}

    @rule(count=st.integers(0, NUM_PAGES))
    def allocate(self, count: int) -> None:
        could = self.alloc.num_free_pages >= count
        pages = self.alloc.alloc_pages(count, owner=1)
        assert (pages is not None) == could
        if pages is None:
            return
        for page in pages.tolist():
            serial = self.freed_behind.pop(page, 0)
            assert serial <= self.copies.finished, (
                f"page {page} handed out while copy {serial} that may read it still runs"
            )
        self.held.append(pages)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 100))
    def free(self, index: int) -> None:
        pages = self.held.pop(index % len(self.held))
        self.alloc.free_pages(pages, owner=1)
        for page in pages.tolist():
            self.freed_behind[page] = self.copies.issued

    @rule()
    def issue_copy(self) -> None:
        self.alloc.copy_issued(self.copies.issue())

    @precondition(lambda self: self.copies.issued > self.copies.finished)
    @rule(data=st.data())
    def finish_copies(self, data: st.DataObject) -> None:
        upto = data.draw(st.integers(self.copies.finished + 1, self.copies.issued))
        self.copies.finish_up_to(upto)

    @rule()
    def reclaim_without_waiting(self) -> None:
        finished = self.copies.finished
        self.alloc.reclaim()
        assert self.copies.finished == finished, "a reclaim without need waited on a copy"

    @invariant()
    def every_page_in_one_place(self) -> None:
        owners = np.array(self.alloc.owners())
        free = self.alloc.free_page_list()
        pending = self.alloc.pending_page_list()
        held = [p for pages in self.held for p in pages.tolist()]
        assert sorted(free + pending + held) == list(range(1, NUM_PAGES + 1))
        assert (owners[free] == OWNER_FREE).all() and (owners[pending] == OWNER_PENDING).all()
        assert self.alloc.num_free_pages == len(free) + len(pending)
        assert self.alloc.available_size() == 4 * (len(free) + len(pending))


AllocatorWithCopies.TestCase.settings = settings(max_examples=150, stateful_step_count=40)
TestAllocatorWithCopies = AllocatorWithCopies.TestCase
