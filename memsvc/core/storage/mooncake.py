"""The storage tier on Mooncake Store (``--hicache-storage-backend mooncake``).

Each sealed page record (:mod:`memsvc.core.storage.base`) is one Mooncake object,
so every node on the same Mooncake master shares the tier: a page is stored under a
name that says what it is, not who wrote it::

    kvstack_[<extra_backend_tag>_]<layout identity>_<page key>

``<page key>`` is the tree's hash chain of the page's token prefix (it carries the
cache namespace); the layout identity is a digest of the pool's page format
(layers, heads, head dim, page size, dtype, layer types, window, page bytes), and
``extra_backend_tag`` (SGLang's name) tells models of one format apart. The record's
checksum covers the page key and its bytes, so a page of another key, a torn or a
foreign write is a miss, never KV.

Configured as SGLang configures its ``mooncake`` HiCache backend, first found wins:

1. ``--hicache-storage-backend-extra-config``: a JSON object, or ``@path`` of a JSON
   file, with ``master_server_address``;
2. ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``: a JSON file;
3. the environment: ``MOONCAKE_MASTER``, ``MOONCAKE_TE_META_DATA_SERVER``,
   ``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``, ``MOONCAKE_LOCAL_HOSTNAME`` (else
   ``LOCAL_HOSTNAME``), ``MOONCAKE_GLOBAL_SEGMENT_SIZE``.

Keys (files and environment alike): ``master_server_address``, ``metadata_server``
(``P2PHANDSHAKE`` or an ``http://`` metadata server), ``protocol`` (``tcp``: the
only transport on a machine without RDMA; SGLang's own default is now ``rdma``),
``device_name``, ``local_hostname``, ``global_segment_size`` (bytes, or ``"4gb"``:
the memory this node lends the store), ``local_buffer_size`` and
``extra_backend_tag``. Needs the ``mooncake-transfer-engine-non-cuda`` wheel (the
``cluster`` extra) and the system's ``libibverbs.so.1`` even for TCP.

Shared (:attr:`MooncakeStorage.shared`): another node's pages are found by their
keys (:meth:`MooncakeStorage.exists`; the tree continues a match's hash chain through
the store, :meth:`~memsvc.core.hicache_tree.TieredTree._adopt_kept`). A page is stored
once: a put of a key the store already holds keeps the first record (Mooncake's
create-only ``put_from``, no bytes move), and a record found damaged is removed so the
next put stores it again. A node never removes a sound page: other nodes may be
using it. Its ``delete`` (its tree dropped the page) and its ``close`` forget the
page from this node's index only; the store's own eviction makes room (SGLang's
mooncake backend never deletes either). A page lives in the segment of the node
whose memory Mooncake placed it in, so a node that leaves takes those pages with it:
misses for the others, who recompute.

Bytes move through one registered staging record (calls come from memsvc's copy
thread only). A master that cannot be reached makes a put raise ``OSError`` and a get
a miss; for ``retry_after_s`` after that every call fails at once instead of waiting
on the master's RPC timeouts again.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from memsvc.core.errors import BackendUnavailableError, InvalidArgumentError
from memsvc.core.storage.base import StorageBackend

CONFIG_PATH_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
# SGLang's environment variables, by config key.
ENV = {
    "master_server_address": "MOONCAKE_MASTER",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE",
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
}

# Mooncake's ErrorCode values (mooncake-store types.h) the backend tells apart.
OBJECT_NOT_FOUND = -704
_UNREACHABLE = {-900: "RPC_FAIL", -901: "RPC_TIMEOUT", -1010: "UNAVAILABLE_IN_CURRENT_STATUS"}
_NAMES = {
    -200: "NO_AVAILABLE_HANDLE",
    -600: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    **_UNREACHABLE,
}


def _error(code: int) -> str:
    return f"mooncake error {code} {_NAMES.get(code, '')}".rstrip()


def parse_size(value: Any) -> int:
    """Bytes from an int or SGLang's ``"<n>gb"`` (GiB) string."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"mooncake size {value!r} is not a size")
    if isinstance(value, int):
        return value
    text = str(value).strip().lower()
    try:
        if text.endswith("gb"):
            return int(text[:-2].strip()) << 30
        return int(text)
    except ValueError:
        raise InvalidArgumentError(f"mooncake size {value!r} is not bytes nor '<n>gb'") from None


