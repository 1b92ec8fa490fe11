"""Paged attention over the memsvc pool: a batch's K/V moved by row index, in one op a layer.

The pool's KV is one contiguous tensor ``[pages + 1, layers, 2, page_size,
kv_heads, dim]``. Seen as a table of rows of ``kv_heads * dim`` values, each
row holds one token's K or V in one layer::

    rows: | page 0: layer 0: K off 0..ps-1 | V off 0..ps-1 | layer 1: K | V | .. | page 1: ..
    row(slot, layer, kind) = slot_row(slot) + (2 * layer + kind) * page_size    (kind: 0 = K, 1 = V)
    slot_row(slot) = (slot // page_size) * (layers * 2 * page_size) + slot % page_size

and as rows of ``dim`` values, one per KV head: ``head_row = row * kv_heads + head``.
So one layer's K (or V) of a whole batch is one ``index_select`` of rows and
its new tokens' K/V one ``index_copy_``, whatever the request's pages are: no
per-token ``[pages, offsets]`` indexing, no per-request loop in decode.

Query head ``h`` reads KV head ``h // (heads // kv_heads)``, as HF's
``repeat_kv``; K/V are never copied per query head. Extend runs torch's
``scaled_dot_product_attention`` with ``enable_gqa``. Decode (one query per
request) gathers K/V head-major and multiplies each KV head's group of query
heads with it in one batched matmul, where SDPA's CPU kernel works one query
head at a time (twice as slow, for SmolLM2 at 64 requests x 272 tokens here).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_svc.errors import ModelLayoutError


@dataclass(frozen=True, slots=True)
class PoolRows:
    """The pool's KV as rows of tokens ``[N, kv_heads * dim]`` and of heads ``[N * kv_heads,
    dim]`` (views), ``N = (pages + 1) * layers * 2 * page_size``."""

    rows: torch.Tensor
    head_rows: torch.Tensor
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, kv: torch.Tensor, page_size: int) -> PoolRows:
        """Rows of a contiguous ``kv [pages + 1, layers, 2, page_size, kv_heads, dim]``."""
        if not kv.is_contiguous():
            raise ModelLayoutError("the KV pool view must be contiguous")
        num_kv_heads, head_dim = kv.shape[-2], kv.shape[-1]
        rows, head_rows = kv.view(-1, num_kv_heads * head_dim), kv.view(-1, head_dim)
        return cls(rows, head_rows, kv.shape[1], page_size, num_kv_heads, head_dim)

    def slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Row of each slot's K in layer 0 (int64, same shape as ``slots``)."""
        pages, offsets = slots // self.page_size, slots % self.page_size
        return pages * (self.num_layers * 2 * self.page_size) + offsets

    def heads_of(self, slot_rows: torch.Tensor) -> torch.Tensor:
        """Head rows ``[..., kv_heads, L]`` of ``slot_rows [..., L]`` (layer 0's K)."""
        heads = torch.arange(self.num_kv_heads, device=slot_rows.device)[:, None]
        return slot_rows[..., None, :] * self.num_kv_heads + heads

    def write(self, layer: int, slot_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [n, kv_heads, dim]`` of ``layer`` at the slots of ``slot_rows [n]``."""
        k_rows = slot_rows + 2 * layer * self.page_size
        self.rows.index_copy_(0, k_rows, k.reshape(k_rows.numel(), -1))
        self.rows.index_copy_(0, k_rows + self.page_size, v.reshape(k_rows.numel(), -1))

    def gather(
        self, layer: int, slot_rows: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` at ``slot_rows [n]`` into ``out`` (two ``[n, kv_heads * dim]``)."""
        k_rows = slot_rows + 2 * layer * self.page_size
        torch.index_select(self.rows, 0, k_rows, out=out[0])
        torch.index_select(self.rows, 0, k_rows + self.page_size, out=out[1])
        return out

    def gather_heads(
        self, layer: int, head_rows: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` at ``head_rows [n]`` into ``out`` (two ``[n, dim]``)."""
        k_rows = head_rows + 2 * layer * self.page_size * self.num_kv_heads
        torch.index_select(self.head_rows, 0, k_rows, out=out[0])
        v_rows = k_rows + self.page_size * self.num_kv_heads
        torch.index_select(self.head_rows, 0, v_rows, out=out[1])
        return out

    def empty_rows(
        self, num_rows: int, row_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A K and a V buffer of ``num_rows`` rows of ``row_size`` (default a token's)."""
        shape = (num_rows, row_size or self.num_kv_heads * self.head_dim)
        rows = self.rows
        return (
            torch.empty(shape, dtype=rows.dtype, device=rows.device),
            torch.empty(shape, dtype=rows.dtype, device=rows.device),
        )


class DecodeAttention:
    """One decode pass: each request's one query over its context, padded to the longest.

    ::

        slots [B, L]:  | request b's slots 0..seq_len_b - 1 | padding (slot 0) |
                                                ^ the new token's slot, written first

    The batch's K/V of a layer are gathered head-major, ``[B, kv_heads, L,
    dim]``, into two buffers reused by every layer. Padding reads slot 0
    (page 0, never allocated): its scores are masked to ``-inf`` and its V
    zeroed after the gather, so stray bytes there (even NaN) cannot leak
    through. Softmax runs in (at least) float32.
    """

    def __init__(
        self, pool: PoolRows, slots: torch.Tensor, valid: torch.Tensor, new_slots: torch.Tensor
    ) -> None:
        self.pool = pool
        self.batch_size, self.max_len = slots.shape
        self.head_rows = pool.heads_of(pool.slot_rows(slots)).flatten()
        self.new_slot_rows = pool.slot_rows(new_slots)
        padding = ~valid[:, None, :].expand(-1, pool.num_kv_heads, -1)
        self.padding = padding.flatten().nonzero().flatten()  # in head-row order
        self.masked = ~valid[:, None, None, :] if self.padding.numel() else None
        self.buffers = pool.empty_rows(self.head_rows.numel(), pool.head_dim)
        self.scale = 1 / math.sqrt(pool.head_dim)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q [B, heads, dim]``, the new ``k, v [B, kv_heads, dim]`` -> ``[B, heads * dim]``."""
        self.pool.write(layer, self.new_slot_rows, k, v)
        keys, values = self.pool.gather_heads(layer, self.head_rows, self.buffers)
        if self.masked is not None:
            values.index_fill_(0, self.padding, 0)
        num_kv_heads, dim = self.pool.num_kv_heads, self.pool.head_dim
        shape = (self.batch_size, num_kv_heads, self.max_len, dim)
        # [B, kv_heads, groups, dim]: query head h = kv_head * groups + group.
        q = q.view(self.batch_size, num_kv_heads, -1, dim)
        scores = torch.matmul(q, keys.view(shape).transpose(-1, -2)).mul_(self.scale)
        if self.masked is not None:
            scores.masked_fill_(self.masked, float("-inf"))
        probs = torch.softmax(scores.to(torch.promote_types(q.dtype, torch.float32)), -1)
        out = torch.matmul(probs.to(q.dtype), values.view(shape))  # [B, kv_heads, groups, dim]
        return out.reshape(self.batch_size, -1)


def attention_mask(
    query_start: int,
    num_queries: int,
    key_start: int,
    num_keys: int,
    window: int | None,
    device: torch.device,
) -> torch.Tensor | None:
    """``[num_queries, num_keys]`` True = attend, for queries at positions ``query_start + i``
    over keys at ``key_start + c``: causal, and within ``window`` (keys ``j > i - window``)
    unless it is None. None where that is the plain causal mask (no offset, no key out of
    any query's window), which ``scaled_dot_product_attention`` applies itself."""
    last_query = query_start + num_queries - 1
    windowed = window is not None and key_start <= last_query - window
    if query_start == key_start and not windowed:
        return None
    if not windowed:
        mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device)
        return mask.tril(diagonal=query_start - key_start)
    queries = torch.arange(query_start, last_query + 1, device=device)[:, None]
    keys = torch.arange(key_start, key_start + num_keys, device=device)[None, :]
    return (keys <= queries) & (keys > queries - window)


@dataclass(frozen=True, slots=True)
class ExtendSeq:
    """One request of an extend pass: ``num_new`` tokens after ``prefix_len`` cached ones."""

    prefix_len: int
    num_new: int
    # slot rows of positions context_start..prefix_len + num_new - 1
    context_rows: torch.Tensor
    mask: torch.Tensor | None  # [num_new, context] True = attend; None = plain causal
    context_start: int = 0  # > 0 for a sliding window: the first position any query sees
    # W of a sliding layer whose queries are attended in blocks (mask None then): set
    # only where there are more new tokens than one block
    blocked_window: int | None = None


# A sliding layer's queries go by blocks of max(WINDOW_BLOCK, W): a block reads its own
# keys and the W - 1 before it, so a long prefill's attention costs ~ n * 2 * block, not
# n * n (nor an n x n mask).
WINDOW_BLOCK = 256


class ExtendAttention:
    """One extend pass: every request's new tokens written to the pool, then attended.

    ::

        context of one request:  | prefix: K/V read back from the pool | new tokens |
                                 0                          prefix_len    prefix_len + num_new

    A request without a prefix attends to its new K/V as computed (equal to
    what was just written), with the plain causal kernel; one with a prefix
    reads its whole context back from the pool, under a causal mask shifted
    by ``prefix_len``. Requests run one at a time (their lengths differ).
    A sliding layer's context starts at the first query's window
    (``context_start``), and its queries run in blocks when there are many.
    """

    def __init__(self, pool: PoolRows, seqs: Sequence[ExtendSeq]) -> None:
        self.pool = pool
        self.seqs = seqs
        self.new_slot_rows = torch.cat(
            [seq.context_rows[seq.prefix_len - seq.context_start :] for seq in seqs]
        )

    @staticmethod
    def seq(
        pool: PoolRows,
        context_slots: torch.Tensor,
        prefix_len: int,
        window: int | None = None,
        context_start: int = 0,
    ) -> ExtendSeq:
        """A request whose positions ``context_start..context_start + len(context_slots) - 1``
        sit at ``context_slots``; its new tokens start at ``prefix_len``. ``window``: W of a
        sliding layer (then ``context_start`` may skip what no query's window reaches)."""
        end = context_start + context_slots.numel()
        if not 0 <= context_start <= prefix_len < end:
            raise ModelLayoutError("an extend context must hold every new token")
        if window is not None and context_start > max(0, prefix_len - window + 1):
            raise ModelLayoutError("an extend context misses keys in its first query's window")
        num_new = end - prefix_len
        rows = pool.slot_rows(context_slots)
        if window is not None and num_new > max(WINDOW_BLOCK, window):
            return ExtendSeq(prefix_len, num_new, rows, None, context_start, window)
        # Query i (position prefix_len + i) sees keys max(0, prefix_len + i - W + 1)..prefix_len + i
        mask = attention_mask(
            prefix_len, num_new, context_start, end - context_start, window, context_slots.device
        )
        return ExtendSeq(prefix_len, num_new, rows, mask, context_start)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q [T, heads, dim]``, ``k, v [T, kv_heads, dim]`` -> ``[T, heads * dim]``."""
        self.pool.write(layer, self.new_slot_rows, k, v)
        outs, start = [], 0
        for seq in self.seqs:
            end = start + seq.num_new
            if seq.prefix_len:  # the whole context, from the pool
                keys, values = self.pool.gather(
                    layer, seq.context_rows, self.pool.empty_rows(seq.context_rows.numel())
                )
                shape = (seq.context_rows.numel(), self.pool.num_kv_heads, self.pool.head_dim)
                keys, values = keys.view(shape), values.view(shape)
            else:
                keys, values = k[start:end], v[start:end]
            if seq.blocked_window is None:
                outs.append(_attend(q[start:end], keys, values, seq.mask))
            else:
                outs.append(_attend_by_blocks(seq, q[start:end], keys, values))
            start = end
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """``q [n, heads, dim]`` over ``keys, values [L, kv_heads, dim]`` -> ``[n, heads * dim]``;
    ``mask [n, L]`` True = attend, None = plain causal."""
    out = F.scaled_dot_product_attention(
        q[None].transpose(1, 2),
        keys[None].transpose(1, 2),
        values[None].transpose(1, 2),
        attn_mask=None if mask is None else mask[None, None],
        is_causal=mask is None,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).flatten(1)


def _attend_by_blocks(
    seq: ExtendSeq, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """A sliding layer's queries in blocks, each over the keys its window reaches::

    keys (positions context_start..):  | ... | W - 1 before the block | the block's own |
    queries:                                                         | a ........ b - 1 |
    """
    window = seq.blocked_window
    assert window is not None
    block = max(WINDOW_BLOCK, window)
    outs = []
    for a in range(0, seq.num_new, block):
        b = min(seq.num_new, a + block)
        first_query = seq.prefix_len + a
        lo = max(0, first_query - window + 1 - seq.context_start)  # key index of a position
        hi = seq.prefix_len + b - seq.context_start
        mask = attention_mask(first_query, b - a, seq.context_start + lo, hi - lo, window, q.device)
        outs.append(_attend(q[a:b], keys[lo:hi], values[lo:hi], mask))
    return torch.cat(outs)


AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LayerRoute:
    """Attention of a model whose layers' K/V sit in several pools, or are attended in several
    ways (full context, sliding window): model layer ``i`` is ``attends[route[i][0]]`` on that
    one's layer ``route[i][1]``."""

    def __init__(self, attends: Sequence[AttendFn], route: Sequence[tuple[int, int]]) -> None:
        self.route = [(attends[which], index) for which, index in route]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        attend, index = self.route[layer]
        return attend(index, q, k, v)
