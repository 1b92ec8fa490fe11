"""Sliding-window models for the tests, with transformers as the oracle.

No small hybrid checkpoint ships in a registry package here, so the tests build
their own: transformers' own classes at a small realistic shape, random
weights (seeded), saved as an HF folder (``config.json`` + safetensors) that
our worker loads. The same folder, loaded back by transformers, is the oracle.

* ``pure``: ``MistralForCausalLM``, every layer windowed to ``WINDOW``.
* ``hybrid``: ``MinistralForCausalLM``, ``layer_types`` with 5 of 6 layers windowed.

The weights are drawn with ``initializer_range`` 0.1 (transformers' 0.02
gives near-uniform attention and a model that repeats one token): greedy
continuations are then varied, and depend on the window from the first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from memsvc.core import KVPool, attach
from model_svc.model import ExtendItem, LlamaModel
from tests.model.driver import BoundPool

WINDOW = 32
NUM_LAYERS = 6
SLIDING, FULL = "sliding_attention", "full_attention"
HYBRID_LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING, SLIDING, SLIDING]
KINDS = ("pure", "hybrid")
VOCAB = 512
_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.1,
    sliding_window=WINDOW,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def hf_config(kind: str, window: int = WINDOW):
    import transformers

    shape = _SHAPE | {"sliding_window": window}
    if kind == "pure":
        return transformers.MistralConfig(**shape)
    if kind == "hybrid":
        return transformers.MinistralConfig(layer_types=HYBRID_LAYER_TYPES, **shape)
    raise ValueError(kind)


def write_swa_checkpoint(out_dir: Path, kind: str, seed: int = 0) -> Path:
    """Save a random ``kind`` model (see the module doc) as an HF folder in ``out_dir``."""
    import transformers

    config = hf_config(kind)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def load_hf(path: Path):
    """The oracle: transformers' own model from the folder, float32, eager-free defaults."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' ``generate``: greedy, with its own (sliding-window) KV cache."""
    ids = torch.tensor([list(prompt)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def hf_logits(model, token_ids: Sequence[int]) -> torch.Tensor:
    """transformers' float32 logits ``[n, vocab]`` at every position, one pass, no cache."""
    return model(torch.tensor([list(token_ids)]), use_cache=False).logits[0].float()


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()


# -- the two-pool layout ---------------------------------------------------------------


class HybridBound(BoundPool):
    """A hybrid memsvc pool (two pools: ``swa_kv`` and ``full_to_swa_page`` kept by memsvc),
    bound as the model service binds it."""

    def bind(self) -> None:
        attached = self.attached
        self.model.bind(
            attached.kv_torch(),
            attached.req_to_token_torch(),
            self.pool.page_size,
            attached.swa_kv_torch(),
            attached.full_to_swa_page_torch(),
        )


def hybrid_layout_fields(config) -> dict:
    """PoolLayout's hybrid fields for ``config`` (an SWA pool as large as the full one)."""
    return dict(layer_types=config.layer_types, sliding_window=config.sliding_window)


