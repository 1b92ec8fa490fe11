"""In process (memsvc's hybrid KVPool + the worker, as the model service binds them): a
request offloaded to the host store mid-decode (full KV and its window's SWA KV alone),
its pages reused by another request, then loaded back into other pages, decodes on to
transformers' greedy tokens, past 3 x W; a second offload / load round too."""

from __future__ import annotations

import numpy as np
import pytest

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
def test_offload_and_load_mid_decode_gives_transformers_tokens(
    make_pool, swa_models, hf_swa_models, kind: str
) -> None:
    model = swa_models[kind]
    layout = model_layout(
        model.config, PAGE, **hybrid_layout_fields(model.config), swa_num_pages=64
    )
    pool = make_pool(layout, host_store_bytes=layout.kv_bytes + layout.swa_kv_bytes)
    bound = HybridBound.attach(pool, model)
    try:
        prompts = {"a": prompt(90, 11), "b": prompt(70, 12)}
        want = {rid: hf_greedy(hf_swa_models[kind], ids, 40) for rid, ids in prompts.items()}
        outs = bound.generate(prompts, 8)
        for rounds, (b_to, a_to) in enumerate(((20, 24), (30, 40))):
            kv_len = pool.request("a").kv_len
            pool.offload("a")
            # the host store holds the window's SWA KV alone: from floor_page(kv_len - W)
            assert pool.host_store.swa_from("a") == (kv_len - WINDOW) // PAGE * PAGE
            old_slots = pool.slots("a").copy()
            pool.release("a", is_insert=False)
            # b decodes on, over a's freed pages
            outs["b"] = bound.continue_decode({"b": outs["b"]}, b_to)["b"]
            pool.open_request("a")
            assert pool.load("a") is not None
            assert not np.array_equal(pool.slots("a"), old_slots), rounds
            pool.check_integrity()
            outs["a"] = bound.continue_decode({"a": outs["a"]}, a_to)["a"]
        outs = bound.continue_decode(outs, 40)
        assert outs == want
        for rid in prompts:
            pool.release(rid, is_insert=False)
        pool.check_integrity(idle=True)
    finally:
        bound.close()