@dataclass(frozen=True)
class MooncakeConfig:
    """How to reach the Mooncake Store (SGLang's keys and defaults, but ``protocol``)."""

    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "localhost"
    global_segment_size: int = 4 << 30  # what this node lends the store
    local_buffer_size: int = 16 << 20
    extra_backend_tag: str = ""
    retry_after_s: float = 5.0  # kvstack's: fail fast this long after the master was lost

    def __post_init__(self) -> None:
        if not self.master_server_address:
            raise InvalidArgumentError("mooncake needs master_server_address (host:port)")
        for name in ("global_segment_size", "local_buffer_size"):
            object.__setattr__(self, name, parse_size(getattr(self, name)))
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"mooncake {name} must be >= 0")
        if not self.retry_after_s >= 0:
            raise InvalidArgumentError("mooncake retry_after_s must be >= 0")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str) -> MooncakeConfig:
        if values.get("client_server_address") and not values.get("master_server_address"):
            raise InvalidArgumentError(
                f"{source}: a standalone Mooncake client (client_server_address) is not "
                "supported; give master_server_address"
            )
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known and v is not None})

    @classmethod
    def load(
        cls, extra_config: str | None = None, environ: Mapping[str, str] | None = None
    ) -> MooncakeConfig:
        """SGLang's order: the extra config when it names a master, else the JSON file
        of ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``, else the environment."""
        environ = os.environ if environ is None else environ
        extra = parse_extra_config(extra_config)
        if extra.get("master_server_address") or extra.get("client_server_address"):
            return cls.from_mapping(extra, "--hicache-storage-backend-extra-config")
        path = environ.get(CONFIG_PATH_ENV)
        if path:
            return cls.from_mapping({**_read_json(path), **_tag(extra)}, path)
        values: dict[str, Any] = {k: environ.get(v) for k, v in ENV.items()}
        if not values["local_hostname"]:
            values["local_hostname"] = environ.get("LOCAL_HOSTNAME")
        if not values["master_server_address"]:
            raise InvalidArgumentError(
                "--hicache-storage-backend mooncake needs a master: master_server_address in "
                f"--hicache-storage-backend-extra-config, {CONFIG_PATH_ENV} or MOONCAKE_MASTER"
            )
        return cls.from_mapping({**values, **_tag(extra)}, "the environment")


def _tag(extra: Mapping[str, Any]) -> dict[str, Any]:
    return {"extra_backend_tag": extra["extra_backend_tag"]} if "extra_backend_tag" in extra else {}


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            values = json.load(f)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"mooncake config {path!r} is unreadable: {exc}") from exc
    if not isinstance(values, dict):
        raise InvalidArgumentError(f"mooncake config {path!r} is not a JSON object")
    return values


