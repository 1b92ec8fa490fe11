"""A restarted scheduler adopts its dead predecessor's requests and KV (issue 32, part 1).

memsvc outlives the scheduler and keeps, in the scheduler's session, what a
successor needs (:mod:`memsvc.adoption`). This module is the scheduler's side:

- :class:`Journal` (the engine's ``journal``, normal mode) commits each
  request once when it is first seen (its :func:`pack_meta` record: rid, the
  owning client and its fingerprint, prompt, sampling, priority, namespace,
  what logprobs it returns), then only what changed: new output tokens
  (append-only; a ``return_logprob`` request's logprobs of them, and of its
  prompt once computed, in an opaque chunk beside them), the KV positions
  known written (those of its row when it is RUNNING, each position written
  by a forward pass that completed), the retract count; and closes the
  records of requests that ended. The decode round sends it beside the
  forward pass (hidden behind it); the engine also commits at once after a
  prefill round (a first token, a resume from the host store) and before a
  retract or a hand-back of reserved slots (which change the KV memsvc holds),
  so that memsvc's KV never runs ahead of the records by more than the step
  in flight.
- :func:`adopt` (at start-up, from :meth:`Recovery.adopt_session`) asks
  memsvc to move the predecessor's session into ours, then rebuilds the
  queues from the records (:func:`rebuild`): a request whose row memsvc kept
  (cut back to its committed KV: the step in flight is discarded) decodes on;
  one whose KV is in the host store waits to be loaded back; one with no KV
  (waiting, retracted with its KV freed, or ended just before the death) is
  parked until its client re-submits it.
- :class:`Reattach` (the service's): every adopted request gets a detached
  waiter with its client and fingerprint; a client re-submitting the same
  request under the same rid attaches to it (and its stream restarts at 0:
  the client drops what it already has, so it sees each token once). A
  request no client reattaches to within ``grace_s`` ends with an explicit
  error and its KV is released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack
import numpy as np

from memsvc import protocol as wire
from memsvc.client import Call
from memsvc.core.errors import MemsvcError
from scheduler_svc.core import Req, ReqState, SamplingParams

if TYPE_CHECKING:
    from scheduler_svc.engine.base import EngineBase

log = logging.getLogger("scheduler_svc")

RECORD_VERSION = 1
ADOPT_GRACE_S = 30.0  # an adopted request no client re-submits within this ends with an error
ADOPT_EXPIRED_MESSAGE = (
    "The scheduler restarted and adopted this request, but no client re-attached to it "
    "within {grace:.0f}s."
)
ADOPT_EXPIRED_STATUS = 503


# memsvc refusing a commit itself (bounds, an inconsistency): the journal stops, the step
# does not fail.
JOURNAL_REFUSALS = frozenset({"invalid_argument", "record_limit"})


class Owner(NamedTuple):
    """Who submitted a request, as the service knows it (a re-submission must match)."""

    client: str
    fingerprint: str
    stream: bool


# -- records ---------------------------------------------------------------------


def pack_meta(req: Req, owner: Owner) -> bytes:
    """The scheduler's record of ``req`` (opaque to memsvc): what a successor needs."""
    sp = req.sampling_params
    return msgpack.packb(
        {
            "v": RECORD_VERSION,
            "client": owner.client,
            "fingerprint": owner.fingerprint,
            "stream": owner.stream,
            "prompt": req.origin_input_ids,
            "priority": req.priority,
            "namespace": req.namespace,
            "room": req.bootstrap_room,  # a PD decode node's: the router's name for it
            "logprob": (
                [req.logprob_start_len, req.top_logprobs_num] if req.return_logprob else None
            ),
            "sampling": {
                "max_new_tokens": sp.max_new_tokens,
                "ignore_eos": sp.ignore_eos,
                "stop_token_ids": sorted(sp.stop_token_ids),
                "min_new_tokens": sp.min_new_tokens,
                "stop": list(sp.stop),
                "no_stop_trim": sp.no_stop_trim,
                "skip_special_tokens": sp.skip_special_tokens,
                "draw": dict(sp.draw),
            },
        },
        use_bin_type=True,
    )


