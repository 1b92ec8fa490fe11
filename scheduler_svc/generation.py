"""One generate without I/O: what both clients of :mod:`scheduler_svc.client` share.

:class:`Generation` builds the frames of each try of a request, turns each
reply into what the caller gets (a :class:`GenerateResult`, or a
:class:`Chunk` of tokens not given out yet) and says when the faults are too
many (:class:`SchedulerLostError`); a transport sends the frames and reads the
replies. The answers to ``abort`` and ``flush_cache`` are read here too.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from memsvc import protocol as wire
from memsvc.client import PeerDeadError
from scheduler_svc.protocol import GenSampling

if TYPE_CHECKING:
    from scheduler_svc.client import GenerateAPI


class GenerateError(Exception):
    """The scheduler rejected the request (bad input, too large...); ``status_code`` says how."""

    def __init__(self, code: str, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status_code = status_code


class SchedulerLostError(GenerateError, PeerDeadError):
    """The scheduler died or went silent, and re-submitting the request did not help."""

    def __init__(self, address: str, rid: str, faults: list[str]) -> None:
        GenerateError.__init__(
            self,
            "scheduler_unavailable",
            f"scheduler at {address} lost request {rid!r} {len(faults)} times "
            f"({'; '.join(faults)}); gave up",
            503,
        )
        self.faults = list(faults)


class Fault(Exception):
    """This try of a request failed (disconnect, silence, lost chunk): send it again."""


DEFAULT_RESUBMITS = 3


@dataclass(frozen=True)
class Chunk:
    """New output tokens of a streaming request, starting at output position ``offset``."""

    rid: str
    token_ids: list[int]
    offset: int
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateResult:
    rid: str
    output_ids: list[int]
    text: str | None
    meta_info: dict[str, Any] = field(default_factory=dict)

    @property
    def finish_reason(self) -> dict[str, Any]:
        return self.meta_info.get("finish_reason", {})


class LogprobArgs(NamedTuple):
    """SGLang's logprob fields of a generate."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0


class CacheKeys(NamedTuple):
    """SGLang's ``cache_salt`` and ``extra_key`` of a generate: requests share cached KV
    only if both are equal (the scheduler's namespace: :func:`memsvc.namespace.namespace_of`)."""

    cache_salt: str | None = None
    extra_key: str | None = None


class Bootstrap(NamedTuple):
    """A PD node's half of a request paired by SGLang's router (SMG), not kvstack's: its
    ``bootstrap_room``, and on the prefill node the decode memsvc's transfer socket."""

    bootstrap_room: int | None = None
    bootstrap_peer: str | None = None
    bootstrap_rid: str | None = None  # the decode node's rid for it (prefill node)


def unpack_reply(frames: list[bytes]) -> dict[str, Any] | None:
    """A reply's header, or None for one damaged in transit (no reply, as if lost)."""
    try:
        return wire.unpack(frames)
    except wire.ProtocolError:
        return None


def checked(reply: dict[str, Any]) -> dict[str, Any]:
    """``reply``, unless it is an error: then :class:`GenerateError`."""
    if not reply.get("ok"):
        raise GenerateError(
            reply.get("code", "internal"),
            reply.get("message", ""),
            int(reply.get("status_code", 400)),
        )
    return reply


def found(reply: dict[str, Any]) -> bool:
    """An abort's answer: whether the rid was live; an error reply raises."""
    return bool(checked(reply).get("found"))


def flushed(reply: dict[str, Any]) -> tuple[bool, str]:
    """A flush_cache's answer; an error reply raises."""
    return bool(checked(reply).get("flushed")), str(reply.get("message", ""))


def _fresh(chunk: Chunk, delivered: int) -> Chunk | None:
    """The part of ``chunk`` past the ``delivered`` tokens given out already (None: nothing).

    A chunk that starts after them means one was lost: :class:`Fault`.
    """
    if chunk.offset > delivered:
        raise Fault(f"stream chunk at {delivered} lost (got offset {chunk.offset})")
    skip = delivered - chunk.offset
    if skip >= len(chunk.token_ids):
        return None
    if skip == 0:
        return chunk
    meta = {k: v for k, v in chunk.meta_info.items() if not k.startswith("input_")}
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if key in meta:
            meta[key] = meta[key][skip:]
    return Chunk(chunk.rid, chunk.token_ids[skip:], delivered, meta)


def _decode(header: dict[str, Any]) -> Chunk | GenerateResult:
    checked(header)
    if header["type"] == "chunk":
        return Chunk(
            header["rid"],
            list(header["token_ids"]),
            header["offset"],
            dict(header.get("meta_info") or {}),
        )
    return GenerateResult(
        header["rid"], list(header["output_ids"]), header.get("text"), header["meta_info"]
    )


class Generation:
    """One generate as both clients run it, without I/O: the frames of each try, what
    each reply gives out, and when the faults are too many (:class:`SchedulerLostError`).
    """

    def __init__(
        self,
        client: GenerateAPI,
        input_ids: Sequence[int] | np.ndarray | None,
        text: str | None,
        sampling: GenSampling | dict | None,
        rid: str | None,
        stream: bool,
        priority: int | None,
        logprobs: LogprobArgs,
        keys: CacheKeys | None = None,
        bootstrap: Bootstrap | None = None,
    ) -> None:
        self.address, self.resubmits = client.address, client.resubmits
        self.rid = rid or uuid.uuid4().hex
        self.header: dict[str, Any] = {
            "op": "generate",
            "rid": self.rid,
            "client": client.client_id,
            "stream": stream,
            "sampling": GenSampling.model_validate(sampling or {}).model_dump(),
            "priority": priority,
        }
        if logprobs.return_logprob:
            self.header.update(logprobs._asdict())
        for fields in (keys, bootstrap):
            if fields is not None:
                self.header.update({k: v for k, v in fields._asdict().items() if v is not None})
        self.arrays = None
        if input_ids is not None:
            self.arrays = {"input_ids": np.asarray(input_ids, dtype=wire.ARRAY_DTYPE).reshape(-1)}
        else:
            self.header["text"] = text
        self.delivered = 0  # output tokens given out
        self.faults: list[str] = []

    def frames(self, op_id: int) -> list[bytes]:
        """The request of the try numbered ``op_id`` (the same request each time)."""
        return wire.pack({**self.header, "op_id": op_id}, self.arrays)

    def take(self, header: dict[str, Any]) -> Chunk | GenerateResult | None:
        """What a reply gives out: a result, a chunk's new tokens, or None (nothing new)."""
        item = _decode(header)
        if isinstance(item, Chunk):
            item = _fresh(item, self.delivered)
            if item is not None:
                self.delivered += len(item.token_ids)
        return item

    def lost(self, fault: Fault) -> None:
        """This try failed: try again, unless it was the last one."""
        self.faults.append(str(fault))
        if len(self.faults) > self.resubmits:
            raise SchedulerLostError(self.address, self.rid, self.faults)