def parse_extra_config(text: str | None) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config``: a JSON object, or ``@path`` of one."""
    if not text:
        return {}
    if text.startswith("@"):
        return _read_json(text[1:])
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise InvalidArgumentError(
            f"--hicache-storage-backend-extra-config is not JSON: {exc}"
        ) from exc
    if not isinstance(values, dict):
        raise InvalidArgumentError("--hicache-storage-backend-extra-config is not a JSON object")
    return values


def key_prefix(config: MooncakeConfig, identity: str, page_bytes: int) -> str:
    """``kvstack_[<tag>_]<digest>_``: the digest of the page format (``identity``, page bytes)."""
    digest = hashlib.blake2b(f"{identity}|{page_bytes}".encode(), digest_size=8).hexdigest()
    tag = f"{config.extra_backend_tag}_" if config.extra_backend_tag else ""
    return f"kvstack_{tag}{digest}_"


def _check_master(address: str, timeout_s: float = 2.0) -> None:
    """Fail at once on a master that does not answer (Mooncake's setup retries for 90 s)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout_s).close()
    except ValueError:
        raise InvalidArgumentError(
            f"mooncake master_server_address {address!r} is not host:port"
        ) from None
    except OSError as exc:
        raise BackendUnavailableError(f"mooncake master {address} does not answer: {exc}") from exc


# What ``get`` finds when the record under a key is not a sound page (not a miss, not
# the master): the record is removed, so the next put of the key stores the page again.
_DAMAGED = ("checksum mismatch", "not a sealed page", "unreadable (mooncake error -600")


class MooncakeStorage(StorageBackend):
    name = "mooncake"
    shared = True

    def __init__(self, config: MooncakeConfig, page_bytes: int, identity: str = "") -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:  # the wheel, or libibverbs.so.1 under it
            raise BackendUnavailableError(
                "--hicache-storage-backend mooncake needs the mooncake-transfer-engine-non-cuda "
                f"wheel (pip install 'kvstack[cluster]') and libibverbs1: {exc}"
            ) from exc
        self.config = config
        self.page_bytes = page_bytes
        self.prefix = key_prefix(config, identity, page_bytes)
        self._written: set[str] = set()  # keys this backend put and did not forget
        self._down_until = 0.0  # calls fail at once until then (the master was lost)
        self._staging = np.zeros(self.record_bytes, dtype=np.uint8)
        self._addr = self._staging.ctypes.data
        _check_master(config.master_server_address)
        store = MooncakeDistributedStore()
        code = store.setup(
            config.local_hostname,
            config.metadata_server,
            config.global_segment_size,
            max(config.local_buffer_size, self.record_bytes),
            config.protocol,
            config.device_name,
            config.master_server_address,
        )
        if code != 0:
            store.close()
            raise BackendUnavailableError(
                f"mooncake store at {config.master_server_address} ({config.protocol}, "
                f"metadata {config.metadata_server}) did not set up: {_error(code)}"
            )
        code = store.register_buffer(self._addr, self.record_bytes)
        if code != 0:
            store.close()
            raise BackendUnavailableError(f"mooncake register_buffer failed: {_error(code)}")
        self._store: Any = store

    def _object(self, key: str) -> str:
        return self.prefix + key

    def _reachable(self) -> str | None:
        """Why not to call the store now (closed, or the master lost a moment ago)."""
        if self._store is None:
            return "closed"
        if time.monotonic() < self._down_until:
            return "master unreachable"
        return None

    def _seen(self, code: int) -> None:
        if code in _UNREACHABLE:
            self._down_until = time.monotonic() + self.config.retry_after_s

    def _write(self, key: str, data: memoryview, trailer: bytes) -> None:
        why = self._reachable()
        if why is not None:
            raise OSError(f"mooncake put of {key}: {why}")
        page_bytes = self.page_bytes
        self._staging[:page_bytes] = np.frombuffer(data, dtype=np.uint8)
        self._staging[page_bytes:] = np.frombuffer(trailer, dtype=np.uint8)
        # create-only: a page another node stored first stays (it is the same page)
        code = self._store.put_from(self._object(key), self._addr, self.record_bytes)
        self._seen(code)
        if code != 0:
            raise OSError(f"mooncake put of {key}: {_error(code)}")
        self._written.add(key)

    def _read(self, key: str, data: memoryview, trailer: bytearray) -> str | None:
        why = self._reachable()
        if why is not None:
            return why
        size = self._store.get_into(self._object(key), self._addr, self.record_bytes)
        self._seen(size)
        if size == OBJECT_NOT_FOUND:
            return "missing"
        if size < 0:
            return f"unreadable ({_error(size)})"
        if size != self.record_bytes:
            return f"{size} bytes, not {self.record_bytes} bytes"
        page_bytes = self.page_bytes
        np.frombuffer(data, dtype=np.uint8)[:] = self._staging[:page_bytes]
        trailer[:] = self._staging[page_bytes:].tobytes()
        return None

    def get(self, key: str, out: np.ndarray) -> str | None:
        why = super().get(key, out)
        damaged = why is not None and (why.startswith(_DAMAGED) or why.endswith(" bytes"))
        if damaged and self._reachable() is None:
            # force: a lease (any get grants one) must not keep a page nobody can use
            self._seen(self._store.remove(self._object(key), True))
        return why

    def delete(self, key: str) -> None:
        """Forget ``key`` (this node's tree dropped it); the page stays in the store for
        the nodes that may use it, until Mooncake evicts it."""
        self._written.discard(key)

    def exists(self, keys: list[str]) -> list[bool]:
        """Whether the store holds a record under each key, whoever wrote it (one round
        trip; not verified: :meth:`get` does that); all ``False`` while it cannot be
        reached. How another node's pages can be found: the tree's hash chain gives the
        keys a prefix would have."""
        if not keys or self._reachable() is not None:
            return [False] * len(keys)
        found = self._store.batch_is_exist([self._object(k) for k in keys])
        for code in found:
            self._seen(code)
        return [code == 1 for code in found]

    def keys(self) -> set[str]:
        """The keys this backend put that the store still holds: none while the store
        cannot be reached (nothing can be read from it then)."""
        if not self._written or self._reachable() is not None:
            return set()
        written = sorted(self._written)
        found = self._store.batch_is_exist([self._object(k) for k in written])
        for code in found:
            self._seen(code)
        return {k for k, present in zip(written, found, strict=True) if present == 1}

    def close(self) -> None:
        """Leave the store; the pages this node wrote stay for the other nodes (those
        placed in this node's segment leave with it: Mooncake unmounts it)."""
        store, self._store = self._store, None
        if store is None:
            return
        self._written.clear()
        store.unregister_buffer(self._addr)
        store.close()


__all__ = ["MooncakeConfig", "MooncakeStorage", "parse_extra_config"]