def unpack_meta(meta: bytes) -> dict[str, Any]:
    record = msgpack.unpackb(meta, raw=False, strict_map_key=False)
    if not isinstance(record, dict) or record.get("v") != RECORD_VERSION:
        raise ValueError("not a record this scheduler wrote")
    return record


# -- the journal -----------------------------------------------------------------


@dataclass(slots=True)
class _Committed:
    outputs: int
    kv: int
    retractions: int
    logprobs: int = 0  # output logprobs committed
    input_logprobs: bool = False  # the prompt's, once computed


def logprob_chunk(req: Req, before: _Committed) -> bytes:
    """What of ``req``'s logprobs memsvc was not told yet (b"": nothing): the output
    ones past ``before.logprobs``, the prompt's once computed."""
    state, chunk = req.logprob, {}
    if len(state.output_vals) > before.logprobs:
        chunk["o"] = state.output_vals[before.logprobs :]
        if req.top_logprobs_num > 0:
            chunk["ot"] = state.output_tops[before.logprobs :]
    if state.input_done and not before.input_logprobs:
        chunk["i"], chunk["it"] = state.input_vals, state.input_tops
    return msgpack.packb(chunk, use_bin_type=True) if chunk else b""


def replay_logprobs(req: Req, chunks: list[bytes]) -> None:
    """Put the committed ``chunks`` back into ``req``'s logprob state, as far as its
    committed outputs go."""
    state = req.logprob
    for raw in chunks:
        chunk = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        state.output_vals += chunk.get("o", [])
        state.output_tops += chunk.get("ot", [])
        if "i" in chunk:
            state.input_vals, state.input_tops = chunk["i"], chunk["it"]
            state.input_done = True
    num = len(req.output_ids)
    state.output_vals = state.output_vals[:num]
    state.output_tops = state.output_tops[:num] if req.top_logprobs_num > 0 else []


class CommitCost(NamedTuple):
    calls: int
    bytes: int
    seconds: float


