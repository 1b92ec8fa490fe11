"""The hierarchical cache's backups stay off the allocation path: a write-through backup
holds back only the device pages it reads (``allocator.copy_reads``), so a request's
pages freed while it runs are free at once, and the node's own pages, if evicted before
it ends, wait for it."""

from __future__ import annotations

from tests.core.test_hicache import SlowCopies, finish, make_pool, run_request, seq


def test_a_backup_in_flight_holds_back_only_the_pages_it_reads():
    pool = make_pool(num_pages=5)
    tree = pool.hicache
    slow = SlowCopies(pool)
    a = seq(90, 3)  # 13 tokens: 3 pages into the tree, the last token's page freed
    run_request(pool, "a", a)  # write_through: a's backup is issued and held
    assert tree.host_used_tokens() == 12
    backup = tree.copies._last_fence
    assert not backup.done()
    # a's last page, which the backup does not read, is free now, not pending behind it
    assert pool.allocator.num_pending_pages == 0
    pool.open_request("b")
    assert pool.match_prefix_tiers("b", seq(91, 2)[:-1]).prefix_len == 0
    assert pool.alloc_extend([("b", 8)], evict=False) is not None  # the 2 free pages
    assert not backup.done()  # nothing waited for it
    pool.release("b", is_insert=False)
    # a's own pages, evicted while the backup still reads them, wait for it
    assert pool.evict(12) == 12
    assert pool.allocator.num_pending_pages == 3
    pool.check_integrity()
    slow.gate.set()
    pool.settle_copies()
    assert pool.allocator.num_pending_pages == 0
    m = run_request(pool, "a2", a)  # its KV read back from host, value by value
    assert (m.prefix_len, m.host_tokens) == (12, 12)
    finish(pool)
