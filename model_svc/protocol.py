"""model_svc wire messages: the framing of memsvc (msgpack header + raw int64 frames).

A forward request names the requests by ``req_to_token`` row; the worker
reads their slots from the shared table, so scheduler, memory service and
worker agree on where each token's KV lives by construction.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter

from memsvc import protocol as memsvc_protocol
from memsvc.protocol import IntArray, Message

# SGLang's _SAMPLING_EPS (sampling_params.py): 0 <= temperature < it is greedy decoding.
# Far smaller temperatures overflow float32 logits (below ~1e-45 they are 0 in float32).
SAMPLING_EPS = 1e-6


def _greedy_below_eps(temperature: float) -> float:
    return 0.0 if temperature < SAMPLING_EPS else temperature


def _usable_in_float32(top_p: float) -> float:
    """The nucleus cut runs in float32: a top_p that rounds to 0 there would keep nothing."""
    if np.float32(top_p) <= 0:
        raise ValueError(f"top_p must be in (0, 1] in float32, and {top_p!r} rounds to 0 there")
    return top_p


# Sampling values as every wire of the stack takes them (the worker's, the scheduler's,
# HTTP): a bad one is refused where it enters, never turned into NaNs in a batch.
Temperature = Annotated[float, Field(ge=0.0, le=100.0), AfterValidator(_greedy_below_eps)]
TopP = Annotated[float, Field(gt=0.0, le=1.0), AfterValidator(_usable_in_float32)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
MAX_TOP_LOGPROBS = 20
MAX_SUPPRESSED_IDS = 1024


class Sampling(BaseModel):
    """How a request's next token is drawn: the one schema of sampling parameters.

    The scheduler's ``GenSampling`` (what a client asks for) adds the
    request's limits to it; :class:`SamplingSpec` (what the worker is sent per
    step) adds what the scheduler decides for that step. A new field here
    reaches the sampler through both wires with no copy on the way.
    Temperature 0 (or below :data:`SAMPLING_EPS`) is greedy.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: int = Field(default=0, ge=0, lt=2**63)  # 0: no top-k cut
    min_p: MinP = 0.0
    # The scheduler draws a request's seed 0 from its rid; the worker takes it as it is.
    seed: int = Field(default=0, ge=0, lt=2**63)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


class SamplingSpec(Sampling):
    """One request's sampling in one forward step, as the scheduler decides it."""

    logprobs: bool = False  # the chosen token's logprob
    top_logprobs_num: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    # Token ids that cannot be chosen in this step (SGLang's min_new_tokens: EOS, stop ids).
    suppress_token_ids: list[int] = Field(default_factory=list, max_length=MAX_SUPPRESSED_IDS)


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
    # Input logprobs: from new token ``logprob_starts[i]`` on (``num_tokens[i]``: none),
    # each position's logprob of the token after it. That is the next new token, or
    # for the last one ``next_token_ids[i]`` (the next chunk's first token; -1: the
    # token sampled here). Top-k too when the request's ``top_logprobs_num`` says.
    logprob_starts: IntArray | None = None
    next_token_ids: IntArray | None = None


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
