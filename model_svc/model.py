"""A Llama decoder whose attention reads and writes K/V in the shared memsvc pool.

Module and parameter names follow Hugging Face's ``LlamaForCausalLM``, so a
checkpoint's state dict loads as is. The pool is bound once (:meth:`bind`)
as zero-copy views; each forward pass finds its tokens' slots in
``req_to_token``, the table the memory service fills, so the two agree by
construction::

    req_to_token[row]:  | prefix: KV in the pool   | new tokens: KV written here |
                        0                  prefix_len            prefix_len + n

A pass writes K/V only into the new tokens' slots and reads only the
request's own slots (decode's padding is zeroed), so re-running the same
batch writes the same bytes and returns the same logits. How the pool's K/V
are moved and attended to is :mod:`model_svc.paged_attention`.

Sliding-window layers (Mistral, Ministral: ``config.layer_types``) attend to
the last ``sliding_window`` positions only. Their K/V live either in the one
pool with every other layer's (the one-pool layout), or in a pool of their
own (the two-pool layout of a hybrid memsvc pool): ``kv`` then holds only the
full-attention layers, ``swa_kv`` the sliding ones, and an SWA layer finds
position ``p`` of row ``r`` at::

    full_slot = req_to_token[r, p]
    swa_slot  = full_to_swa_page[full_slot // page_size] * page_size + full_slot % page_size

reading only the positions in its window (the others may have no SWA page).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from model_svc.checkpoint import load_state_dict
from model_svc.config import ModelConfig
from model_svc.errors import InvalidBatchError, ModelLayoutError
from model_svc.paged_attention import DecodeAttention, ExtendAttention, LayerRoute, PoolRows
from model_svc.rope import apply_rope, rope_inv_freq

IntArray = Sequence[int] | np.ndarray | torch.Tensor
# attend(layer, q [T, heads, dim], k [T, kv_heads, dim], v) -> [T, heads * dim]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExtendItem:
    """One request in an extend batch.

    Positions ``0..prefix_len-1`` already have K/V in the pool (a cached
    prefix, earlier prefill chunks, a re-prefill hit); ``token_ids`` sit at
    positions ``prefix_len..prefix_len+n-1``, slots ``req_to_token[row, prefix_len:][:n]``.
    """

    row: int
    prefix_len: int
    token_ids: Sequence[int] | np.ndarray


# -- building blocks (HF Llama semantics) ----------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalized in (at least) float32, then scaled in the model dtype, as HF does.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


# -- projections fused into one matmul --------------------------------------------


@torch.no_grad()
def fuse_weights(linears: Sequence[nn.Linear]) -> torch.Tensor:
    """One weight ``[sum of out, in]`` whose row blocks are ``linears``' weights, which
    become views of it: one ``F.linear`` on it computes all of them, in one pass over
    the input.

    It is stored transposed (a contiguous ``[in, sum of out]``): for the few rows of
    a decode step MKL's sgemm is faster on that layout than on the usual
    ``[out, in]`` (measured on this project's 2-core CPU over SmolLM2's 30 layers,
    weights streamed from memory as in a real pass: 13 to 20% at 16 rows, 7% at
    64, the same within noise at 512 and 2048). The parameters keep their names,
    shapes and values; only their strides change.
    """
    weights = [linear.weight for linear in linears]
    stored = torch.cat([weight.detach() for weight in weights]).t().contiguous()
    start = 0
    for linear, weight in zip(linears, weights, strict=True):
        view = stored[:, start : start + weight.shape[0]].t()
        linear.weight = nn.Parameter(view, requires_grad=weight.requires_grad)
        start += weight.shape[0]
    return stored.t()


def fused_intact(fused: torch.Tensor | None, linears: Sequence[nn.Linear]) -> bool:
    """Whether ``linears``' weights are still the views :func:`fuse_weights` made of
    ``fused`` (not replaced, moved or cast since)."""
    if fused is None:
        return False
    row_bytes = fused.stride(0) * fused.element_size()
    start = 0
    for linear in linears:
        weight = linear.weight
        if (
            weight.device != fused.device
            or weight.dtype != fused.dtype
            or weight.stride() != fused.stride()
            or weight.data_ptr() != fused.data_ptr() + start * row_bytes
        ):
            return False
        start += weight.shape[0]
    return True


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, config.q_size, bias=False)
        self.k_proj = nn.Linear(hidden, config.kv_size, bias=False)
        self.v_proj = nn.Linear(hidden, config.kv_size, bias=False)
        self.o_proj = nn.Linear(config.q_size, hidden, bias=False)
        self.qkv_weight: torch.Tensor | None = None  # set by fuse()

    def fuse(self) -> None:
        self.qkv_weight = fuse_weights((self.q_proj, self.k_proj, self.v_proj))
        fuse_weights((self.o_proj,))  # alone, for the faster layout

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``q, k, v`` of ``x [T, hidden]``: one matmul when fused, else three."""
        linears = (self.q_proj, self.k_proj, self.v_proj)
        if not fused_intact(self.qkv_weight, linears):
            return tuple(linear(x) for linear in linears)
        sizes = [linear.out_features for linear in linears]
        return F.linear(x, self.qkv_weight).split(sizes, dim=-1)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse()

    def fuse(self) -> None:
        self.gate_up_weight = fuse_weights((self.gate_proj, self.up_proj))
        fuse_weights((self.down_proj,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_intact(self.gate_up_weight, (self.gate_proj, self.up_proj)):
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaBody(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Given its (uninitialized) weight, nn.Embedding skips its random init, which on
        # the meta device goes through torch._refs and imports torch._dynamo: ~1 CPU-s
        # of each model_svc start, for values the checkpoint's replace at once.
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# -- the model -------------------------------------------------------------------


@dataclass(frozen=True)
class _PoolViews:
    kv: torch.Tensor  # [pages + 1, layers, 2, page_size, kv_heads, dim]
    req_to_token: torch.Tensor  # [rows, max_context_len], int32
    page_size: int
    rows: PoolRows  # kv seen as token rows and head rows (model_svc.paged_attention)
    # The two-pool layout only (else None): the sliding layers' pool [swa pages + 1,
    # sliding layers, 2, page_size, kv_heads, dim] as rows, and the full page -> SWA
    # page table [pages + 1] (0: no SWA page).
    swa_kv: torch.Tensor | None = None
    swa_rows: PoolRows | None = None
    full_to_swa_page: torch.Tensor | None = None
    # Each model layer's index in the buffer that holds it (two-pool layout), else its own.
    layer_index: tuple[int, ...] = ()

    @property
    def window_rows(self) -> PoolRows:
        """Where the sliding layers' K/V are."""
        return self.rows if self.swa_rows is None else self.swa_rows


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        """Uninitialized weights (build under ``torch.device("meta")`` and load with ``assign``)."""
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self._pool: _PoolViews | None = None

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> LlamaModel:
        """Load an HF-layout Llama checkpoint directory (``config.json`` + ``*.safetensors``)."""
        config = ModelConfig.from_file(path)
        return cls.from_state_dict(
            config, load_state_dict(path, config, dtype=dtype), device=device
        )

    @classmethod
    def from_state_dict(
        cls, config: ModelConfig, state: dict[str, torch.Tensor], *, device: str = "cpu"
    ) -> LlamaModel:
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state, strict=True, assign=True)
        model.inv_freq = rope_inv_freq(config, torch.promote_types(model.dtype, torch.float32))
        model = model.to(device).eval()
        model.fuse_projections()
        return model

    def fuse_projections(self) -> None:
        """Compute q/k/v, and gate/up, with one matmul each (:func:`fuse_weights`).

        Done on load. A model moved or cast afterwards still computes the same,
        with one matmul per projection again, until this is called once more.
        """
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # -- the pool --------------------------------------------------------------

    def bind(
        self,
        kv: torch.Tensor,
        req_to_token: torch.Tensor,
        page_size: int,
        swa_kv: torch.Tensor | None = None,
        full_to_swa_page: torch.Tensor | None = None,
    ) -> None:
        """Use these pool views (``ShmAttached.kv_torch()``, ``req_to_token_torch()``).

        A model with sliding-window layers may also be given the two-pool layout's
        ``swa_kv_torch()`` and ``full_to_swa_page_torch()``: ``kv`` then holds only
        its full-attention layers (in order) and ``swa_kv`` its sliding ones.
        """
        cfg = self.config
        num_layers = cfg.num_hidden_layers
        sliding = cfg.sliding_layer_ids
        two_pools = swa_kv is not None or full_to_swa_page is not None
        if two_pools and (swa_kv is None or full_to_swa_page is None):
            raise ModelLayoutError("the two-pool layout needs both swa_kv and full_to_swa_page")
        if two_pools and not sliding:
            raise ModelLayoutError("an SWA pool was given to a model without sliding layers")
        full = [i for i in range(num_layers) if not (two_pools and i in sliding)]
        self._check_buffer("KV pool", kv, len(full), page_size)
        if kv.device != self.device or req_to_token.device != self.device:
            raise ModelLayoutError(f"pool views are not on the model's device {self.device}")
        if req_to_token.dim() != 2 or req_to_token.dtype not in (torch.int32, torch.int64):
            raise ModelLayoutError("req_to_token must be a 2-D int32 table")
        if not two_pools:
            self._pool = _PoolViews(
                kv,
                req_to_token,
                page_size,
                PoolRows.of(kv, page_size),
                layer_index=tuple(range(num_layers)),
            )
            return
        assert swa_kv is not None and full_to_swa_page is not None
        self._check_buffer("SWA pool", swa_kv, len(sliding), page_size)
        if (
            full_to_swa_page.shape != (kv.shape[0],)
            or full_to_swa_page.dtype not in (torch.int32, torch.int64)
            or full_to_swa_page.device != self.device
        ):
            raise ModelLayoutError(
                f"full_to_swa_page must be an int32 table of {kv.shape[0]} pages on "
                f"{self.device}, got {full_to_swa_page.dtype}{tuple(full_to_swa_page.shape)}"
            )
        index = tuple(full.index(i) if i in full else sliding.index(i) for i in range(num_layers))
        self._pool = _PoolViews(
            kv,
            req_to_token,
            page_size,
            PoolRows.of(kv, page_size),
            swa_kv,
            PoolRows.of(swa_kv, page_size),
            full_to_swa_page,
            index,
        )

    def _check_buffer(self, what: str, kv: torch.Tensor, num_layers: int, page_size: int) -> None:
        cfg = self.config
        want = (num_layers, 2, page_size, cfg.num_key_value_heads, cfg.head_dim)
        if kv.dim() != 6 or tuple(kv.shape[1:]) != want:
            raise ModelLayoutError(
                f"{what} shape {tuple(kv.shape)} does not fit the model: expected "
                f"[pages + 1, layers {want[0]}, 2, page_size {want[2]}, kv heads {want[3]}, "
                f"head dim {want[4]}]"
            )
        if kv.dtype != self.dtype:
            raise ModelLayoutError(f"{what} dtype {kv.dtype} differs from the model's {self.dtype}")
        if kv.device != self.device:
            raise ModelLayoutError(f"{what} is not on the model's device {self.device}")

    def unbind(self) -> None:
        """Drop the pool views (so the pool's mappings can be closed)."""
        self._pool = None

    # -- forward passes --------------------------------------------------------

    @torch.inference_mode()
    def extend(self, items: Sequence[ExtendItem]) -> torch.Tensor:
        """Run each request's new tokens; float32 logits ``[len(items), vocab]`` of its last one."""
        return self.extend_with_positions(items)[0]

    @torch.inference_mode()
    def extend_with_positions(
        self, items: Sequence[ExtendItem], logit_starts: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """:meth:`extend`, and per request the final hidden states of its new tokens from
        ``logit_starts[i]`` on (``[n - start, hidden]``, the last row the sampling one;
        None where ``start >= n``), for input logprobs: :meth:`logits` of a slice of
        them gives that slice's logits (a whole prompt's would be ``n x vocab`` floats)."""
        pool = self._bound()
        if not items:
            raise InvalidBatchError("an extend batch needs at least one request")
        self._check_rows([item.row for item in items])
        window = self.config.sliding_window
        ids, positions, seqs, window_seqs = [], [], [], []
        for item in items:
            tokens = self._token_tensor(item.token_ids)
            end = item.prefix_len + tokens.numel()
            if item.prefix_len < 0 or tokens.numel() == 0:
                raise InvalidBatchError(f"row {item.row}: needs prefix_len >= 0 and new tokens")
            self._check_len(end)
            context = self._checked_slots(pool.req_to_token[item.row, :end], item.row)
            if self._has_full_layers():
                seqs.append(ExtendAttention.seq(pool.rows, context, item.prefix_len))
            if window is not None:  # what the first new token's window reaches, on
                start = max(0, item.prefix_len - window + 1)
                slots = self._window_slots(context[start:], item.row)
                window_seqs.append(
                    ExtendAttention.seq(pool.window_rows, slots, item.prefix_len, window, start)
                )
            ids.append(tokens)
            positions.append(torch.arange(item.prefix_len, end, device=self.device))
        attend = self._route(
            ExtendAttention(pool.rows, seqs) if seqs else None,
            ExtendAttention(pool.window_rows, window_seqs) if window_seqs else None,
        )
        hidden = self.run_layers(torch.cat(ids), torch.cat(positions), attend)
        lengths = [t.numel() for t in ids]
        last = torch.cumsum(torch.tensor(lengths, device=self.device), 0) - 1
        spans: list[torch.Tensor | None] = [None] * len(items)
        if logit_starts is not None:
            if len(logit_starts) != len(items):
                raise InvalidBatchError("logit_starts needs one entry per request")
            offset = 0
            for i, (n, start) in enumerate(zip(lengths, logit_starts, strict=True)):
                if start < 0:
                    raise InvalidBatchError("logit_starts must be >= 0")
                if start < n:
                    spans[i] = hidden[offset + start : offset + n]
                offset += n
        return self.logits(hidden[last]), spans

    @torch.inference_mode()
    def decode(self, rows: IntArray, seq_lens: IntArray, token_ids: IntArray) -> torch.Tensor:
        """One token per request, at position ``seq_lens[i] - 1`` (its slot already allocated).

        It attends to positions ``0..seq_lens[i] - 1``. Returns float32 logits ``[n, vocab]``.
        The batch's contexts are gathered into one padded block (padding zeroed and masked).
        """
        pool = self._bound()
        rows_t = self._int_tensor(rows)
        lens = self._int_tensor(seq_lens)
        tokens = self._token_tensor(token_ids)
        if not rows_t.numel() or not rows_t.numel() == lens.numel() == tokens.numel():
            raise InvalidBatchError("decode needs equally many rows, seq_lens and token ids (> 0)")
        self._check_rows(rows_t.tolist())
        if int(lens.min()) < 1:
            raise InvalidBatchError("every seq_len must be >= 1")
        max_len = int(lens.max())
        self._check_len(max_len)
        batch = torch.arange(rows_t.numel(), device=self.device)
        attend = None
        if self._has_full_layers():
            valid = torch.arange(max_len, device=self.device) < lens[:, None]  # [B, L]
            slots = pool.req_to_token[rows_t, :max_len].long().masked_fill(~valid, 0)
            self._checked_slots(slots[valid], None)
            attend = DecodeAttention(pool.rows, slots, valid, slots[batch, lens - 1])
        window = self.config.sliding_window
        window_attend = None
        if window is not None:
            # Positions first..seq_len - 1 of each request, padded to the widest.
            first = (lens - window).clamp(min=0)
            positions = first[:, None] + torch.arange(min(window, max_len), device=self.device)
            valid = positions < lens[:, None]
            slots = pool.req_to_token[rows_t[:, None], positions.masked_fill(~valid, 0)]
            slots = slots.long().masked_fill(~valid, 0)
            if attend is None:  # not checked with the whole context
                self._checked_slots(slots[valid], None)
            slots[valid] = self._window_slots(slots[valid], None)
            new_slots = slots[batch, lens - first - 1]
            window_attend = DecodeAttention(pool.window_rows, slots, valid, new_slots)
        hidden = self.run_layers(tokens, lens - 1, self._route(attend, window_attend))
        return self.logits(hidden)

    def _has_full_layers(self) -> bool:
        return len(self.config.sliding_layer_ids) < self.config.num_hidden_layers

    def _route(self, full: AttendFn | None, window: AttendFn | None) -> AttendFn:
        """One attention for the layer stack: ``full``'s for full-attention layers,
        ``window``'s for sliding ones, each on the layer's index in its pool."""
        if window is None:
            assert full is not None
            return full  # no sliding layer: today's path, as it was
        pool = self._bound()
        route = [
            (int(self.config.layer_window(i) is not None), pool.layer_index[i])
            for i in range(self.config.num_hidden_layers)
        ]
        return LayerRoute([window if full is None else full, window], route)

    def _window_slots(self, slots: torch.Tensor, row: int | None) -> torch.Tensor:
        """The slots of ``slots`` (full-pool slots of positions in a sliding window) where the
        sliding layers keep them: the same ones in the one-pool layout, else their SWA
        slots, each of which must be on an SWA page."""
        pool = self._bound()
        if pool.full_to_swa_page is None or not slots.numel():
            return slots
        page_size = pool.page_size
        pages = pool.full_to_swa_page[slots // page_size].long()
        assert pool.swa_kv is not None
        if int(pages.min()) < 1 or int(pages.max()) >= pool.swa_kv.shape[0]:
            where = "a request" if row is None else f"row {row}"
            raise InvalidBatchError(
                f"{where} has positions in its sliding window without an SWA page "
                "(full_to_swa_page)"
            )
        return pages * page_size + slots % page_size

    # -- the layer stack, shared with the dense reference ----------------------

    def run_layers(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (before the final norm); ``attend`` owns the K/V."""
        cfg = self.config
        num_tokens = token_ids.numel()
        hidden = self.model.embed_tokens(token_ids)
        cos, sin = self._rope_tables(positions)
        for index, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(hidden))
            q = q.view(num_tokens, cfg.num_attention_heads, cfg.head_dim)
            k = k.view(num_tokens, cfg.num_key_value_heads, cfg.head_dim)
            v = v.view(num_tokens, cfg.num_key_value_heads, cfg.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            hidden = hidden + attn.o_proj(attend(index, q, k, v))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (tied to the embedding when the config says so), as float32."""
        hidden = self.model.norm(hidden)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].to(self.inv_freq.dtype) * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # broadcast over heads
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    # -- argument checks -------------------------------------------------------

    def _bound(self) -> _PoolViews:
        if self._pool is None:
            raise ModelLayoutError("no KV pool bound: call bind() first")
        return self._pool

    def _int_tensor(self, values: IntArray) -> torch.Tensor:
        array = np.asarray(values.cpu() if isinstance(values, torch.Tensor) else values)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise InvalidBatchError(f"expected a 1-D array of ints, got {array.dtype}{array.shape}")
        return torch.as_tensor(array.astype(np.int64), device=self.device)

    def _token_tensor(self, token_ids: IntArray) -> torch.Tensor:
        tokens = self._int_tensor(token_ids)
        if tokens.numel() and (
            int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size
        ):
            raise InvalidBatchError(f"token ids must be in 0..{self.config.vocab_size - 1}")
        return tokens

    def _check_rows(self, rows: list[int]) -> None:
        num_rows = self._bound().req_to_token.shape[0]
        if len(set(rows)) != len(rows):
            raise InvalidBatchError("a row appears twice in one batch")
        if any(not 1 <= row < num_rows for row in rows):
            raise InvalidBatchError(f"rows must be in 1..{num_rows - 1}, got {rows}")

    def _check_len(self, seq_len: int) -> None:
        max_len = self._bound().req_to_token.shape[1]
        if seq_len > max_len:
            raise InvalidBatchError(f"{seq_len} positions exceed req_to_token width {max_len}")

    def _checked_slots(self, slots: torch.Tensor, row: int | None) -> torch.Tensor:
        """``slots`` as int64, if each is on a usable page (page 0 means: never allocated)."""
        pool = self._bound()
        slots = slots.long()
        if slots.numel() and (
            int(slots.min()) < pool.page_size
            or int(slots.max()) >= pool.kv.shape[0] * pool.page_size
        ):
            where = "a request" if row is None else f"row {row}"
            raise InvalidBatchError(f"{where} has positions without a KV slot in req_to_token")
        return slots
