"""memsvc against hostile batches and replayed op ids (issue 18, defect 7), in process.

Each bad message gets a typed error, and the pool is as it was before it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig
from tests.helpers import small_layout
from tests.service.test_handlers import Caller, ids


@pytest.fixture
def service() -> Iterator[MemService]:
    layout = small_layout(page_size=4, num_pages=16, max_running_requests=4)
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes)
    try:
        yield MemService(pool, ServiceConfig(retract_decode_steps=20, max_message_bytes=1 << 20))
    finally:
        pool.close()


def _state(service: MemService) -> tuple[int, int, int]:
    pool = service.pool
    return pool.available_size(), pool.request("a").kv_len, pool.table.available_size()


@pytest.mark.parametrize(
    ("op", "fields"), [("decode_step", {}), ("retract", {"mode": "recompute"})]
)
def test_more_rows_than_the_table_has_is_an_invalid_argument(service, op, fields) -> None:
    c = Caller(service)
    c.hello()
    row = c.ok("alloc_row", rid="a")["row"]
    c.ok("alloc_extend", {"num_tokens": ids(6)}, rids=["a"])
    before = _state(service)
    rows = np.full(service.pool.table.num_rows * 2, row, dtype=np.int64)
    reply = c.call(op, {"rows": rows}, **fields)
    assert reply["ok"] is False and reply["code"] == "invalid_argument", reply
    assert "twice" in reply["message"]
    assert _state(service) == before
    c.ok("free_row", rid="a")
    c.ok("check", idle=True)


def test_a_replayed_op_id_with_another_body_is_refused(service) -> None:
    c = Caller(service)
    c.hello()
    first = c.call("alloc_row", op_id=500, rid="a")
    assert first["ok"]
    c.ok("alloc_extend", {"num_tokens": ids(6)}, rids=["a"])
    before = _state(service)
    other = c.call("alloc_row", op_id=500, rid="b")
    assert other["ok"] is False and other["code"] == "op_id_reused", other
    assert "500" in other["message"]
    arrays = c.call("alloc_extend", {"num_tokens": ids(4)}, op_id=501, rids=["a"])
    assert arrays["ok"]
    after_extend = _state(service)
    changed = c.call("alloc_extend", {"num_tokens": ids(8)}, op_id=501, rids=["a"])
    assert changed["ok"] is False and changed["code"] == "op_id_reused", changed
    assert _state(service) == after_extend != before
    assert not service.pool.is_open("b")
    # The same body again is a retry: its first reply, nothing done twice.
    again = c.call("alloc_row", op_id=500, rid="a")
    assert again == first
    c.ok("free_row", rid="a")
    c.ok("check", idle=True)
