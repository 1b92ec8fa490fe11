"""The memsvc request handlers: one message in, one reply out, synchronously.

:meth:`MemService.handle` is everything between the socket and the core:
decode and validate once, find the session, answer a retried op from the
reply cache, dispatch through a table to the core, and build the reply (with
the pool sizes and the epoch on every one). It never awaits, so each op is
atomic; the asyncio shell in :mod:`memsvc.server` only moves frames.
The batched ops are in :mod:`memsvc.handlers_batch` and the PD transfer ops
in :mod:`memsvc.handlers_pd`, mixins of :class:`MemService`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from memsvc import adoption
from memsvc import protocol as p
from memsvc.core import KVPool
from memsvc.core.errors import InvalidArgumentError, MemsvcError, UnknownRequestError
from memsvc.gcpolicy import gc_state
from memsvc.handlers_batch import BatchHandlers, split_tokens
from memsvc.handlers_pd import PdHandlers
from memsvc.metrics import Metrics
from memsvc.sessions import (
    REPLY_CACHE_BYTES,
    NotOwnerError,
    Session,
    SessionTable,
    TooManySessionsError,
)
from memsvc.transfer import TransferAgent

log = logging.getLogger("memsvc")

Reply = tuple[dict[str, Any], dict[str, np.ndarray] | None]


def swa_sizes(pool: KVPool) -> dict[str, int]:
    """A hybrid pool's sizes, pool by pool, in tokens (every reply carries them)."""
    return {
        "full_available": pool.full_available_size(),
        "swa_available": pool.swa_available_size(),
        "swa_evictable": pool.swa_evictable_size(),
        "swa_protected": pool.swa_protected_size(),
    }


@dataclass(frozen=True)
class ServiceConfig:
    retract_decode_steps: int = 20  # SGLANG_RETRACT_DECODE_STEPS
    max_message_bytes: int = 64 << 20
    # A stack opens a few sessions (a scheduler, a worker, their restarted successors
    # until the old leases run out): these bound what hellos alone can make memsvc keep.
    max_sessions: int = 256
    max_lease_s: float = 600.0
    reply_cache_bytes: int = REPLY_CACHE_BYTES  # per session, for retried ops


