"""In process (memsvc's sliding-window KVPool with the hierarchical cache + the worker):
a conversation's history pushed off the device comes back from the host tier with its
SWA tail (full KV of every position, the window's SWA KV), the device pools poisoned
meanwhile, and the next turn's greedy tokens equal transformers' past 3 x W. Both the
hybrid Ministral and the pure sliding-window Mistral (its full pages hold no bytes: the
host hit is its SWA tail alone)."""

from __future__ import annotations

import numpy as np
import pytest

from memsvc.core.hicache import HiCacheConfig
from memsvc.core.swa_host_store import swa_pool_layout
from tests.model.driver import model_layout
from tests.model.swa_oracle import (
    KINDS,
    WINDOW,
    HybridBound,
    hf_greedy,
    hybrid_layout_fields,
    prompt,
)

PAGE = 4


@pytest.mark.parametrize("kind", KINDS)
def test_a_host_hit_with_its_swa_tail_gives_transformers_tokens(
    make_pool, swa_models, hf_swa_models, kind: str
) -> None:
    model = swa_models[kind]
    layout = model_layout(
        model.config, PAGE, **hybrid_layout_fields(model.config), swa_num_pages=128
    )
    assert (layout.bytes_per_page == 0) == (kind == "pure")
    config = HiCacheConfig(
        # the host tier's bytes per page: the full pool's, or the SWA pool's (pure)
        size_bytes=256 * (layout.bytes_per_page or swa_pool_layout(layout).bytes_per_page),
        write_policy="write_through",
        disable_load_cost_model=True,
    )
    pool = make_pool(layout, hicache=config)
    bound = HybridBound.attach(pool, model)
    try:
        first = prompt(100, 31)
        reply = bound.generate({"a": first}, 20)["a"]
        assert reply == hf_greedy(hf_swa_models[kind], first, 20)
        bound.finish("a", first, reply)  # its KV (119 tokens) into the tree, backed up
        pool.evict(pool.capacity)  # the history off the device: host copies alone
        pool.settle_copies()
        pool.buffers.kv[:] = np.nan  # whatever the load does not restore is poison
        pool.buffers.swa_kv[:] = np.nan
        pool.check_integrity()

        second = first + reply + prompt(12, 32)
        pool.open_request("b")
        match = pool.match_prefix_tiers("b", second[:-1])
        assert match.prefix_len == 116 and match.host_tokens == 116  # floor_page(119)
        assert pool.wait_loaded("b") is None
        f2s = pool.buffers.full_to_swa_page
        slots = pool.slots("b")
        tail = slots[(116 - WINDOW) // PAGE * PAGE :]
        assert f2s[tail // PAGE].all()  # the SWA tail came back with the prefix
        out = bound.prefill({"b": second}, {"b": match.prefix_len})
        out = bound.continue_decode(out, 20)
        assert out["b"] == hf_greedy(hf_swa_models[kind], second, 20)
        pool.release("b", is_insert=False)
        pool.check_integrity(idle=True)
    finally:
        bound.close()