@dataclass
class Journal:
    """What of each live request memsvc has been told (see the module docstring).

    ``owner_of(rid)``: the request's :class:`Owner` (None: not known yet; it is
    recorded once it is).
    """

    owner_of: Callable[[str], Owner | None]
    committed: dict[str, _Committed] = field(default_factory=dict)
    measure: bool = False  # count the bytes each commit sends (packs it once more)
    disabled: str | None = None  # why memsvc refused a commit: nothing is committed since
    calls: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        """A new memsvc session without our records (memsvc lost them): record anew."""
        self.committed.clear()

    def _changes(self, engine: EngineBase) -> tuple[dict[str, Any], dict[str, np.ndarray], dict]:
        new_rids, new_meta, prompt_lens = [], [], []
        rids, entries, tokens, extras = [], [], [], []
        after: dict[str, _Committed] = {}
        adoptable = engine.adoptable()
        for rid, req in engine.reqs.items():
            if req.is_finished or not adoptable(req):
                continue
            before = self.committed.get(rid)
            if before is None:
                owner = self.owner_of(rid)
                if owner is None:
                    continue
                new_rids.append(rid)
                new_meta.append(pack_meta(req, owner))
                prompt_lens.append(len(req.origin_input_ids))
                before = _Committed(0, 0, 0)
            # RUNNING between steps: every position but the last token's is written
            kv = req.kv_len if req.state is ReqState.RUNNING else 0
            lp = req.logprob
            now = _Committed(
                len(req.output_ids), kv, req.retraction_count, len(lp.output_vals), lp.input_done
            )
            if now == before and rid in self.committed:
                continue
            rids.append(rid)
            entries += [before.outputs, now.outputs - before.outputs, kv, now.retractions]
            tokens += req.output_ids[before.outputs :]
            extras.append(logprob_chunk(req, before) if req.return_logprob else b"")
            after[rid] = now
        live = engine.reqs
        # Ended, or no longer one a successor could continue (a PD request moving to
        # another node, or sent back to the prefill node): its record goes.
        drop = [
            rid
            for rid in self.committed
            if rid not in live or live[rid].is_finished or not adoptable(live[rid])
        ]
        fields: dict[str, Any] = {"ratio": engine.ratio.current}
        arrays: dict[str, np.ndarray] = {}
        if new_rids:
            fields.update(new_rids=new_rids, new_meta=new_meta, new_prompt_lens=prompt_lens)
        if rids:
            fields["rids"] = rids
            arrays = {
                "entries": np.asarray(entries, dtype=wire.ARRAY_DTYPE),
                "token_ids": np.asarray(tokens, dtype=wire.ARRAY_DTYPE),
            }
            if any(extras):
                fields["extras"] = extras
        if drop:
            fields["drop"] = drop
        return fields, arrays, {"after": after, "drop": drop}

    async def commit(self, engine: EngineBase) -> None:
        """Send what changed since the last commit (nothing: no round trip)."""
        if self.disabled is not None:
            return
        fields, arrays, applied = self._changes(engine)
        if len(fields) == 1:  # the ratio alone: it goes with the next real change
            return
        await self._send(engine, fields, arrays, applied)

    async def close(self, engine: EngineBase, rids: list[str]) -> None:
        """Close the records of ``rids`` (adopted records this engine does not take)."""
        if rids and self.disabled is None:
            fields = {"ratio": engine.ratio.current, "drop": rids}
            await self._send(engine, fields, {}, {"after": {}, "drop": rids})

    async def _send(
        self, engine: EngineBase, fields: dict[str, Any], arrays: dict, applied: dict
    ) -> None:
        started = time.perf_counter()
        call = Call("commit", fields, arrays or None, lambda header, arrays: header)
        try:
            await engine.mem._invoke(call)
        except MemsvcError as exc:
            if getattr(exc, "code", "") not in JOURNAL_REFUSALS:
                raise  # memsvc or the session failed: the recovery's business
            # Serving goes on; a restart then adopts what was committed before (still
            # consistent: an older committed point) and re-prefills the rest.
            self.disabled = f"{exc.code}: {exc}"
            log.error("adoption journal off: memsvc refused a commit (%s)", self.disabled)
            return
        self.seconds += time.perf_counter() - started
        self.calls += 1
        if self.measure:
            self.bytes_sent += sum(map(len, wire.pack({"op": "commit", **fields}, arrays or None)))
        self.committed.update(applied["after"])
        for rid in applied["drop"]:
            self.committed.pop(rid, None)

    def stats(self) -> dict[str, Any]:
        return {
            "disabled": self.disabled,
            "commit_calls": self.calls,
            "commit_bytes": self.bytes_sent,
            "commit_s": self.seconds,
            "records": len(self.committed),
        }


# -- adoption --------------------------------------------------------------------


@dataclass
class Adopted:
    """What :func:`rebuild` made of the predecessor's records."""

    owners: dict[str, Owner] = field(default_factory=dict)
    parked: dict[str, Req] = field(default_factory=dict)  # no KV: they wait for their client
    dropped: list[str] = field(default_factory=list)  # no KV, and not computed here (PD)
    running: int = 0
    from_host: int = 0
    kv_tokens: int = 0  # KV positions adopted (rows and host entries)
    freed_tokens: int = 0  # KV memsvc freed: to be computed again
    trimmed_tokens: int = 0  # slots of the step in flight, discarded


async def adopt(engine: EngineBase, predecessor: str) -> dict[str, Any]:
    """Ask memsvc to move ``predecessor``'s session into the engine's; its reply.

    Raises :class:`MemsvcError` (``adopt_refused`` when memsvc refuses: the
    predecessor is gone, or not ours to take).
    """
    call = Call("adopt", {"predecessor": predecessor}, None, lambda header, arrays: header)
    return await engine.mem._invoke(call)


