"""The generate API of scheduler_svc (over ZMQ, memsvc's framing).

A client sends ``generate`` and gets, on the same ``op_id``, zero or more
``chunk`` replies (with ``stream``: the new tokens since the last one) and
then exactly one ``done`` reply with the output and SGLang-shaped
``meta_info``. Every ``chunk`` carries a ``meta_info`` too: the counts so far
(``prompt_tokens``, ``cached_tokens``, ``completion_tokens``,
``num_retractions``) and, with ``return_logprob``, the logprobs of the tokens
new in that chunk (the first chunk also the prompt's). ``abort`` ends a
request early: its ``done`` carries the partial output and an abort
``finish_reason``. ``flush_cache`` empties the prefix cache when no request is
running or waiting (SGLang's ``/flush_cache``), else answers ``ok: false``;
with a ``cache_salt`` and/or ``extra_key`` it empties only that namespace's
cached KV (every tier), whatever runs.

``cache_salt`` / ``extra_key`` (SGLang's): two requests share cached KV only if
both are equal. The scheduler turns them into the request's namespace once, at
intake (:func:`memsvc.namespace.namespace_of`); memsvc never sees them.

Logprobs follow SGLang's ``return_logprob`` / ``logprob_start_len`` /
``top_logprobs_num``: ``meta_info`` gains ``input_token_logprobs`` and
``output_token_logprobs``, lists of ``[logprob, token_id, None]`` (and, with
``top_logprobs_num > 0``, ``input_top_logprobs`` / ``output_top_logprobs``: per
position a list of ``[logprob, token_id, None]``, or None). The input ones
cover the prompt from ``logprob_start_len`` (-1: none); their first entry has
no logprob (None), as in SGLang. Output logprobs are those of the
distribution sampled from (raw logits for greedy, temperature-scaled for
sampling); input logprobs are of the raw logits.

``adopted`` asks a restarted scheduler which of the given rids it adopted from
its dead predecessor with their KV and still holds for the client named beside
each (the PD router asks a restarted decode node, to prefill only the others
again; :mod:`scheduler_svc.adopt`).

A rid belongs to the ``client`` that submitted it: a random id the client
makes once (:class:`scheduler_svc.client.GenerateClient` does) and sends with
every ``generate`` and ``abort``, also after it reconnects. Only that client
may re-submit a live rid (taking over its replies) or abort it; anyone who
does not know the id cannot guess it. A rid that finished recently is answered
from the scheduler's cache of results (the same submission only), which keeps
at most :data:`RESULT_CACHE_SIZE` results and :data:`RESULT_CACHE_BYTES` bytes
of them (``--result-cache-bytes``), the oldest forgotten first.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, model_validator

from memsvc import protocol as wire
from memsvc.limits import MessageLimit
from memsvc.namespace import namespace_of
from memsvc.protocol import IntArray, Message
from model_svc.protocol import Sampling

MAX_PROMPT_TOKENS = 1 << 20
MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024
# Finished results kept to answer a re-submitted rid: at most this many, holding at most
# this many bytes as msgpack (the newest is always kept).
RESULT_CACHE_SIZE = 1024
RESULT_CACHE_BYTES = 64 << 20
# SGLang's answer (400) to a prompt with no tokens: nothing to prefill, nothing to sample from
EMPTY_PROMPT = "Prompt cannot be empty"
# What a message to the scheduler (or the router) may hold: the largest generate is
# MAX_PROMPT_TOKENS int64 ids (8 MiB) or as text (4 MiB of UTF-8), a header, and a
# routing identity. A frame past 4 x 16 MiB drops its sender unread.
MESSAGE_LIMIT = MessageLimit(max_bytes=16 << 20, max_frames=8)
# What the wire (msgpack, int64 array frames) carries: a larger integer is refused where it
# enters, not found unpackable later.
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_LEN)]
# A cache_salt or extra_key ("" is the front's None: SGLang reads it as unset).
MAX_CACHE_KEY_LEN = 4096
CacheKey = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_KEY_LEN)]


class GenSampling(Sampling):
    """SGLang's ``sampling_params`` subset kvstack honours: how each token is drawn
    (:class:`model_svc.protocol.Sampling`, the worker's schema) and the request's limits.

    ``stop``: generation ends once the decoded output contains one of these
    strings (finish_reason ``{"type": "stop", "matched": "<it>"}``); the
    ``text`` is cut before it (and before a matched stop token) unless
    ``no_stop_trim``. ``min_new_tokens``: EOS and ``stop_token_ids`` cannot be
    sampled before that many tokens (SGLang masks them). ``min_p``: tokens less
    likely than ``min_p`` times the most likely one are not drawn.
    ``skip_special_tokens``: how ``text`` is decoded. ``seed`` 0: one drawn from the rid.
    """

    max_new_tokens: int = Field(default=128, ge=0, le=1 << 20)
    min_new_tokens: int = Field(default=0, ge=0, le=1 << 20)
    ignore_eos: bool = False
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[Int64] = Field(default_factory=list, max_length=64)
    no_stop_trim: bool = False
    skip_special_tokens: bool = True


ClientId = Annotated[str, Field(min_length=1, max_length=64)]
Rid = Annotated[str, Field(min_length=1, max_length=256)]


class Generate(Message):
    op: Literal["generate"]
    rid: Rid
    client: ClientId
    input_ids: IntArray | None = None
    text: str | None = Field(default=None, max_length=MAX_PROMPT_TOKENS)
    sampling: GenSampling = Field(default_factory=GenSampling)
    stream: bool = False
    priority: Int64 | None = None
    # SGLang's logprob fields (see the module docstring).
    return_logprob: bool = False
    logprob_start_len: int = Field(default=-1, ge=-1, lt=2**63)
    top_logprobs_num: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    # PD mode: set by the router; pairs the prefill and decode sides of one request.
    bootstrap_room: int | None = Field(default=None, ge=0, lt=2**63)
    # PD re-bootstrap: the decode side knows this request by another rid.
    bootstrap_rid: str | None = Field(default=None, min_length=1, max_length=256)
    # PD behind SGLang's router (prefill node): the decode memsvc's transfer socket.
    bootstrap_peer: str | None = Field(default=None, min_length=1, max_length=512)
    # PD router (decode node): when the request moves to another decode node, answer
    # ``moved`` (that node's address) instead of relaying its replies; the sender then
    # re-submits it there (scheduler_svc.pd.migrate).
    follow_moves: bool = False
    # Which cached KV the request may share (see the module docstring).
    cache_salt: CacheKey | None = None
    extra_key: CacheKey | None = None

    @property
    def namespace(self) -> str:
        return namespace_of(self.cache_salt, self.extra_key)

    @model_validator(mode="after")
    def _one_input(self) -> Generate:
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("give exactly one of input_ids and text")
        if self.input_ids is None:
            return self
        if self.input_ids.size == 0:
            raise ValueError("input_ids must hold 1 or more tokens")
        if self.input_ids.size > MAX_PROMPT_TOKENS:
            raise ValueError(
                f"input_ids holds {self.input_ids.size} tokens, more than the limit of "
                f"{MAX_PROMPT_TOKENS}"
            )
        return self


class MigrateIn(Message):
    """Decode node to decode node (issue 32): take over ``rid``, retracted on the sender
    with ``output_ids`` generated so far. Its KV (prompt and all but the last output
    token) arrives from the sender's memsvc into ``room``; the request then decodes
    on here, and its replies (streamed from the first new token) go to the sender,
    which relays them to the request's client, or tells that client where it moved
    (``follow_moves``), which then re-submits it here."""

    op: Literal["migrate_in"]
    rid: Rid
    client: ClientId
    input_ids: IntArray
    output_ids: IntArray
    sampling: GenSampling = Field(default_factory=GenSampling)
    priority: Int64 | None = None
    namespace: str = Field(default="", max_length=256)  # the sender's, as it is
    room: int = Field(ge=0, lt=2**63)
    retractions: int = Field(default=0, ge=0, lt=2**31)
    cached_tokens: int = Field(default=0, ge=0, lt=2**63)
    # The request's own client and fingerprint on the sender: a re-submission by that
    # client (a router following the move) attaches here, and its abort ends it.
    owner: ClientId | None = None
    fingerprint: str | None = Field(default=None, max_length=64)
    # what intake's checks read of a generate: a moved request returns no logprobs
    return_logprob: Literal[False] = False
    logprob_start_len: Literal[-1] = -1

    @model_validator(mode="after")
    def _lengths(self) -> MigrateIn:
        if not 0 < self.input_ids.size <= MAX_PROMPT_TOKENS:
            raise ValueError(f"input_ids must hold 1 to {MAX_PROMPT_TOKENS} tokens")
        if not 0 < self.output_ids.size <= self.sampling.max_new_tokens:
            raise ValueError("output_ids must hold 1 to max_new_tokens tokens")
        return self


class Abort(Message):
    op: Literal["abort"]
    rid: Rid
    client: ClientId


class Info(Message):
    op: Literal["info"]


MAX_ADOPTED_QUERY = 16384  # rids one ``adopted`` may ask about


class Adopted(Message):
    """Which of ``rids`` (each with the ``clients`` id that submitted it) this scheduler
    adopted from its dead predecessor with their KV, still waiting for that client to
    re-submit them (:mod:`scheduler_svc.adopt`). The PD router asks a restarted decode
    node, so as not to prefill those again. A rid another client owns is not named."""

    op: Literal["adopted"]
    rids: list[Rid] = Field(max_length=MAX_ADOPTED_QUERY)
    clients: list[ClientId] = Field(max_length=MAX_ADOPTED_QUERY)

    @model_validator(mode="after")
    def _pairs(self) -> Adopted:
        if len(self.rids) != len(self.clients):
            raise ValueError("rids and clients must be of the same length")
        return self


class FlushCache(Message):
    """Empty the prefix cache, if no request is running or waiting; with a cache key,
    only that namespace's cached KV, at once."""

    op: Literal["flush_cache"]
    cache_salt: CacheKey | None = None
    extra_key: CacheKey | None = None

    @property
    def namespace(self) -> str | None:
        """The namespace to flush; None: all of them."""
        if self.cache_salt is None and self.extra_key is None:
            return None
        return namespace_of(self.cache_salt, self.extra_key)


Request = Annotated[
    Generate | MigrateIn | Abort | Info | Adopted | FlushCache, Field(discriminator="op")
]
REQUEST_ADAPTER: TypeAdapter[Any] = TypeAdapter(Request)


def parse_request(frames: list[bytes]) -> Any:
    return wire.parse_request(frames, REQUEST_ADAPTER)
