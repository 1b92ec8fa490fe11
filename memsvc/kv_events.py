"""``--kv-events-config``: SGLang's KV cache events on a ZMQ PUB socket, for KV-aware routers.

The flag takes SGLang's JSON (``KVEventsConfig`` in SGLang 0.5.23's
``disaggregation/kv_events.py``)::

    {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
     "topic": "", "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000}

(also ``bind`` and ``format``, as SGLang's). The tree's observer
(:class:`~memsvc.core.tree_events.TreeEventRecorder`) queues the events; after
each request memsvc handles (and each lease-reaper tick) :meth:`KVEventPublisher.flush`
takes them as one batch and hands it to the publisher's thread without waiting
(a full queue drops the batch and counts it: the pool never waits for a
subscriber). The thread encodes and sends, as SGLang's ``ZmqEventPublisher``:

- on the PUB socket, each batch as three frames: the topic, the sequence number
  (8 bytes, big-endian, from 0) and the payload: msgpack of
  ``[ts, [event, ...], attn_dp_rank]``, each event a map with ``type``
  (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) and its fields;
- on the replay ROUTER socket (``replay_endpoint``), a request
  ``[b"", start_seq (8 bytes big-endian)]`` gets every buffered batch from
  ``start_seq`` on, each as ``[b"", topic, seq, payload]``, then
  ``[b"", b"", -1 (8 bytes, signed), b""]``. The buffer keeps the last
  ``buffer_steps`` batches.

The first batch is ``AllBlocksCleared``: a restarted memsvc starts empty, and a
router that knew its predecessor's blocks must forget them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

import msgpack
import zmq

from memsvc.core.errors import InvalidArgumentError
from memsvc.core.tree_events import MEDIUM_DISK, MEDIUM_EXTERNAL, TreeEventRecorder
from memsvc.server import check_listen_address

log = logging.getLogger("memsvc.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_ENDPOINT = "tcp://*:5557"  # SGLang's
_BIND_MARKS = ("*", "::", "0.0.0.0")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """SGLang's ``KVEventsConfig``: the same keys, the same defaults."""

    publisher: str = "null"
    endpoint: str = DEFAULT_ENDPOINT
    bind: bool | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    format: str = "default"

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """The config a ``--kv-events-config`` JSON string asks for, or a clear error."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"--kv-events-config is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise InvalidArgumentError("--kv-events-config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise InvalidArgumentError(
                f"--kv-events-config: unknown key(s) {unknown}; known: {sorted(known)}"
            )
        config = cls(**raw)
        config._check()
        return config

    def _check(self) -> None:
        def bad(why: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"--kv-events-config: {why}")

        for name in ("publisher", "endpoint", "topic", "format"):
            if not isinstance(getattr(self, name), str):
                raise bad(f"{name} must be a string")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise bad(f"{name} must be an integer >= 0, got {value!r}")
        if self.max_queue_size < 1:
            raise bad("max_queue_size must be >= 1")
        if self.bind is not None and not isinstance(self.bind, bool):
            raise bad(f"bind must be true, false or null, got {self.bind!r}")
        if self.publisher not in ("null", "zmq"):
            raise bad(f"unknown publisher {self.publisher!r} (null or zmq)")
        if self.format not in ("default", "dynamo"):
            raise bad(f"format must be 'default' or 'dynamo', got {self.format!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(
                ("tcp://", "ipc://", "inproc://")
            ):
                raise bad(f"{name} must be a tcp://, ipc:// or inproc:// address, got {value!r}")

    @property
    def binds(self) -> bool:
        """SGLang's rule: bind a wildcard, ipc or inproc address, connect to any other."""
        if self.bind is not None:
            return self.bind
        return any(m in self.endpoint for m in _BIND_MARKS) or self.endpoint.startswith(
            ("ipc://", "inproc://")
        )


def _offset_endpoint(endpoint: str | None, index: int) -> str | None:
    """SGLang's per-rank rule: a tcp port plus ``index``, an inproc name with ``_dp{index}``
    (and here an ipc path with ``-{index}``); ``index`` 0 is the endpoint itself."""
    if endpoint is None or index == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + index}"
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{index}"
    return f"{endpoint}-{index}"


def kv_events_config_for_node(text: str, index: int) -> str:
    """The ``--kv-events-config`` of node ``index`` of a cluster on one host: the
    endpoints offset as SGLang offsets them per DP rank (node 0 keeps them)."""
    raw = json.loads(text)
    for name in ("endpoint", "replay_endpoint"):
        default = DEFAULT_ENDPOINT if name == "endpoint" else None
        raw[name] = _offset_endpoint(raw.get(name, default), index)
    config = json.dumps(raw)
    KVEventsConfig.parse(config)
    return config


def check_kv_events_config(text: str | None) -> None:
    """Refuse a bad ``--kv-events-config`` (at start, before anything is bound)."""
    if text:
        KVEventsConfig.parse(text)


def encode_batch(ts: float, events: list[dict[str, Any]], dp_rank: int = 0) -> bytes:
    """SGLang's ``KVEventBatch`` on the wire: ``[ts, events, attn_dp_rank]``."""
    return msgpack.packb([ts, events, dp_rank], use_bin_type=True)


