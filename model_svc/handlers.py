"""The model worker's request handlers: decode a forward batch, run it, sample.

:meth:`ModelService.handle` turns one request into one reply and never
raises. The model checks a batch in full before it touches the pool: rows
in range, lengths within the context, every position's slot on a real page
(memsvc zeroes a request's row when it closes it, so a stale or unknown row
points at the padding page and is refused). Nothing is written for a
refused batch. Forward passes write only the slots they are given, so the
same batch sent again (a retry) writes the same bytes and returns the same
tokens.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from memsvc import protocol as wire
from memsvc.core.errors import MemsvcError
from model_svc import protocol as p
from model_svc.config import ModelConfig
from model_svc.errors import InvalidBatchError, ModelLayoutError, ModelSvcError
from model_svc.model import ExtendItem, LlamaModel
from model_svc.sampling import (
    GREEDY,
    sample,
    sampling_logprobs,
    suppressed,
    top_logprobs,
)

log = logging.getLogger("model_svc")


class StalePoolError(ModelSvcError):
    """The request was meant for another memsvc epoch than the pool this worker maps."""

    code = "stale_pool"


@dataclass
class AttachedPool:
    """The pool the model is bound to, and the memsvc epoch it belongs to."""

    epoch: str
    views: Any  # memsvc AttachedBuffers: kept alive while the model reads it


class ModelService:
    """Runs forward passes of ``model`` over the pool that ``attach_pool()`` maps.

    ``attach_pool`` (re)connects to memsvc and returns the current pool; it is
    called again when a request names a newer memsvc epoch (memsvc restarted).
    """

    def __init__(self, model: LlamaModel, attach_pool: Callable[[], AttachedPool]) -> None:
        self.model = model
        self.epoch = secrets.token_hex(8)
        self._attach_pool = attach_pool
        self.pool: AttachedPool | None = None
        self.counters = {"extend_tokens": 0, "decode_tokens": 0, "forward_passes": 0}
        self._bind()
        self._handlers = {"info": self._info, "extend": self._extend, "decode": self._decode}

    def _bind(self) -> None:
        old, self.pool = self.pool, self._attach_pool()
        views = self.pool.views
        check_layer_types(self.model.config, views.layout)
        self.model.bind(
            views.kv_torch(),
            views.req_to_token_torch(),
            views.layout.page_size,
            views.swa_kv_torch(),
            views.full_to_swa_page_torch(),
        )
        if old is not None and old.views is not views:
            old.views.close()  # the model holds no view of the old pool any more
        log.info("bound to memsvc pool epoch %s (%s)", self.pool.epoch, views.layout)

    # -- the edge --------------------------------------------------------------

    def handle(self, frames: list[bytes]) -> list[bytes]:
        op_id = None
        try:
            msg = p.parse_request(frames)
            op_id = msg.op_id
            fields, arrays = self._handlers[msg.op](msg)
            return wire.pack({"ok": True, "op_id": op_id, "epoch": self.epoch, **fields}, arrays)
        except wire.ProtocolError as exc:
            # Echo the op_id even of an invalid message: the client matches by it.
            return self._error(wire.best_effort_op_id(frames), exc.code, exc.message)
        except (ModelSvcError, MemsvcError) as exc:
            return self._error(op_id, exc.code, str(exc))
        except Exception as exc:  # a bug: answer, log, keep serving
            log.exception("internal error")
            return self._error(op_id, "internal", f"{type(exc).__name__}: {exc}")

    def reject(self, frames: list[bytes], error: wire.ProtocolError) -> list[bytes]:
        """The reply to a message the shell did not read whole (over the size limit)."""
        return self._error(wire.best_effort_op_id(frames), error.code, error.message)

    def _error(self, op_id: int | None, code: str, message: str) -> list[bytes]:
        header = {
            "ok": False,
            "op_id": op_id,
            "epoch": self.epoch,
            "code": code,
            "message": message,
        }
        return wire.pack(header)

    # -- ops -------------------------------------------------------------------

    def _info(self, msg: p.Info) -> tuple[dict[str, Any], None]:
        return {
            "model": self.model.config.to_dict(),
            "pool_epoch": self.pool.epoch,
            "layout": self.pool.views.layout.to_dict(),
            "counters": dict(self.counters),
        }, None

    def _extend(self, msg: p.Extend) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        self._check_epoch(msg.pool_epoch)
        rows, prefix_lens, num_tokens = msg.rows, msg.prefix_lens, msg.num_tokens
        count = rows.size
        if not (prefix_lens.size == num_tokens.size == count) or count == 0:
            raise InvalidBatchError("rows, prefix_lens and num_tokens need one entry per request")
        if (num_tokens < 1).any() or (prefix_lens < 0).any():
            raise InvalidBatchError("every request needs >= 1 new token and a prefix_len >= 0")
        if int(num_tokens.sum()) != msg.token_ids.size:
            raise InvalidBatchError(
                f"token_ids has {msg.token_ids.size} ids, num_tokens add up to "
                f"{int(num_tokens.sum())}"
            )
        ends = prefix_lens + num_tokens
        sampling = self._sampling(msg.sampling, count)
        starts = np.concatenate([[0], np.cumsum(num_tokens)[:-1]])
        items = [
            ExtendItem(int(row), int(prefix), msg.token_ids[start : start + n])
            for row, prefix, start, n in zip(
                rows.tolist(),
                prefix_lens.tolist(),
                starts.tolist(),
                num_tokens.tolist(),
                strict=True,
            )
        ]
        starts = self._logprob_starts(msg, num_tokens)
        logits, spans = self.model.extend_with_positions(items, starts)
        self.counters["extend_tokens"] += int(num_tokens.sum())
        fields, arrays = self._sampled(logits, sampling, ends - 1)
        if starts is not None:
            sampled = arrays["next_token_ids"].tolist()
            next_ids = msg.next_token_ids.tolist() if msg.next_token_ids is not None else None
            fields["input_logprobs"] = [
                _input_logprobs(self.model, span, item.token_ids[start + 1 :], after, param)
                for span, item, start, after, param in zip(
                    spans,
                    items,
                    starts,
                    [
                        t if next_ids is None or next_ids[i] < 0 else next_ids[i]
                        for i, t in enumerate(sampled)
                    ],
                    sampling,
                    strict=True,
                )
            ]
        return fields, arrays

    def _decode(self, msg: p.Decode) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        self._check_epoch(msg.pool_epoch)
        rows, seq_lens = msg.rows, msg.seq_lens
        count = rows.size
        if not (seq_lens.size == msg.token_ids.size == count) or count == 0:
            raise InvalidBatchError("rows, seq_lens and token_ids need one entry per request")
        sampling = self._sampling(msg.sampling, count)
        logits = self.model.decode(rows, seq_lens, msg.token_ids)
        self.counters["decode_tokens"] += count
        return self._sampled(logits, sampling, seq_lens - 1)

    # -- helpers ---------------------------------------------------------------

    def _check_epoch(self, pool_epoch: str | None) -> None:
        if pool_epoch is None or pool_epoch == self.pool.epoch:
            return
        log.warning(
            "request for memsvc epoch %s, bound to %s: re-attaching", pool_epoch, self.pool.epoch
        )
        self._bind()
        if pool_epoch != self.pool.epoch:
            raise StalePoolError(
                f"the request is for memsvc epoch {pool_epoch}, the pool is {self.pool.epoch}"
            )

    def _logprob_starts(self, msg: p.Extend, num_tokens: np.ndarray) -> list[int] | None:
        if msg.logprob_starts is None:
            if msg.next_token_ids is not None:
                raise InvalidBatchError("next_token_ids needs logprob_starts")
            return None
        count = num_tokens.size
        if msg.logprob_starts.size != count or (
            msg.next_token_ids is not None and msg.next_token_ids.size != count
        ):
            raise InvalidBatchError("logprob_starts and next_token_ids need one entry per request")
        if (msg.logprob_starts < 0).any():
            raise InvalidBatchError("logprob_starts must be >= 0")
        after = msg.next_token_ids
        vocab = self.model.config.vocab_size
        if after is not None and ((after < -1) | (after >= vocab)).any():
            raise InvalidBatchError(f"next_token_ids must be -1 or in 0..{vocab - 1}")
        return np.minimum(msg.logprob_starts, num_tokens).tolist()

    def _sampling(self, specs: list[p.SamplingSpec] | None, count: int) -> list[p.SamplingSpec]:
        """One spec per request, as the wire gave them (the sampler takes them as they are)."""
        if specs is None:
            return [GREEDY] * count
        if len(specs) != count:
            raise InvalidBatchError(f"{len(specs)} sampling specs for {count} requests")
        return specs

    def _sampled(
        self, logits: Any, sampling: list[p.SamplingSpec], positions: np.ndarray
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        result = sample(logits, sampling, positions.tolist())
        self.counters["forward_passes"] += 1
        fields: dict[str, Any] = {}
        if result.logprobs is not None:
            fields["logprobs"] = [
                float(lp) if param.logprobs else None
                for lp, param in zip(result.logprobs.tolist(), sampling, strict=True)
            ]
        nums = [param.top_logprobs_num for param in sampling]
        if any(nums):
            rows = sampling_logprobs(suppressed(logits.float(), sampling), sampling)
            fields["top_logprobs"] = [
                None if top is None else [top[0], top[1]] for top in top_logprobs(rows, nums)
            ]
        return fields, {"next_token_ids": result.token_ids.numpy().astype(np.int64)}


INPUT_LOGITS_BLOCK = 256  # prompt positions turned into logits at a time


def check_layer_types(config: ModelConfig, layout: Any) -> None:
    """A hybrid (two-pool) layout must window the model's layers, with its window.

    A one-pool layout fits any model: its sliding layers are masked to their window
    in the one pool."""
    if not layout.is_hybrid:
        return
    if tuple(layout.layer_types) != config.layer_types or layout.sliding_window != (
        config.sliding_window
    ):
        raise ModelLayoutError(
            f"the pool's layer_types {list(layout.layer_types)} and sliding_window "
            f"{layout.sliding_window} are not the model's ({list(config.layer_types)}, "
            f"{config.sliding_window})"
        )


def _input_logprobs(
    model: LlamaModel, span: Any, following: Any, after: int, param: p.SamplingSpec
) -> dict[str, Any] | None:
    """One request's input logprobs: each position of ``span`` (hidden states
    ``[m, hidden]``) scores the token after it (``following``, then ``after``); of
    the raw logits, as SGLang. Logits are made a block of positions at a time."""
    if span is None:
        return None
    targets = torch.as_tensor([int(t) for t in following] + [int(after)], dtype=torch.int64)
    chosen: list[float] = []
    top: list[list[list]] | None = [] if param.top_logprobs_num > 0 else None
    with torch.inference_mode():
        for begin in range(0, span.shape[0], INPUT_LOGITS_BLOCK):
            block = span[begin : begin + INPUT_LOGITS_BLOCK]
            logprobs = torch.log_softmax(model.logits(block).float(), dim=-1)
            index = targets[begin : begin + block.shape[0]].to(logprobs.device)
            chosen += logprobs.gather(1, index[:, None])[:, 0].tolist()
            if top is not None:
                rows = top_logprobs(logprobs, [param.top_logprobs_num] * block.shape[0])
                top += [[values, ids] for values, ids in rows]
    return {"logprobs": chosen, "top": top}