class EmulatedTwoPools(BoundPool):
    """The worker's side of the two-pool layout, with buffers this class owns.

    The one-pool :class:`KVPool` still allocates rows and full-pool slots (its
    own ``kv`` stays unused); the model is bound to a full pool of only the
    full-attention layers, an SWA pool of the sliding ones and a
    ``full_to_swa_page`` table kept here the way the interface says memsvc keeps
    it: a full page gets an SWA page (from a shuffled free list, so the ids
    differ) when a position on it is written, and loses it (entry 0) once
    every position on it has left its request's window. Freed SWA pages and
    both pools' padding page 0 are filled with NaN: a read of anything the
    window does not need would turn the logits into NaN.
    """

    def __init__(self, pool: KVPool, model: LlamaModel, attached, seed: int = 0) -> None:
        super().__init__(pool, model, attached)
        cfg, ps = model.config, pool.page_size
        shape = (ps, cfg.num_key_value_heads, cfg.head_dim)
        num_sliding = len(cfg.sliding_layer_ids)
        num_full = cfg.num_hidden_layers - num_sliding
        pages = pool.layout.num_pages
        self.kv_full = torch.zeros((pages + 1, num_full, 2, *shape))
        self.kv_full[0] = float("nan")
        self.swa_kv = torch.full((pages + 1, num_sliding, 2, *shape), float("nan"))
        self.full_to_swa_page = torch.zeros(pages + 1, dtype=torch.int32)
        self.free_swa = list(np.random.default_rng(seed).permutation(np.arange(1, pages + 1)))
        self.bind()

    @classmethod
    def attach(cls, pool: KVPool, model: LlamaModel) -> EmulatedTwoPools:
        return cls(pool, model, attach(pool.buffers.handle()))

    def bind(self) -> None:
        if not hasattr(self, "swa_kv"):  # BoundPool's constructor path
            return
        self.model.bind(
            self.kv_full,
            self.attached.req_to_token_torch(),
            self.pool.page_size,
            self.swa_kv,
            self.full_to_swa_page,
        )

    @property
    def swa_pages_held(self) -> int:
        return int((self.full_to_swa_page != 0).sum())

    def _swa_step(self, rid: str, first_query: int, end: int) -> None:
        """Before a pass whose first query sits at ``first_query``: free what no query from
        there on sees (positions <= first_query - W), give SWA pages to the rest up to ``end``."""
        ps = self.pool.page_size
        slots = self.attached.req_to_token_torch()[self.pool.request(rid).row, :end].long()
        pages = (slots // ps).tolist()
        keep_from = max(0, first_query - self.model.config.sliding_window + 1)
        last_pos: dict[int, int] = {}
        for pos, page in enumerate(pages):
            last_pos[page] = pos
        for page, pos in last_pos.items():
            swa_page = int(self.full_to_swa_page[page])
            if pos < keep_from and swa_page:
                self.full_to_swa_page[page] = 0
                self.swa_kv[swa_page] = float("nan")
                self.free_swa.append(swa_page)
            elif pos >= keep_from and not swa_page:
                self.full_to_swa_page[page] = int(self.free_swa.pop(0))

    def drop(self, rid: str) -> None:
        """Release ``rid`` (no tree insert) and its SWA pages."""
        ps = self.pool.page_size
        request = self.pool.request(rid)
        slots = self.attached.req_to_token_torch()[request.row, : request.kv_len].long()
        for page in set((slots // ps).tolist()):
            swa_page = int(self.full_to_swa_page[page])
            if swa_page:
                self.full_to_swa_page[page] = 0
                self.swa_kv[swa_page] = float("nan")
                self.free_swa.append(swa_page)
        self.pool.release(rid, is_insert=False)

    def extend(self, chunks: Sequence[tuple[str, Sequence[int]]]) -> torch.Tensor:
        starts = [self.pool.request(rid).kv_len for rid, _ in chunks]
        assert self.pool.alloc_extend([(rid, len(ids)) for rid, ids in chunks]) is not None
        for (rid, ids), start in zip(chunks, starts, strict=True):
            self._swa_step(rid, start, start + len(ids))
        items = [
            ExtendItem(self.pool.request(rid).row, start, list(ids))
            for (rid, ids), start in zip(chunks, starts, strict=True)
        ]
        self.bind()
        return self.model.extend(items)

    def decode(self, rids: Sequence[str], last_tokens: Sequence[int]) -> torch.Tensor:
        assert self.pool.alloc_decode(rids) is not None
        for rid in rids:
            seq_len = self.pool.request(rid).kv_len
            self._swa_step(rid, seq_len - 1, seq_len)
        rows = [self.pool.request(rid).row for rid in rids]
        seq_lens = [self.pool.request(rid).kv_len for rid in rids]
        self.bind()
        return self.model.decode(np.array(rows), np.array(seq_lens), list(last_tokens))
