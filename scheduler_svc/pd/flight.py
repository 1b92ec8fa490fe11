"""One client request in flight through both PD nodes, and the router's messages about it."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from memsvc import protocol as wire
from scheduler_svc import protocol as p

log = logging.getLogger("scheduler_svc.pd.router")

ROOM_BITS = 62  # decode-node re-bootstrap rooms start at 1 << 62


def room_for(key: str) -> int:
    """The bootstrap room of a rid: a restarted router pairs the nodes again."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - ROOM_BITS)


@dataclass
class Flight:
    """One client request in flight through both nodes."""

    identity: bytes
    op_id: int
    rid: str
    header: dict[str, Any]  # the generate as the decode node got it
    arrays: dict[str, Any] | None = None
    fingerprint: str = ""  # input + sampling + priority: a re-submission must match it
    prompt_len: int | None = None
    decode_op: int = 0
    decode_address: str = ""  # the decode node that holds it ("": the router's --decode)
    # prefill requests not answered yet: op -> (header, arrays), to re-send or abort
    prefill_ops: dict[int, tuple[dict[str, Any], Any]] = field(default_factory=dict)
    prefill_rids: list[str] = field(default_factory=list)  # its names on the prefill node
    current: int | None = None  # the prefill op whose KV the decode node still waits for
    commit_mark: int = 0  # a decode chunk past this many tokens: that KV arrived
    prefill_sent: float = 0.0  # time.monotonic() of the last prefill request sent
    seen: int = 0  # output tokens the decode node has streamed
    prefill_error: dict[str, Any] | None = None
    resends: int = 0
    redrives: int = 0  # started over on a restarted decode scheduler
    redrive_pending: bool = False  # prefill again once the prefill node answers the last one

    @property
    def client(self) -> str:
        """The client that submitted the request: only it may re-submit or abort it."""
        return self.header["client"]


def unpack_reply(frames: list[bytes], peer: str) -> dict[str, Any] | None:
    """A reply's header, or None for one damaged on the way (dropped, as if lost)."""
    try:
        return wire.unpack(frames)
    except wire.ProtocolError as exc:
        log.warning("dropped an undecodable reply from the %s node: %s", peer, exc.message)
        return None


def fingerprint(msg: p.Generate) -> str:
    """What makes two submissions of one rid the same request."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(msg.input_ids.tobytes() if msg.input_ids is not None else msg.text.encode())
    digest.update(msg.sampling.model_dump_json().encode())
    digest.update(repr(msg.priority).encode())
    digest.update(msg.namespace.encode())
    return digest.hexdigest()


def is_abort(header: dict) -> bool:
    reason = (header.get("meta_info") or {}).get("finish_reason") or {}
    return header.get("type") == "done" and reason.get("type") == "abort"


def error_header(code: str, message: str, status_code: int) -> dict[str, Any]:
    return {"ok": False, "code": code, "message": message, "status_code": status_code}
