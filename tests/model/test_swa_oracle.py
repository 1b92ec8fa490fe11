"""Sliding-window models against transformers: greedy tokens identical, past the window.

The models are transformers' own Mistral (every layer windowed, W = 32) and
Ministral (5 of 6 layers windowed), random weights, saved as HF folders
(tests/model/swa_oracle.py); the oracle is transformers' ``generate`` on the
same folder, float32. Contexts reach 140 tokens (over 4 W): prefill longer than
the window, decode past it, chunked prefill (chunks shorter and longer than W,
not page aligned), a prefix-cached extend, in the one-pool layout (the sliding
layers in the one pool, masked to their window) and the two-pool layout (the
sliding layers in an SWA pool reached through ``full_to_swa_page``, out-of-window
pages freed and poisoned with NaN). That the comparison can fail is checked
too: the same weights with the window ignored, or one token off, give other
logits and other tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from model_svc import paged_attention
from model_svc.checkpoint import load_state_dict
from model_svc.config import ModelConfig
from model_svc.errors import InvalidBatchError, ModelLayoutError
from model_svc.handlers import check_layer_types
from model_svc.model import ExtendItem, LlamaModel
from model_svc.reference import generate_dense
from tests.model.swa_oracle import (
    KINDS,
    WINDOW,
    EmulatedTwoPools,
    HybridBound,
    hf_greedy,
    hf_logits,
    prompt,
)

NUM_NEW = 40
# 100 + 40 = 140 > 4 W; 70 and 33 cross the window in prefill; 5 only in decode.
PROMPTS = {"long": prompt(100, 1), "mid": prompt(70, 2), "edge": prompt(WINDOW + 1, 3)}
PROMPTS["short"] = prompt(5, 4)
# The one pool; the two-pool layout on buffers the test keeps; memsvc's hybrid pool.
LAYOUTS = ("one_pool", "emulated", "memsvc")
KIND_LAYOUTS = [(kind, layout) for kind in KINDS for layout in LAYOUTS]


@pytest.fixture(scope="module")
def expected(hf_swa_models) -> dict[str, dict[str, list[int]]]:
    """transformers' greedy continuation of every prompt, per model kind."""
    return {
        kind: {rid: hf_greedy(hf_swa_models[kind], ids, NUM_NEW) for rid, ids in PROMPTS.items()}
        for kind in KINDS
    }


def test_the_models_are_what_the_tests_need(swa_models, expected) -> None:
    pure, hybrid = swa_models["pure"].config, swa_models["hybrid"].config
    assert pure.architecture == "MistralForCausalLM" and pure.sliding_window == WINDOW
    assert pure.sliding_layer_ids == tuple(range(6))
    assert hybrid.architecture == "MinistralForCausalLM" and hybrid.sliding_window == WINDOW
    assert hybrid.sliding_layer_ids == (0, 1, 3, 4, 5)
    for outputs in expected.values():  # varied, not one token over and over
        assert all(len(set(out)) > NUM_NEW // 2 for out in outputs.values()), outputs


def finish(bp, rids) -> None:
    for rid in rids:
        if isinstance(bp, EmulatedTwoPools):
            bp.drop(rid)
        else:
            bp.pool.release(rid, is_insert=False)
    bp.pool.check_integrity(idle=True)
    if isinstance(bp, EmulatedTwoPools):
        assert bp.swa_pages_held == 0


def swa_tokens_held(bp) -> int | None:
    """SWA tokens the open requests hold (None in the one-pool layout)."""
    if isinstance(bp, EmulatedTwoPools):
        return bp.swa_pages_held * bp.pool.page_size
    if isinstance(bp, HybridBound):
        return bp.pool.swa_held_size()
    return None


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("kind", "layout"), KIND_LAYOUTS)
def test_batched_greedy_matches_transformers(
    swa_bound_pool, expected, kind: str, page_size: int, layout: str
) -> None:
    bp = swa_bound_pool(kind, page_size, layout)
    outputs = bp.generate(PROMPTS, NUM_NEW)
    assert outputs == expected[kind]
    held = swa_tokens_held(bp)
    if held is not None:  # pages that left the window were freed (and never read)
        assert held <= len(PROMPTS) * (WINDOW + 2 * page_size)
    finish(bp, PROMPTS)


@pytest.mark.parametrize(("page_size", "chunk"), [(16, 24), (4, 40), (1, 7)])
@pytest.mark.parametrize(("kind", "layout"), KIND_LAYOUTS)
def test_chunked_prefill_matches_transformers(
    swa_bound_pool, expected, kind: str, page_size: int, chunk: int, layout: str
) -> None:
    bp = swa_bound_pool(kind, page_size, layout)
    prompts = {rid: PROMPTS[rid] for rid in ("long", "mid")}
    outputs = bp.generate(prompts, NUM_NEW, chunk_size=chunk)
    assert outputs == {rid: expected[kind][rid] for rid in prompts}
    finish(bp, prompts)


