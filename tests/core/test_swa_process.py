"""A hybrid memsvc as a real process: flags -> two pools, the client's sizes and admit,
and a worker process that reaches the SWA pool zero-copy."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memsvc.client import MemClient
from tests.service.test_memsvc_process import run_child

F, S = "full_attention", "sliding_attention"


@pytest.fixture
def hybrid_memsvc(memsvc_factory):
    # SMALL_POOL: 1 layer, 64 pages of 4; here 2 layers, one sliding, r = 0.5:
    # F = int(64 * 4 * 2 / 1.5) = 341 -> 85 pages, S = int(341 * 0.5) = 170 -> 42 pages
    flags = ["--num-layers", "2", "--layer-types", f"{S},{F}", "--sliding-window", "6"]
    return memsvc_factory(*flags, "--swa-full-tokens-ratio", "0.5")


def test_a_worker_reads_the_swa_pool_through_the_full_to_swa_table(hybrid_memsvc) -> None:
    with MemClient(hybrid_memsvc.address) as mem:
        layout = mem.layout
        assert layout.is_hybrid and (layout.num_pages, layout.swa_num_pages) == (85, 42)
        assert layout.sliding_window == 6 and layout.swa_layer_ids == (0,)
        row = mem.alloc_row("r")
        assert mem.alloc_extend([("r", 10)]).fits
        sizes = mem.sizes
        assert sizes.full_available == 340 - 12 and sizes.swa_available == 168 - 12
        assert sizes.available == 168 - 12 and sizes.swa_evictable == 0
        for _ in range(3):
            assert mem.decode_step([row]).fits
        # kv_len 13; the last step started at 12, the one before at 11: freed up to
        # floor_page(11 + 1 - 6) = 4, one SWA page back
        assert mem.sizes.swa_available == 168 - 16 + 4
        worker = run_child(
            """
            import json, sys
            from memsvc.client import MemClient
            with MemClient(sys.argv[1], role="worker") as mem, mem.attach() as pool:
                table, f2s = pool.req_to_token_torch(), pool.full_to_swa_page_torch()
                swa, kv = pool.swa_kv_torch(), pool.kv_torch()
                row, ps = int(sys.argv[2]), pool.layout.page_size
                out = []
                for pos in range(13):
                    slot = int(table[row, pos])
                    swa_page = int(f2s[slot // ps])
                    out.append(swa_page)
                    kv[slot // ps, 0, :, slot % ps] = pos
                    if swa_page:
                        swa[swa_page, 0, :, slot % ps] = pos + 0.5
                print(json.dumps(out))
            """,
            hybrid_memsvc.address,
            str(row),
        )
        assert worker.returncode == 0, worker.stderr
        swa_pages = np.array(json.loads(worker.stdout))
        assert (swa_pages[:4] == 0).all() and (swa_pages[4:] != 0).all()
        with mem.attach() as pool:
            slots = pool.req_to_token[row, :13].astype(np.int64)
            swa_slots = pool.full_to_swa_page[slots // 4] * 4 + slots % 4
            got = pool.swa_kv[swa_slots[4:] // 4, 0, 0, swa_slots[4:] % 4, 0, 0]
            assert got.tolist() == [p + 0.5 for p in range(4, 13)]
        mem.release("r", np.arange(13))
        admitted = mem.admit([("a", np.arange(13)), ("b", np.arange(5))])
        # a's match to 12 needs [4, 12) with SWA: held; b's to 4 needs [0, 4): gone
        assert [m.prefix_len for m in admitted.matches] == [12, 0]
        assert [m.swa_pinned for m in admitted.matches] == [8, 0]
        assert admitted.before.swa_evictable == 8 and admitted.before.full_available == 340 - 12
        mem.free_row("a")
        mem.free_row("b")
        mem.check(idle=True)