class KVEventPublisher:
    """The tree's events to a PUB socket, through a thread (the module docstring says how)."""

    def __init__(self, config: KVEventsConfig, recorder: TreeEventRecorder) -> None:
        self.config = config
        self.recorder = recorder
        self.num_dropped_batches = 0
        self._queue: queue.Queue[tuple[float, list] | None] = queue.Queue(config.max_queue_size)
        self._ctx = zmq.Context()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="memsvc-kv-events", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            self._ctx.term()
            raise InvalidArgumentError(
                f"--kv-events-config: cannot open {config.endpoint}"
                f"{' / ' + config.replay_endpoint if config.replay_endpoint else ''}: "
                f"{self._start_error}"
            ) from self._start_error
        self._submit([{"type": "AllBlocksCleared"}])

    # -- the socket thread's side (never waits) ---------------------------------------------

    def flush(self) -> None:
        """Hand the events the tree queued since the last call to the thread, as one batch."""
        events = self.recorder.take()
        if events:
            self._submit(events)

    def _submit(self, events: list) -> None:
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped_batches += 1
            log.warning(
                "KV events: publisher queue full (%d batches), a batch of %d events dropped",
                self.config.max_queue_size,
                len(events),
            )

    def after(self, fn):
        """``fn``, then :meth:`flush` (memsvc's request handler and tick)."""

        def wrapped(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            finally:
                self.flush()

        return wrapped

    def close(self) -> None:
        """Send what is queued, then close the sockets (each waits a second at most)."""
        self.flush()
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._ctx.term()

    # -- the publisher thread ------------------------------------------------------------

    def _open(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        config = self.config
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 1000)  # what close() leaves queued still goes out
        pub.set_hwm(config.hwm)
        try:
            if config.binds:
                pub.bind(config.endpoint)
            else:
                pub.connect(config.endpoint)
            replay = None
            if config.replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                try:
                    replay.bind(config.replay_endpoint)
                except BaseException:
                    replay.close(0)
                    raise
        except BaseException:
            pub.close(0)
            raise
        return pub, replay

    def _run(self) -> None:
        try:
            pub, replay = self._open()
        except BaseException as exc:  # reported to the constructor
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        topic = self.config.topic.encode()
        buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        next_seq = 0

        def send_queued(first: tuple[float, list] | None) -> bool:
            """Publish ``first`` and all queued after it; False once told to stop."""
            nonlocal next_seq
            item = first
            while True:
                if item is None:
                    return False
                ts, events = item
                payload = encode_batch(ts, events)
                pub.send_multipart((topic, next_seq.to_bytes(8, "big"), payload))
                if buffer.maxlen:
                    buffer.append((next_seq, payload))
                next_seq += 1
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    return True

        try:
            running = True
            while running:
                with contextlib.suppress(queue.Empty):
                    running = send_queued(self._queue.get(timeout=0.05))
                while running and replay is not None and replay.poll(0):
                    # A batch submitted before the request arrived is sent (and
                    # buffered) before the request is answered.
                    with contextlib.suppress(queue.Empty):
                        running = send_queued(self._queue.get_nowait())
                    self._serve_replay(replay, topic, buffer)
        except Exception:  # a bug: stop publishing, never the pool
            log.exception("KV events publisher failed; no more events are published")
        finally:
            pub.close()  # LINGER: up to a second to send what is queued
            if replay is not None:
                replay.close(0)
            self._remove_ipc_files()

    def _remove_ipc_files(self) -> None:
        """Unlink the ``ipc://`` paths this publisher bound (libzmq leaves them)."""
        config = self.config
        bound = [config.replay_endpoint] if config.replay_endpoint else []
        if config.binds:
            bound.append(config.endpoint)
        for address in bound:
            if address.startswith("ipc://") and not address.startswith("ipc://@"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(address[len("ipc://") :])

    @staticmethod
    def _serve_replay(replay: zmq.Socket, topic: bytes, buffer: deque) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: bad replay request (%d frames) ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in buffer:
            if seq >= start_seq:
                replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))


def check_bind_addresses(config: KVEventsConfig, *, allow_remote: bool) -> None:
    """The events name every cached token: like ``--listen``, a socket bound past
    loopback needs ``--allow-remote``."""
    bound = [config.replay_endpoint] if config.replay_endpoint else []
    if config.binds:
        bound.append(config.endpoint)
    for address in bound:
        if address.startswith("tcp://"):
            try:
                check_listen_address(address, allow_remote=allow_remote)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"--kv-events-config: {exc}") from None


def start_kv_events(
    text: str | None, tree: Any, *, allow_remote: bool = False
) -> KVEventPublisher | None:
    """Attach a recorder to ``tree`` and start publishing (None: ``--kv-events-config``
    unset, or publisher ``null``)."""
    if not text:
        return None
    config = KVEventsConfig.parse(text)
    if config.publisher == "null":
        return None
    check_bind_addresses(config, allow_remote=allow_remote)
    storage = getattr(tree, "storage", None)
    medium = MEDIUM_EXTERNAL if storage is not None and storage.shared else MEDIUM_DISK
    recorder = TreeEventRecorder(tree.root, tree.page_size, storage_medium=medium)
    publisher = KVEventPublisher(config, recorder)
    tree.events = recorder
    return publisher