def rebuild(engine: EngineBase, reply: dict[str, Any]) -> Adopted:
    """Put the adopted requests into the engine's queues (see the module docstring)."""
    adopted = Adopted(freed_tokens=reply["freed_tokens"], trimmed_tokens=reply["trimmed_tokens"])
    journal = engine.journal
    to_host: list[Req] = []
    for item in reply["records"]:
        try:
            meta = unpack_meta(item["meta"])
            req = _req_of(item, meta)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("adopt: record %s unreadable (%s): left to its client", item["rid"], exc)
            continue
        rid = req.rid
        if item["kv"] not in ("row", "host") and not engine.recomputes_adopted:
            adopted.dropped.append(rid)  # a PD decode node: the router starts it over
            continue
        adopted.owners[rid] = Owner(meta["client"], meta["fingerprint"], bool(meta["stream"]))
        if journal is not None:
            kv = item["kv_len"] if item["kv"] == "row" else 0
            lp = req.logprob
            journal.committed[rid] = _Committed(
                len(req.output_ids), kv, req.retraction_count, len(lp.output_vals), lp.input_done
            )
        if item["kv"] == "row":
            req.state = ReqState.RETRACTED  # memsvc kept its row: resume there
            req.resume(int(item["row"]))
            if req.kv_len != item["kv_len"]:
                raise MemsvcError(f"adopt: {rid} has {item['kv_len']} KV, expected {req.kv_len}")
            engine.reqs[rid] = req
            engine.running.append(req)
            adopted.running += 1
            adopted.kv_tokens += req.kv_len
        elif item["kv"] == "host":
            req.state = ReqState.RETRACTED
            req.host_copy = True
            engine.reqs[rid] = req
            to_host.append(req)
            adopted.from_host += 1
            adopted.kv_tokens += item["kv_len"]
        else:
            if req.output_ids:
                req.state = ReqState.RETRACTED  # re-prefilled from origin + output
            adopted.parked[rid] = req
    engine.adopt_from_host(to_host)
    if reply.get("ratio") is not None:
        engine.ratio.current = float(reply["ratio"])
    return adopted


def _req_of(item: dict[str, Any], meta: dict[str, Any]) -> Req:
    sampling = dict(meta["sampling"])
    logprob = meta.get("logprob")
    req = Req(
        item["rid"],
        list(meta["prompt"]),
        SamplingParams(**sampling),
        priority=meta["priority"],
        namespace=meta.get("namespace", ""),
        output_ids=list(item["outputs"]),
        return_logprob=logprob is not None,
        logprob_start_len=-1 if logprob is None else int(logprob[0]),
        top_logprobs_num=0 if logprob is None else int(logprob[1]),
    )
    req.bootstrap_room = meta.get("room")
    if logprob is not None:
        replay_logprobs(req, list(item.get("extras") or []))
    req.retraction_count = int(item["retractions"])
    req.retracted_stain = req.retraction_count > 0
    if req.output_ids:
        req.first_scheduled_time = req.first_token_time = time.monotonic()
    return req


# -- reattaching clients ---------------------------------------------------------


@dataclass
class Reattach:
    """The adopted requests no client has re-submitted yet (the service's)."""

    adopted: Adopted
    grace_s: float = ADOPT_GRACE_S
    since: float = field(default_factory=time.monotonic)
    expired: int = 0

    def waiting_for_client(self, rid: str) -> bool:
        return rid in self.adopted.owners

    def attached(self, rid: str) -> Req | None:
        """``rid``'s client re-submitted it: the parked request to submit, if it is one."""
        self.adopted.owners.pop(rid, None)
        return self.adopted.parked.pop(rid, None)

    def due(self, now: float) -> list[str]:
        """The rids whose client did not come back within the grace period (forgotten here)."""
        if not self.adopted.owners or now - self.since < self.grace_s:
            return []
        rids = list(self.adopted.owners)
        self.adopted.owners.clear()
        self.expired += len(rids)
        return rids

    def parked_req(self, rid: str) -> Req | None:
        return self.adopted.parked.pop(rid, None)

    @property
    def message(self) -> str:
        return ADOPT_EXPIRED_MESSAGE.format(grace=self.grace_s)