@pytest.mark.parametrize("shared", ["all", "part"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("kind", "layout"), [case for case in KIND_LAYOUTS if case[1] != "emulated"]
)
def test_prefix_cached_extend_matches_transformers(
    swa_bound_pool, hf_swa_models, kind: str, page_size: int, layout: str, shared: str
) -> None:
    """A second request reuses the first one's KV from the radix tree, then extends and
    decodes past it. "all": it continues the first request's whole KV (a prefix over 3 W,
    its SWA tail held); "part": it shares 90 of its 100 prompt tokens, whose SWA tail a
    hybrid pool no longer holds (its match stops where it does, or is empty)."""
    bp = swa_bound_pool(kind, page_size, layout)
    first = PROMPTS["long"]
    out = bp.generate({"a": first}, 8)["a"]
    bp.finish("a", first, out)
    second = (first + out[:-1] if shared == "all" else first[:90]) + prompt(30, 5)
    prefix_len = bp.admit("b", second)
    if shared == "all" or layout == "one_pool":
        assert prefix_len >= 80 > 2 * WINDOW
    got = bp.continue_decode(bp.prefill({"b": second}, {"b": prefix_len}), NUM_NEW)["b"]
    assert got == hf_greedy(hf_swa_models[kind], second, NUM_NEW)
    bp.finish("b", second, got)
    bp.pool.check_integrity(idle=True)


@pytest.mark.parametrize("chunk", [None, 45])
@pytest.mark.parametrize(("kind", "layout"), KIND_LAYOUTS)
def test_prefill_by_query_blocks_matches_transformers(
    swa_bound_pool, expected, monkeypatch, kind: str, layout: str, chunk: int | None
) -> None:
    """Blocks of W queries (the smallest block there is): 100 tokens in 4 blocks; chunks of
    45 go by blocks with and without a prefix."""
    monkeypatch.setattr(paged_attention, "WINDOW_BLOCK", 1)
    blocked = []
    by_blocks = paged_attention._attend_by_blocks

    def spy(seq, *args):
        blocked.append((seq.prefix_len, seq.num_new))
        return by_blocks(seq, *args)

    monkeypatch.setattr(paged_attention, "_attend_by_blocks", spy)
    bp = swa_bound_pool(kind, 4, layout)
    prompts = {rid: PROMPTS[rid] for rid in ("long", "mid")}
    outputs = bp.generate(prompts, NUM_NEW, chunk_size=chunk)
    assert outputs == {rid: expected[kind][rid] for rid in prompts}
    assert {(0, 100), (0, 70)} <= set(blocked) if chunk is None else (45, 45) in set(blocked)
    finish(bp, prompts)


def windowed_variant(model: LlamaModel, path, window: int | None) -> LlamaModel:
    """The same weights with another window (None: every layer full attention)."""
    config = model.config
    changed = (
        dataclasses.replace(
            config, sliding_window=None, layer_types=(), architecture="LlamaForCausalLM"
        )
        if window is None
        else dataclasses.replace(config, sliding_window=window)
    )
    return LlamaModel.from_state_dict(changed, load_state_dict(path, config))


def run_logits(bp, model: LlamaModel, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill ``ids`` then greedy ``steps`` decode steps; the tokens and every step's logits."""
    bp.model = model
    bp.admit("r", ids)
    logits = [bp.extend([("r", ids)])[0]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps):
        logits.append(bp.decode(["r"], tokens[-1:])[0])
        tokens.append(int(logits[-1].argmax()))
    finish(bp, ["r"])
    return tokens, torch.stack(logits)


@pytest.mark.parametrize(("kind", "layout"), KIND_LAYOUTS)
def test_logits_match_and_the_window_matters(
    swa_bound_pool, swa_models, swa_checkpoints, hf_swa_models, kind: str, layout: str
) -> None:
    """Our logits are transformers' to float32 noise; a window one token off, or none, is
    told apart by far more, and without the window the tokens differ: the oracle can fail."""
    ids, steps = PROMPTS["long"], 30
    bp = swa_bound_pool(kind, 16, layout)
    tokens, logits = run_logits(bp, swa_models[kind], ids, steps)
    want = hf_logits(hf_swa_models[kind], ids + tokens[:-1])[len(ids) - 1 :]
    error = (logits - want).abs().max().item()
    assert error < 1e-4
    assert tokens == hf_greedy(hf_swa_models[kind], ids, steps + 1)
    path = swa_checkpoints[kind]
    for window in (WINDOW - 1, WINDOW + 1, None):
        variant = windowed_variant(swa_models[kind], path, window)
        if window is None:
            bp = swa_bound_pool(kind, 16)  # no sliding layer: one pool
        elif layout == "memsvc":  # memsvc keeps the variant's window
            bp = swa_bound_pool(kind, 16, layout, sliding_window=window)
        else:
            bp = swa_bound_pool(kind, 16, layout)
        other_tokens, other = run_logits(bp, variant, ids, steps)
        assert (other - want).abs().max().item() > 100 * max(error, 1e-6), window
        if window is None:
            assert other_tokens != tokens
        bp.model = swa_models[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_dense_reference_honours_the_window(swa_models, expected, kind: str) -> None:
    """model_svc.reference (used by other tests as an oracle) windows the same layers."""
    ids = PROMPTS["mid"]
    assert generate_dense(swa_models[kind], ids, NUM_NEW) == expected[kind]["mid"]


# -- the two-pool layout's guards ---------------------------------------------------


def test_an_in_window_position_without_an_swa_page_is_refused(swa_bound_pool) -> None:
    bp = swa_bound_pool("hybrid", 4, "emulated")
    ids = PROMPTS["mid"]
    bp.admit("r", ids)
    first = int(bp.extend([("r", ids)])[0].argmax())
    assert bp.pool.alloc_decode(["r"]) is not None
    request = bp.pool.request("r")
    seq_len = request.kv_len
    bp._swa_step("r", seq_len - 1, seq_len)
    # The oldest position the next query sees loses its SWA page.
    slot = int(bp.attached.req_to_token_torch()[request.row, seq_len - WINDOW])
    page = slot // 4
    swa_page = int(bp.full_to_swa_page[page])
    bp.full_to_swa_page[page] = 0
    with pytest.raises(InvalidBatchError, match="without an SWA page"):
        bp.model.decode(np.array([request.row]), np.array([seq_len]), [first])
    bp.full_to_swa_page[page] = swa_page  # back: the pass runs
    bp.model.decode(np.array([request.row]), np.array([seq_len]), [first])
    # An extend reads its window back from the SWA pool too.
    bp.full_to_swa_page[page] = 0
    with pytest.raises(InvalidBatchError, match=r"row .* without an SWA page"):
        bp.model.extend([ExtendItem(request.row, seq_len - 1, [first])])
    bp.full_to_swa_page[page] = swa_page
    finish(bp, ["r"])


def test_bind_checks_the_two_pools(swa_models, tiny_model) -> None:
    model = swa_models["hybrid"]
    cfg = model.config
    shape = (2, cfg.num_key_value_heads, cfg.head_dim)

    def kv(layers: int, pages: int = 8) -> torch.Tensor:
        return torch.zeros(pages + 1, layers, 2, *shape)

    table, f2s = torch.zeros(4, 64, dtype=torch.int32), torch.zeros(9, dtype=torch.int32)
    model.bind(kv(1), table, 2, kv(5, 3), f2s)  # 1 full layer, 5 sliding
    model.bind(kv(6), table, 2)  # the one-pool layout: every layer in kv
    with pytest.raises(ModelLayoutError, match="both swa_kv and full_to_swa_page"):
        model.bind(kv(1), table, 2, kv(5))
    with pytest.raises(ModelLayoutError, match=r"KV pool shape .* layers 1"):
        model.bind(kv(6), table, 2, kv(5), f2s)
    with pytest.raises(ModelLayoutError, match=r"SWA pool shape .* layers 5"):
        model.bind(kv(1), table, 2, kv(6), f2s)
    with pytest.raises(ModelLayoutError, match="full_to_swa_page must be an int32 table of 9"):
        model.bind(kv(1), table, 2, kv(5), torch.zeros(8, dtype=torch.int32))
    pure = swa_models["pure"]
    pure.bind(kv(0), table, 2, kv(6), f2s)  # pure SWA: the full pool holds no layer
    pure.unbind()
    model.unbind()
    tiny = tiny_model.config
    with pytest.raises(ModelLayoutError, match="without sliding layers"):
        tiny_model.bind(
            torch.zeros(9, tiny.num_hidden_layers, 2, 2, tiny.num_key_value_heads, tiny.head_dim),
            table,
            2,
            kv(1),
            f2s,
        )


def test_a_hybrid_pool_must_window_the_models_layers(swa_models) -> None:
    from memsvc.core import PoolLayout

    config: ModelConfig = swa_models["hybrid"].config
    fields = dict(num_layers=6, num_kv_heads=2, head_dim=64, page_size=16, num_pages=8)
    check_layer_types(config, PoolLayout(**fields))  # one pool: fits any model
    same = dict(layer_types=config.layer_types, sliding_window=WINDOW, swa_num_pages=4)
    check_layer_types(config, PoolLayout(**fields, **same))
    for change in (
        {"sliding_window": WINDOW + 1},
        {"layer_types": ("sliding_attention",) * 6},
    ):
        with pytest.raises(ModelLayoutError, match="are not the model's"):
            check_layer_types(config, PoolLayout(**fields, **(same | change)))