class MemService(BatchHandlers, PdHandlers):
    def __init__(self, pool: KVPool, config: ServiceConfig, metrics: Metrics | None = None) -> None:
        self.pool = pool
        self.config = config
        self.metrics = metrics or Metrics(None)
        self.epoch = secrets.token_hex(8)
        self.sessions = SessionTable(config.reply_cache_bytes)
        self._row_session = np.zeros(pool.table.num_rows, dtype=np.int64)
        self.journals = adoption.Journals()  # durable request records, per session
        self._handlers: dict[str, Callable[[Session, Any], Reply]] = {
            "heartbeat": self._heartbeat,
            "goodbye": self._goodbye,
            "stats": self._stats,
            "check": self._check,
            "flush_cache": self._flush_cache,
            "alloc_row": self._alloc_row,
            "free_row": self._free_row,
            "match_prefix": self._match_prefix,
            "admit": self._admit,
            "alloc_extend": self._alloc_extend,
            "cache_unfinished": self._cache_unfinished,
            "cache_unfinished_many": self._cache_unfinished_many,
            "release": self._release,
            "release_many": self._release_many,
            "decode_step": self._decode_step,
            "retract": self._retract,
            "offload": self._offload,
            "load": self._load,
            "host_discard": self._host_discard,
            "pd_expect": self._pd_expect,
            "pd_send": self._pd_send,
            "pd_status": self._pd_status,
            "pd_forget": self._pd_forget,
            "commit": lambda session, msg: (adoption.commit(self, session, msg), None),
            "adopt": lambda session, msg: (adoption.adopt(self, session, msg), None),
        }
        self.transfer: TransferAgent | None = None  # set when memsvc has a PD role

    # -- the edge --------------------------------------------------------------

    def handle(self, frames: list[bytes], now: float | None = None) -> list[bytes]:
        """Answer one request. Never raises: every failure is an error reply."""
        started = time.perf_counter()
        op = "invalid"
        op_id = None
        try:
            size = sum(map(len, frames))
            if size > self.config.max_message_bytes:
                raise p.ProtocolError(
                    "too_large",
                    f"message of {size} bytes exceeds the limit of {self.config.max_message_bytes}",
                )
            msg = p.parse_request(frames)
            op, op_id = msg.op, msg.op_id
            now = time.monotonic() if now is None else now
            if op == "hello":
                reply = self._pack_ok(op_id, *self._hello(msg, now))
            else:
                session = self.sessions.touch(msg.session, now, op)
                mutating = op in p.MUTATING_OPS
                if mutating:
                    cached = self.sessions.cached_reply(session, op_id, frames)
                    if cached is not None:
                        self.metrics.retried_op()
                        return cached
                reply = self._pack_ok(op_id, *self._handlers[op](session, msg))
                if mutating:
                    self.sessions.remember_reply(session, op_id, frames, reply)
            self.metrics.op_done(op, "ok", time.perf_counter() - started)
            return reply
        except p.ProtocolError as exc:
            op_id = op_id if op_id is not None else p.best_effort_op_id(frames)
            return self._pack_error(op, op_id, exc.code, exc.message, started)
        except MemsvcError as exc:
            return self._pack_error(op, op_id, exc.code, str(exc), started)
        except Exception as exc:  # a bug: answer, log, keep serving
            log.exception("internal error handling %s", op)
            return self._pack_error(op, op_id, "internal", f"{type(exc).__name__}: {exc}", started)

    def _sizes(self) -> dict[str, Any]:
        """What every reply carries: the epoch and the pool's sizes (all O(1) reads)."""
        pool = self.pool
        sizes = {
            "epoch": self.epoch,
            "available": pool.available_size(),
            "evictable": pool.evictable_size(),
            "protected": pool.protected_size(),
            "host_free": pool.host_store.free_bytes,
        }
        if pool.swa is not None:  # a hybrid model: "available" is min(full, swa)
            sizes.update(swa_sizes(pool))
        return sizes

    def _pack_ok(
        self, op_id: int, fields: dict[str, Any], arrays: dict[str, np.ndarray] | None
    ) -> list[bytes]:
        return p.pack({"ok": True, "op_id": op_id, **self._sizes(), **fields}, arrays)

    def reject(self, frames: list[bytes], error: p.ProtocolError) -> list[bytes]:
        """The reply to a message the shell did not read whole (over the size limit)."""
        op_id = p.best_effort_op_id(frames)
        return self._pack_error("invalid", op_id, error.code, error.message, time.perf_counter())

    def _pack_error(
        self, op: str, op_id: int | None, code: str, message: str, started: float
    ) -> list[bytes]:
        self.metrics.op_done(op, code, time.perf_counter() - started)
        header = {"ok": False, "op_id": op_id, "code": code, "message": message}
        return p.pack({**header, **self._sizes()})

    # -- sessions --------------------------------------------------------------

    def _hello(self, msg: p.Hello, now: float) -> Reply:
        config = self.config
        if msg.lease_s > config.max_lease_s:
            raise InvalidArgumentError(
                f"lease_s {msg.lease_s:g} exceeds this memsvc's --max-lease {config.max_lease_s:g}"
            )
        if len(self.sessions) >= config.max_sessions:
            raise TooManySessionsError(
                f"all {config.max_sessions} sessions (--max-sessions) are open; one must say "
                "goodbye or let its lease run out first"
            )
        session = self.sessions.open(msg.role, msg.lease_s, msg.name, now)
        log.info(
            "session %s opened (%s %s, lease %.1fs)", session.sid, msg.role, msg.name, msg.lease_s
        )
        return {
            "session": session.sid,
            "layout": self.pool.layout.to_dict(),
            "handle": self.pool.buffers.handle(),
            "capacity": self.pool.capacity,
            "host_store_bytes": self.pool.host_store.capacity_bytes,
            "retract_decode_steps": self.config.retract_decode_steps,
            "hicache": self._hicache_info(),
            # a decode node's transfer socket: where another node sends KV to it
            "transfer_listen": self.transfer.listen if self.transfer is not None else None,
        }, None

    def _hicache_info(self) -> dict[str, Any] | None:
        hicache = self.pool.hicache
        if hicache is None:
            return None
        return {
            "write_policy": hicache.write_policy,
            "host_capacity_bytes": hicache.host.num_pages * hicache.page_bytes,
            "storage_backend": hicache.storage.name if hicache.storage else None,
        }

    def _heartbeat(self, session: Session, msg: p.Heartbeat) -> Reply:
        return {}, None

    def _goodbye(self, session: Session, msg: p.Goodbye) -> Reply:
        tokens = adoption.held_tokens(self, sorted(session.rids))
        return {"reclaimed": self.reclaim(session), "reclaimed_tokens": tokens}, None

    def expire_sessions(self, now: float | None = None) -> list[str]:
        """Reclaim every session whose lease ran out; returns their ids."""
        now = time.monotonic() if now is None else now
        expired = self.sessions.expired(now)
        expired = [s for s in expired if not adoption.keep_for_adoption(self, s, now)]
        for session in expired:
            reclaimed = self.reclaim(session)
            log.warning(
                "session %s (%s %s) expired: reclaimed %d requests",
                session.sid,
                session.role,
                session.name,
                len(reclaimed),
            )
            self.metrics.session_expired()
        return [s.sid for s in expired]

    def reclaim(self, session: Session) -> list[str]:
        """Free everything the session holds: rows, pages, locks, host-store entries."""
        rids = self.sessions.close(session)
        self.journals.forget(session.sid)
        for rid in rids:
            if self.transfer is not None:
                self.transfer.forget_rid(rid)
            if self.pool.is_open(rid):
                self.pool.release(rid, is_insert=False)
            if rid in self.pool.host_store:
                self.pool.host_discard(rid)
        self._sync_row_owners()
        return rids

    # -- ownership helpers -----------------------------------------------------

    def _own(self, session: Session, rid: str) -> None:
        self.sessions.check_owner(session, rid)
        if rid not in session.rids:
            raise UnknownRequestError(f"no request {rid!r} in this session")

    def _own_rows(self, session: Session, rows: np.ndarray) -> None:
        """Every row is an open request of this session, none twice.

        A decode batch is usually the same from one step to the next, so the
        last batch that passed is remembered (its bytes and the pool's row
        generation) and an identical one is not checked again.
        """
        key = (rows.tobytes(), self.pool.rows_generation)
        if session.checked_rows == key:
            return
        self.pool.check_rows(rows)
        if (self._row_session[rows] != session.num).any():
            raise NotOwnerError("a row in the batch belongs to another session")
        session.checked_rows = key

    def adopt_rows(self, session: Session, rows: list[int]) -> None:
        """``rows`` now belong to ``session`` (:mod:`memsvc.adoption`)."""
        self._row_session[rows] = session.num

    def settle_rids(self, *rids: str) -> None:
        self._settle(*rids)

    def _sync_row_owners(self) -> None:
        """Rows freed by the last op no longer belong to anyone."""
        self._row_session[~self.pool.table.in_use_mask()] = 0

    def _settle(self, *rids: str) -> None:
        """Drop ownership of requests that hold neither a row nor a host entry."""
        for rid in rids:
            if not self.pool.is_open(rid) and rid not in self.pool.host_store:
                self.sessions.unclaim(rid)
        self._sync_row_owners()

    # -- request ops -----------------------------------------------------------

    def _stats(self, session: Session, msg: p.Stats) -> Reply:
        pool = self.pool
        return {
            "capacity": pool.capacity,
            "held": pool.held_size(),
            "open_requests": len(pool.open_rids()),
            "free_rows": pool.table.available_size(),
            "host_store_used_bytes": pool.host_store.used_bytes,
            "host_store_free_bytes": pool.host_store.free_bytes,
            "host_store_entries": len(pool.host_store),
            # freed pages an offload copy may still read (counted in available)
            "pending_pages": pool.allocator.num_pending_pages,
            "sessions": len(self.sessions),
            "transfer": self.transfer.stats() if self.transfer else None,
            "hicache": pool.hicache.stats_dict() if pool.hicache is not None else None,
            # hybrid models: the SWA pool (None without sliding-window layers)
            "swa": {
                **swa_sizes(pool),
                "swa_capacity": pool.swa_capacity,
                "swa_held": pool.swa_held_size(),
                "sliding_window": pool.layout.sliding_window,
            }
            if pool.swa is not None
            else None,
            "counters": self.metrics.counters(),
            # top namespaces by device tokens cached, by label (never a salt)
            "namespaces": pool.namespace_stats(),
            "gc": gc_state(),  # the collector's policy in this process (memsvc.gcpolicy)
        }, None

    def _check(self, session: Session, msg: p.Check) -> Reply:
        self.pool.check_integrity(idle=msg.idle)
        return {}, None

    def _flush_cache(self, session: Session, msg: p.FlushCache) -> Reply:
        """Evict every unlocked node of the prefix tree (with the hierarchy: and every host
        and storage copy, unless ``device_only``); locked prefixes stay on the device."""
        evicted = self.pool.flush_cache(device_only=msg.device_only, namespace=msg.namespace)
        return {"evicted": evicted}, None

    def _alloc_row(self, session: Session, msg: p.AllocRow) -> Reply:
        self.sessions.check_owner(session, msg.rid)
        row = self.pool.open_request(msg.rid, msg.namespace)
        self.sessions.claim(session, msg.rid)
        self._row_session[row] = session.num
        return {"row": row}, None

    def _free_row(self, session: Session, msg: p.FreeRow) -> Reply:
        self._own(session, msg.rid)
        self.pool.release(msg.rid, is_insert=False)
        self._settle(msg.rid)
        return {}, None

    def _match_prefix(self, session: Session, msg: p.MatchPrefix) -> Reply:
        self._own(session, msg.rid)
        if self.pool.hicache is not None:
            match = self.pool.match_prefix_tiers(msg.rid, msg.token_ids)
            return {
                "prefix_len": match.prefix_len,
                "device_hit": match.device_tokens,
                "host_hit": match.host_tokens,
                "storage_hit": match.storage_tokens,
                "load_pending": match.load_pending,
            }, None
        prefix_len = self.pool.match_prefix(msg.rid, msg.token_ids)
        return {"prefix_len": prefix_len}, None

    def _alloc_extend(self, session: Session, msg: p.AllocExtend) -> Reply:
        if len(msg.rids) != msg.num_tokens.size:
            raise InvalidArgumentError(
                f"{len(msg.rids)} rids but {msg.num_tokens.size} token counts"
            )
        for rid in msg.rids:
            self._own(session, rid)
        items = list(zip(msg.rids, msg.num_tokens.tolist(), strict=True))
        if msg.free_rids:  # the round's candidates not admitted: closed first, fits or not
            self._own_open(session, msg.free_rids)
            self.pool.extend_tokens_required(items)  # checks the extend before the frees
            self._free_rows(session, msg.free_rids)
        cut = self.pool.settle_loads(msg.rids)
        if cut:  # a prefix load failed: a miss for these requests alone, said as data
            return {"fits": False, "missing": 0, "cut": cut}, None
        slots = self.pool.alloc_extend(items)
        if slots is None:
            needed = self.pool.extend_tokens_required(items)
            return {"fits": False, "missing": needed - self.pool.available_size()}, None
        return {"fits": True}, {"slots": slots}

    def _cache_unfinished(self, session: Session, msg: p.CacheUnfinished) -> Reply:
        self._own(session, msg.rid)
        return {"prefix_len": self.pool.cache_unfinished(msg.rid, msg.token_ids)}, None

    def _release(self, session: Session, msg: p.Release) -> Reply:
        self._own(session, msg.rid)
        self.pool.release(msg.rid, msg.token_ids, is_insert=msg.is_insert)
        self._settle(msg.rid)
        return {}, None

    def _decode_step(self, session: Session, msg: p.DecodeStep) -> Reply:
        """Evict the shortfall, check, and allocate one slot per request, or say what's missing."""
        self._own_rows(session, msg.rows)
        slots = self.pool.alloc_decode_rows(msg.rows, rows_checked=True)
        if slots is None:
            needed = self.pool.decode_tokens_required_rows(msg.rows)
            return {"fits": False, "missing": needed - self.pool.available_size()}, None
        return {"fits": True}, {"slots": slots}

    def _retract(self, session: Session, msg: p.Retract) -> Reply:
        self._own_rows(session, msg.rows)
        offload = np.array([t is p.RetractTarget.HOST_ENTRY for t in msg.targets], bool)
        to_tree = None
        if msg.tree_lens is not None:  # hicache: these victims' KV goes into the tree
            parts = split_tokens(msg.tree_tokens, msg.tree_lens)
            to_tree = {
                row: tokens
                for row, tokens, target in zip(msg.rows.tolist(), parts, msg.targets, strict=True)
                if target is p.RetractTarget.TREE
            }
        result = self.pool.retract(
            msg.rows,
            offload=offload,
            retract_decode_steps=self.config.retract_decode_steps,
            to_tree=to_tree,
        )
        self._settle(*result.retracted, *result.offload_failed)
        self.metrics.retracted(len(result.retracted) + len(result.offload_failed))
        self.metrics.offloaded(result.offloaded_bytes)
        reply = {
            "retracted": result.retracted,
            "offload_failed": result.offload_failed,
            "tokens_gained": result.tokens_gained,
            "last_does_not_fit": result.last_does_not_fit,
        }
        if self.pool.hicache is not None:
            reply.update(to_tree=result.to_tree, tree_bytes=result.tree_bytes)
        return reply, None

    def _offload(self, session: Session, msg: p.Offload) -> Reply:
        self._own(session, msg.rid)
        nbytes = self.pool.offload(msg.rid, msg.num_tokens)
        self.metrics.offloaded(nbytes)
        return {"bytes": nbytes}, None

    def _load(self, session: Session, msg: p.Load) -> Reply:
        self._own(session, msg.rid)
        num_tokens = self.pool.host_store.num_tokens(msg.rid)
        slots = self.pool.load(msg.rid)
        if slots is None:
            needed = self.pool.extend_tokens_required([(msg.rid, num_tokens)])
            return {"fits": False, "missing": needed - self.pool.available_size()}, None
        self.metrics.loaded(self.pool.host_store.bytes_needed(num_tokens))
        return {"fits": True}, {"slots": slots}

    def _host_discard(self, session: Session, msg: p.HostDiscard) -> Reply:
        self._own(session, msg.rid)
        self.pool.host_discard(msg.rid)
        self._settle(msg.rid)
        return {}, None
