"""model_svc wire messages: the framing of memsvc (msgpack header + raw int64 frames).

A forward request names the requests by ``req_to_token`` row; the worker
reads their slots from the shared table, so scheduler, memory service and
worker agree on where each token's KV lives by construction.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from memsvc import protocol as memsvc_protocol
from memsvc.protocol import IntArray, Message


class SamplingSpec(BaseModel):
    """Per-request sampling: temperature 0 is greedy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # 0: no top-k cut
    seed: int = Field(default=0, ge=0, lt=2**63)
    logprobs: bool = False


class Info(Message):
    op: Literal["info"]


class Extend(Message):
    """Compute ``num_tokens[i]`` new tokens of request ``rows[i]``, after ``prefix_lens[i]``."""

    op: Literal["extend"]
    rows: IntArray
    prefix_lens: IntArray
    num_tokens: IntArray
    token_ids: IntArray  # every request's new tokens, one after another
    sampling: list[SamplingSpec] | None = None  # None: greedy for all
    pool_epoch: str | None = Field(default=None, max_length=64)


class Decode(Message):
    """One token per request: ``token_ids[i]`` at position ``seq_lens[i] - 1``."""

    op: Literal["decode"]
    rows: IntArray
    seq_lens: IntArray
    token_ids: IntArray
    sampling: list[SamplingSpec] | None = None
    pool_epoch: str | None = Field(default=None, max_length=64)


Request = Annotated[Info | Extend | Decode, Field(discriminator="op")]
REQUEST_ADAPTER: TypeAdapter[Any] = TypeAdapter(Request)


def parse_request(frames: list[bytes]) -> Any:
    return memsvc_protocol.parse_request(frames, REQUEST_ADAPTER)
