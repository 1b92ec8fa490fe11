"""Drive a KVPool and the model the way a scheduler does, for the model tests.

::

    admit:   open_request(rid); prefix_len = match_prefix(rid, ids[:-1])
    extend:  alloc_extend([(rid, n), ...]);  model.extend([ExtendItem(row, kv_len, new_ids)])
    decode:  alloc_decode(rids);             model.decode(rows, kv_lens, last_tokens)
    finish:  release(rid, prompt + output[:-1])   (the last output has no KV yet)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from memsvc.core import KVPool, PoolLayout, attach
from memsvc.core.backends import AttachedBuffers
from model_svc.config import ModelConfig
from model_svc.model import ExtendItem, LlamaModel


def model_layout(config: ModelConfig, page_size: int, **overrides: int | str) -> PoolLayout:
    """A float32 pool of 1024 token slots that fits ``config``."""
    fields: dict = dict(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        page_size=page_size,
        num_pages=1024 // page_size,
        dtype="float32",
        max_running_requests=8,
        max_context_len=512,
    )
    fields.update(overrides)
    return PoolLayout(**fields)


@dataclass
class BoundPool:
    pool: KVPool
    model: LlamaModel
    attached: AttachedBuffers

    @classmethod
    def attach(cls, pool: KVPool, model: LlamaModel) -> BoundPool:
        """Map the pool as the model worker would (``attach`` of its handle) and bind it."""
        bound = cls(pool, model, attach(pool.buffers.handle()))
        bound.bind()
        return bound

    def bind(self) -> None:
        """(Re)bind the model to this pool: one session model serves several pools."""
        self.model.bind(
            self.attached.kv_torch(), self.attached.req_to_token_torch(), self.pool.page_size
        )

    def close(self) -> None:
        self.model.unbind()
        self.attached.close()

    def kv_snapshot(self) -> np.ndarray:
        return self.pool.buffers.kv.copy()

    # -- scheduler steps -------------------------------------------------------

    def admit(self, rid: str, token_ids: Sequence[int]) -> int:
        """Open ``rid`` and reuse its cached prefix; returns the prefix length."""
        self.pool.open_request(rid)
        return self.pool.match_prefix(rid, token_ids[:-1])

    def extend(self, chunks: Sequence[tuple[str, Sequence[int]]]) -> torch.Tensor:
        """Allocate and run each request's next tokens after the KV it already has."""
        starts = [self.pool.request(rid).kv_len for rid, _ in chunks]
        assert self.pool.alloc_extend([(rid, len(ids)) for rid, ids in chunks]) is not None
        items = [
            ExtendItem(self.pool.request(rid).row, start, list(ids))
            for (rid, ids), start in zip(chunks, starts, strict=True)
        ]
        self.bind()
        return self.model.extend(items)

    def decode(self, rids: Sequence[str], last_tokens: Sequence[int]) -> torch.Tensor:
        assert self.pool.alloc_decode(rids) is not None
        rows = [self.pool.request(rid).row for rid in rids]
        seq_lens = [self.pool.request(rid).kv_len for rid in rids]
        self.bind()
        return self.model.decode(np.array(rows), np.array(seq_lens), list(last_tokens))

    def generate(
        self,
        prompts: dict[str, list[int]],
        max_new_tokens: int,
        *,
        chunk_size: int | None = None,
    ) -> dict[str, list[int]]:
        """Greedy: admit all, prefill, decode together. The requests stay open."""
        prefix_lens = {rid: self.admit(rid, ids) for rid, ids in prompts.items()}
        first = self.prefill(prompts, prefix_lens, chunk_size=chunk_size)
        return self.continue_decode(first, max_new_tokens)

    def prefill(
        self,
        prompts: dict[str, list[int]],
        prefix_lens: dict[str, int],
        *,
        chunk_size: int | None = None,
    ) -> dict[str, list[int]]:
        """Extend every admitted request past its prefix, ``chunk_size`` tokens per step;
        returns each one's first (greedy) output token."""
        pending = {rid: ids[prefix_lens[rid] :] for rid, ids in prompts.items()}
        outputs: dict[str, list[int]] = {}
        while pending:
            batch = [(rid, rest[:chunk_size]) for rid, rest in pending.items()]
            logits = self.extend(batch)
            for (rid, chunk), row_logits in zip(batch, logits, strict=True):
                pending[rid] = pending[rid][len(chunk) :]
                if not pending[rid]:
                    del pending[rid]
                    outputs[rid] = [int(row_logits.argmax())]
        return outputs

    def continue_decode(
        self, outputs: dict[str, list[int]], max_new_tokens: int
    ) -> dict[str, list[int]]:
        """Greedy decode steps over every request in ``outputs`` until each has enough."""
        while rids := [rid for rid, out in outputs.items() if len(out) < max_new_tokens]:
            logits = self.decode(rids, [outputs[rid][-1] for rid in rids])
            for rid, row_logits in zip(rids, logits, strict=True):
                outputs[rid].append(int(row_logits.argmax()))
        return outputs

    def finish(self, rid: str, prompt: list[int], output: list[int]) -> None:
        """Release ``rid`` and insert its KV'd tokens into the radix tree."""
        self.pool.release(rid, prompt + output[:-1])
