"""The pool seen as rows (model_svc.paged_attention), decode's padding, and fused projections.

Rows are checked against the pool's own 6-D indexing; decode against each
request decoded alone and against stray bytes (NaN) wherever its padding
reads; the fused q/k/v and gate/up matmuls against the same model with its
projections apart.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from model_svc.model import LlamaModel, fused_intact
from model_svc.paged_attention import PoolRows
from model_svc.reference import dense_logits
from model_svc.tiny import BOS_ID

PROMPTS = {
    "a": [BOS_ID, *b"Pages hold the KV of every token."],
    "b": [BOS_ID, *b"Short."],
    "c": [BOS_ID, *b"A middling prompt, here."],
    "d": [BOS_ID, *b"Of the same length as c."],
}


def test_rows_address_the_pool_as_its_6d_view(bound_pool) -> None:
    bp = bound_pool(4)
    kv = bp.attached.kv_torch()  # [pages + 1, layers, 2, page_size, kv_heads, dim]
    rows = PoolRows.of(kv, bp.pool.page_size)
    num_pages, _, _, page_size, num_kv_heads, dim = kv.shape
    generator = torch.Generator().manual_seed(0)
    slots = torch.randperm(num_pages * page_size, generator=generator)[:10]
    k = torch.randn(10, num_kv_heads, dim, generator=generator)
    v = torch.randn(10, num_kv_heads, dim, generator=generator)
    layer = 2
    slot_rows = rows.slot_rows(slots)
    rows.write(layer, slot_rows, k, v)
    pages, offsets = slots // page_size, slots % page_size
    assert torch.equal(kv[pages, layer, 0, offsets], k)
    assert torch.equal(kv[pages, layer, 1, offsets], v)
    keys, values = rows.gather(layer, slot_rows, rows.empty_rows(10))
    assert torch.equal(keys.view(10, num_kv_heads, dim), k)
    assert torch.equal(values.view(10, num_kv_heads, dim), v)
    head_rows = rows.heads_of(slot_rows)  # [kv_heads, 10]
    keys, values = rows.gather_heads(layer, head_rows.flatten(), rows.empty_rows(10 * 2, dim))
    assert torch.equal(keys.view(num_kv_heads, 10, dim), k.transpose(0, 1))
    assert torch.equal(values.view(num_kv_heads, 10, dim), v.transpose(0, 1))
    bp.pool.check_integrity(idle=True)


def prefill_and_step(bp, rids: list[str]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Prefill ``rids`` and allocate their next decode slot: rows, seq_lens, last tokens."""
    for rid in rids:
        bp.admit(rid, PROMPTS[rid])
    logits = bp.extend([(rid, PROMPTS[rid]) for rid in rids])
    assert bp.pool.alloc_decode(rids) is not None
    rows = np.array([bp.pool.request(rid).row for rid in rids])
    seq_lens = np.array([bp.pool.request(rid).kv_len for rid in rids])
    return rows, seq_lens, logits.argmax(-1).tolist()


def poison_unread_slots(bp, rows: np.ndarray, seq_lens: np.ndarray) -> None:
    """NaN in page 0 and in every slot of the pool that is not a request's context."""
    kv = bp.attached.kv_torch()
    table = bp.attached.req_to_token_torch()
    keep = torch.cat([table[row, :n].long() for row, n in zip(rows, seq_lens, strict=True)])
    page_size = bp.pool.page_size
    poisoned = torch.ones(kv.shape[0] * page_size, dtype=torch.bool)
    poisoned[keep] = False
    slots = poisoned.nonzero().flatten()
    kv[slots // page_size, :, :, slots % page_size] = float("nan")


def test_decode_padding_never_leaks_stray_bytes(bound_pool) -> None:
    bp = bound_pool(4)
    rids = list(PROMPTS)  # three lengths: the shorter padded, last pages part-filled
    rows, seq_lens, last = prefill_and_step(bp, rids)
    clean = bp.model.decode(rows, seq_lens, last)
    poison_unread_slots(bp, rows, seq_lens)
    poisoned = bp.model.decode(rows, seq_lens, last)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)
    for rid in rids:
        bp.pool.release(rid, is_insert=False)
    bp.pool.check_integrity(idle=True)


def test_batched_decode_equals_each_request_alone(bound_pool) -> None:
    """A padded batch (unequal lengths) and an unpadded one (equal lengths)."""
    bp = bound_pool(4)
    rids = list(PROMPTS)
    assert len(PROMPTS["c"]) == len(PROMPTS["d"]) != len(PROMPTS["a"])
    rows, seq_lens, last = prefill_and_step(bp, rids)
    for batch in ([0, 1, 2], [2, 3]):
        together = bp.model.decode(rows[batch], seq_lens[batch], [last[i] for i in batch])
        for j, i in enumerate(batch):
            alone = bp.model.decode(rows[i : i + 1], seq_lens[i : i + 1], last[i : i + 1])
            torch.testing.assert_close(together[j : j + 1], alone, rtol=0, atol=1e-4)
    for rid in rids:
        bp.pool.release(rid, is_insert=False)
    bp.pool.check_integrity(idle=True)


def unfused_copy(model: LlamaModel) -> LlamaModel:
    """The same weights, each projection in its own contiguous tensor."""
    copy = LlamaModel.from_state_dict(
        model.config, {name: t.clone() for name, t in model.state_dict().items()}
    )
    for module in copy.modules():
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(module.weight.detach().contiguous())
    return copy


def test_fused_projections_compute_what_separate_ones_do(tiny_model) -> None:
    layer = tiny_model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert fused_intact(attn.qkv_weight, (attn.q_proj, attn.k_proj, attn.v_proj))
    assert fused_intact(mlp.gate_up_weight, (mlp.gate_proj, mlp.up_proj))
    apart = unfused_copy(tiny_model)
    apart_layer = apart.model.layers[0]
    assert not fused_intact(apart_layer.self_attn.qkv_weight, (apart_layer.self_attn.q_proj,))
    ids = [BOS_ID, *b"Fused or not, the same logits."]
    torch.testing.assert_close(dense_logits(tiny_model, ids), dense_logits(apart, ids))
    apart.fuse_projections()
    assert fused_intact(
        apart_layer.mlp.gate_up_weight, (apart_layer.mlp.gate_proj, apart_layer.mlp.up_proj)
    )
    torch.testing.assert_close(dense_logits(tiny_model, ids), dense_logits(apart, ids))
