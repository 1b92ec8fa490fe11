"""memsvc wire protocol: msgpack headers, raw array frames, pydantic validation.

A message is a ZMQ multipart message::

    frame 0      msgpack map: {"op": ..., "op_id": ..., "session": ..., <fields>,
                               "arrays": ["token_ids", ...]}
    frame 1..n   one raw little-endian int64 array per name in "arrays", in order

Requests are decoded once, at the socket edge, into one of the pydantic
models below (a discriminated union on ``op``); anything malformed becomes a
:class:`ProtocolError` with a stable code. Replies use the same framing: a
header map with ``ok`` (and on error ``code`` / ``message``), the pool sizes and
the service epoch, then the array frames it names.
"""

from __future__ import annotations

import threading
from enum import StrEnum
from typing import Annotated, Any, Literal, get_args

import msgpack
import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from memsvc.namespace import is_namespace

ARRAY_DTYPE = np.dtype("<i8")
ARRAY_ITEMSIZE = ARRAY_DTYPE.itemsize
MAX_RID_LEN = 256
MAX_BATCH = 65536  # requests in one batch op


class ProtocolError(Exception):
    """A message that cannot be accepted; ``code`` goes into the error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# -- arrays ------------------------------------------------------------------------


def _as_int_array(value: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype != ARRAY_DTYPE or value.ndim != 1:
        raise ValueError("must be a raw int64 array frame (listed in 'arrays'), not a list")
    return value


IntArray = Annotated[np.ndarray, BeforeValidator(_as_int_array)]


def _check_split(lens: np.ndarray, values: np.ndarray, count: int, what: str) -> None:
    """``lens`` splits ``values`` into ``count`` parts: one length >= 0 each, adding up
    to its size. ``what``: "<lens field>/<values field>/<part>", for the messages."""
    lens_name, values_name, part = what.split("/")
    if lens.size != count or (lens < 0).any():
        raise ValueError(f"{lens_name} needs one length >= 0 per {part}")
    if int(lens.sum()) != values.size:
        raise ValueError(f"{lens_name} must add up to the size of {values_name}")


RequestId = Annotated[str, Field(min_length=1, max_length=MAX_RID_LEN)]


def _namespace(value: str) -> str:
    if not is_namespace(value):
        raise ValueError(
            "a cache namespace is '' (the default) or 32 lowercase hex digits "
            "(memsvc.namespace.namespace_of), not a salt"
        )
    return value


# A cache namespace (memsvc.namespace): "" (the default) or 32 lowercase hex digits.
Namespace = Annotated[str, AfterValidator(_namespace)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    op_id: int = Field(ge=0, lt=2**63)
    session: str | None = Field(default=None, max_length=64)


# -- requests ----------------------------------------------------------------------


class Hello(Message):
    op: Literal["hello"]
    role: Literal["scheduler", "worker", "peer"]
    lease_s: float = Field(default=10.0, gt=0, le=3600)
    name: str = Field(default="", max_length=128)


class Heartbeat(Message):
    op: Literal["heartbeat"]


class Goodbye(Message):
    """End a session now: everything it holds is reclaimed, as on lease expiry."""

    op: Literal["goodbye"]


class Stats(Message):
    op: Literal["stats"]


class FlushCache(Message):
    """Evict everything evictable from the prefix tree (SGLang's ``flush_cache``): with the
    hierarchical cache, also every host and storage copy, unless ``device_only`` (which
    moves the device tier down, as pressure would, for studying the tiers)."""

    op: Literal["flush_cache"]
    device_only: bool = False
    # None: every namespace; else that cache namespace's KV alone, in every tier
    namespace: Namespace | None = None


class Check(Message):
    """Run the pool's integrity check (with ``idle``: also that nothing is held)."""

    op: Literal["check"]
    idle: bool = False


class AllocRow(Message):
    """Open ``rid`` in cache ``namespace``: every later tree op on it uses that namespace."""

    op: Literal["alloc_row"]
    rid: RequestId
    namespace: Namespace = ""


class FreeRow(Message):
    """Close a request without caching anything (its tree prefix stays, unlocked)."""

    op: Literal["free_row"]
    rid: RequestId


class MatchPrefix(Message):
    op: Literal["match_prefix"]
    rid: RequestId
    token_ids: IntArray


class TokenBatch(Message):
    """A batch of requests with their token ids: ``token_ids`` concatenated, ``token_lens``
    one length per rid, no rid twice."""

    rids: list[RequestId] = Field(max_length=MAX_BATCH)
    token_ids: IntArray
    token_lens: IntArray

    @model_validator(mode="after")
    def _one_length_per_rid(self) -> TokenBatch:
        _check_split(self.token_lens, self.token_ids, len(self.rids), "token_lens/token_ids/rid")
        if len(set(self.rids)) != len(self.rids):
            raise ValueError("a rid appears twice in one batch")
        return self


class Admit(TokenBatch):
    """Open, match and lock a round's admission candidates in order (``alloc_row`` then
    ``match_prefix`` for each), each with its ids to match. Stops at the first that gets
    no row. ``recompute_s_per_token``: the worker's prefill time per token, as the
    scheduler measures it (the hierarchical cache's load-or-recompute model)."""

    op: Literal["admit"]
    recompute_s_per_token: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # one cache namespace per rid, in order (None: all the default namespace)
    namespaces: list[Namespace] | None = Field(default=None, max_length=MAX_BATCH)

    @model_validator(mode="after")
    def _one_namespace_per_rid(self) -> Admit:
        if self.namespaces is not None and len(self.namespaces) != len(self.rids):
            raise ValueError("namespaces needs one namespace per rid")
        return self


class AllocExtend(Message):
    """New positions for ``rids``, all or nothing; first, ``free_rids`` (the round's
    candidates not admitted) are closed as by ``free_row``, whether or not it fits."""

    op: Literal["alloc_extend"]
    rids: list[RequestId] = Field(max_length=MAX_BATCH)
    num_tokens: IntArray
    free_rids: list[RequestId] = Field(default_factory=list, max_length=MAX_BATCH)

    @model_validator(mode="after")
    def _disjoint(self) -> AllocExtend:
        if len(set(self.free_rids)) != len(self.free_rids):
            raise ValueError("a rid appears twice in free_rids")
        if not set(self.free_rids).isdisjoint(self.rids):
            raise ValueError("a rid cannot be both extended and freed")
        return self


class CacheUnfinished(Message):
    op: Literal["cache_unfinished"]
    rid: RequestId
    token_ids: IntArray


class Release(Message):
    op: Literal["release"]
    rid: RequestId
    is_insert: bool
    token_ids: IntArray | None = None


class CacheUnfinishedMany(TokenBatch):
    """``cache_unfinished`` for each rid."""

    op: Literal["cache_unfinished_many"]


class ReleaseMany(TokenBatch):
    """``release`` for each rid, all checked first (the token ids of a rid not inserted
    are ignored)."""

    op: Literal["release_many"]
    is_insert: list[bool] = Field(max_length=MAX_BATCH)

    @model_validator(mode="after")
    def _one_flag_per_rid(self) -> ReleaseMany:
        if len(self.is_insert) != len(self.rids):
            raise ValueError("is_insert needs one flag per rid")
        return self


class DecodeStep(Message):
    op: Literal["decode_step"]
    rows: IntArray


class RetractTarget(StrEnum):
    """Where one retract victim's KV goes (the scheduler decides, per victim row)."""

    FREE = "free"  # freed: the request is re-prefilled (recompute)
    HOST_ENTRY = "host_entry"  # copied to memsvc's host store, loaded back whole on re-admission
    TREE = "tree"  # inserted into the radix tree and backed up to its hicache host tier


class Retract(Message):
    op: Literal["retract"]
    rows: IntArray  # most worth keeping first
    targets: list[RetractTarget] = Field(max_length=MAX_BATCH)  # one per row
    # Rows going into the tree: their committed token ids, concatenated in row
    # order, and one length per row (0 for the others).
    tree_tokens: IntArray | None = None
    tree_lens: IntArray | None = None

    @model_validator(mode="after")
    def _targets_match(self) -> Retract:
        if len(self.targets) != self.rows.size:
            raise ValueError("retract needs one target per row")
        wants_tree = RetractTarget.TREE in self.targets
        if wants_tree != (self.tree_lens is not None) or (
            (self.tree_tokens is None) != (self.tree_lens is None)
        ):
            raise ValueError("tree_tokens and tree_lens go with rows retracted into the tree")
        if self.tree_lens is not None:
            lens, tokens = self.tree_lens, self.tree_tokens
            _check_split(lens, tokens, self.rows.size, "tree_lens/tree_tokens/row")
        return self


class Offload(Message):
    op: Literal["offload"]
    rid: RequestId
    num_tokens: int | None = Field(default=None, ge=0)


class Load(Message):
    op: Literal["load"]
    rid: RequestId


class HostDiscard(Message):
    op: Literal["host_discard"]
    rid: RequestId


# -- PD disaggregation (memsvc started with --pd-role) ------------------------------

Room = Annotated[int, Field(ge=0, lt=2**63)]


class PdExpect(Message):
    """Decode side: ``rid``'s allocated slots receive the prompt KV of ``room``."""

    op: Literal["pd_expect"]
    rid: RequestId
    room: Room


class PdSend(Message):
    """Send the KV of ``rid``'s first ``num_tokens`` positions to ``room``: a prefill
    node's prompt, or a decode node's running request moving to another decode node
    (``peer`` then names that node's transfer socket)."""

    op: Literal["pd_send"]
    rid: RequestId
    room: Room
    num_tokens: int = Field(ge=1)
    first_token: int = Field(ge=0)
    cached_tokens: int = Field(default=0, ge=0)
    peer_rid: RequestId | None = None  # the decode side's name for it, if not ``rid``
    # the decode node's transfer socket (ipc:// or tcp://), if not memsvc's --transfer-peer
    peer: str | None = Field(default=None, min_length=1, max_length=512)
    # the KV is rid's host-store entry (num_tokens: all of it), not its row's
    from_host: bool = False


class PdStatus(Message):
    """Either side: the state of each room (KVPoll: 0 failed ... 4 success)."""

    op: Literal["pd_status"]
    rooms: IntArray


class PdForget(Message):
    """Either side: drop rooms (cancelling any still in flight)."""

    op: Literal["pd_forget"]
    rooms: IntArray


class Commit(Message):
    """A scheduler's durable request records (:mod:`memsvc.adoption`), append-only.

    ``new_*``: records opened (the scheduler's opaque ``meta`` and the prompt's
    length); ``rids`` / ``entries`` (``ENTRY_FIELDS`` ints per rid: the output offset
    of its first new token, how many, the KV positions known written, the retract
    count) with the new tokens concatenated in ``token_ids``; ``extras`` (one per rid
    of ``rids``, or none): an opaque chunk appended to the record beside its tokens
    (the scheduler's logprobs of them; empty: nothing); ``drop``: records closed.
    """

    op: Literal["commit"]
    new_rids: list[RequestId] = Field(default_factory=list, max_length=MAX_BATCH)
    new_meta: list[bytes] = Field(default_factory=list, max_length=MAX_BATCH)
    new_prompt_lens: list[int] = Field(default_factory=list, max_length=MAX_BATCH)
    rids: list[RequestId] = Field(default_factory=list, max_length=MAX_BATCH)
    entries: IntArray | None = None
    token_ids: IntArray | None = None
    extras: list[bytes] = Field(default_factory=list, max_length=MAX_BATCH)
    drop: list[RequestId] = Field(default_factory=list, max_length=MAX_BATCH)
    ratio: float | None = None

    @model_validator(mode="after")
    def _shapes(self) -> Commit:
        if not len(self.new_rids) == len(self.new_meta) == len(self.new_prompt_lens):
            raise ValueError("new_rids, new_meta and new_prompt_lens need one item per record")
        if self.rids and (self.entries is None or self.token_ids is None):
            raise ValueError("rids need entries and token_ids")
        if self.entries is not None and self.entries.size != COMMIT_ENTRY_FIELDS * len(self.rids):
            raise ValueError(f"entries needs {COMMIT_ENTRY_FIELDS} ints per rid")
        if self.extras and len(self.extras) != len(self.rids):
            raise ValueError("extras needs one chunk per rid of rids (or none at all)")
        for names in (self.new_rids, self.rids, self.drop):
            if len(set(names)) != len(names):
                raise ValueError("a rid appears twice in one list")
        return self


COMMIT_ENTRY_FIELDS = 4  # offset, num_tokens, kv_committed, retractions


class Adopt(Message):
    """A restarted scheduler takes over its dead predecessor's session (its rows,
    host-store entries, prefix locks and records), proving it by the session id."""

    op: Literal["adopt"]
    predecessor: str = Field(min_length=1, max_length=64)


Request = Annotated[
    Hello
    | Heartbeat
    | Goodbye
    | Stats
    | Check
    | FlushCache
    | AllocRow
    | FreeRow
    | MatchPrefix
    | Admit
    | AllocExtend
    | CacheUnfinished
    | CacheUnfinishedMany
    | Release
    | ReleaseMany
    | DecodeStep
    | Retract
    | Offload
    | Load
    | HostDiscard
    | PdExpect
    | PdSend
    | PdStatus
    | PdForget
    | Commit
    | Adopt,
    Field(discriminator="op"),
]
REQUEST_ADAPTER: TypeAdapter[Any] = TypeAdapter(Request)
OP_NAMES: tuple[str, ...] = tuple(
    get_args(model.model_fields["op"].annotation)[0] for model in get_args(get_args(Request)[0])
)

# Ops that change state: a retry with the same op_id gets the first reply back.
MUTATING_OPS = frozenset(
    {
        "alloc_row",
        "free_row",
        "match_prefix",
        "admit",
        "alloc_extend",
        "cache_unfinished",
        "cache_unfinished_many",
        "release",
        "release_many",
        "decode_step",
        "retract",
        "offload",
        "load",
        "host_discard",
        "goodbye",
        "pd_expect",
        "pd_send",
        "pd_forget",
        "commit",
        "adopt",
    }
)


# -- framing -----------------------------------------------------------------------

_local = threading.local()  # a msgpack Packer per thread: packb would build one per call


def _packb(header: dict[str, Any]) -> bytes:
    try:
        packer = _local.packer
    except AttributeError:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(header)  # autoreset: also after an error


def _array_frame(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array, dtype=ARRAY_DTYPE).tobytes()


def pack(header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> list[bytes]:
    """Header map plus one raw frame per array (their names listed in the header)."""
    if not arrays:
        return [_packb(header)]
    return [_packb({**header, "arrays": list(arrays)}), *map(_array_frame, arrays.values())]


def unpack(frames: list[bytes]) -> dict[str, Any]:
    """Inverse of :func:`pack`: the header with each named array put in place.

    Each array is a read-only view of its frame (``np.frombuffer``), not a copy.
    """
    if not frames:
        raise ProtocolError("malformed", "empty message")
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError("malformed", f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("malformed", "header must be a msgpack map")
    names = header.pop("arrays", [])
    if not isinstance(names, list):
        raise ProtocolError("malformed", "'arrays' must be a list of field names")
    if len(names) != len(frames) - 1:
        raise ProtocolError(
            "malformed", f"'arrays' names {len(names)} frames, message has {len(frames) - 1}"
        )
    for name, frame in zip(names, frames[1:], strict=True):
        if not isinstance(name, str):
            raise ProtocolError("malformed", "'arrays' must be a list of field names")
        if name in header:
            raise ProtocolError("malformed", f"field {name!r} given twice")
        if len(frame) % ARRAY_ITEMSIZE:
            raise ProtocolError("malformed", f"array {name!r} is not a whole number of int64")
        header[name] = np.frombuffer(frame, dtype=ARRAY_DTYPE)
    return header


def best_effort_op_id(frames: list[bytes]) -> int | None:
    """The op_id of a message that failed validation, if its header has a usable one.

    Every error reply echoes it when it can be read, so that a client (which
    matches replies by op_id) gets the error instead of waiting out its timeout.
    """
    try:
        header = msgpack.unpackb(frames[0], raw=False)
    except Exception:  # garbage (or no frame at all): no op_id to echo
        return None
    op_id = header.get("op_id") if isinstance(header, dict) else None
    return op_id if isinstance(op_id, int) and not isinstance(op_id, bool) else None


def parse_request(frames: list[bytes], adapter: TypeAdapter[Any] = REQUEST_ADAPTER) -> Any:
    """Decode and validate one request against ``adapter`` (memsvc's ops by default).

    Raises :class:`ProtocolError`.
    """
    header = unpack(frames)
    try:
        # The adapter's own validator, not TypeAdapter.validate_python: the
        # same discriminated-union validation without a Python wrapper that
        # passes eight keyword arguments on every request.
        return adapter.validator.validate_python(header)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "message"
        tag_error = first["type"] in ("union_tag_invalid", "union_tag_not_found")
        code = "unknown_op" if tag_error else "bad_request"
        raise ProtocolError(code, f"{where}: {first['msg']}") from None
