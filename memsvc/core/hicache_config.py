"""The hierarchical cache's settings (``--hicache-*``) and its write policies."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from memsvc.core.errors import InvalidArgumentError
from memsvc.core.storage import StorageBackendName


class WritePolicy(StrEnum):
    """When a device node is copied to the host tier (SGLang's names)."""

    WRITE_BACK = "write_back"  # when it is evicted from the device
    WRITE_THROUGH = "write_through"  # when it is inserted
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # once it has been hit


@dataclass(frozen=True)
class HiCacheConfig:
    """``--hicache-*``: sizes in bytes (the flags take GB).

    The fields' metadata declare the flags (:mod:`memsvc.settings`); memsvc's
    ``--enable-hierarchical-cache`` decides whether there is a config at all.
    """

    ratio: float = field(
        default=2.0,  # SGLang's default in cache mode
        metadata={
            "flag": "--hicache-ratio",
            "help": "host tier size as a multiple of the device KV pool",
            "forward": True,
        },
    )
    size_bytes: int = field(  # > 0 overrides ratio
        default=0,
        metadata={
            "flag": "--hicache-size",
            "help": "host tier size in GB (1e9 bytes); > 0 overrides --hicache-ratio",
            "type": float,
            "scale": 1e9,
            "metavar": "GB",
            "forward": True,
        },
    )
    write_policy: WritePolicy = field(
        default=WritePolicy.WRITE_THROUGH,  # SGLang's default
        metadata={
            "flag": "--hicache-write-policy",
            "help": "write_through: copy a node to host when it is inserted; "
            "write_through_selective: once it has been hit; write_back: when it is evicted",
            "forward": True,
        },
    )
    disable_load_cost_model: bool = field(
        default=False,
        metadata={
            "flag": "--hicache-disable-load-cost-model",
            "help": "load every host / storage hit of at least 10 tokens back (SGLang's "
            "load_back_threshold) instead of only those the cost model finds cheaper to copy "
            "than to recompute (copy bandwidth against the worker's prefill time per token)",
            "forward": True,
        },
    )
    copy_gb_per_s: float = field(  # 0: measured when the cache is created
        default=0.0,
        metadata={
            "flag": "--hicache-copy-bandwidth",
            "help": "the cost model's host -> device copy bandwidth in GB/s (1e9 bytes); "
            "0: measured at start on the pool's own pages",
            "metavar": "GB_PER_S",
            "forward": True,
        },
    )
    recompute_us_per_token: float = field(  # 0: the scheduler's measured prefill rate
        default=0.0,
        metadata={
            "flag": "--hicache-recompute-us-per-token",
            "help": "the cost model's prefill time per token in microseconds; 0: as the "
            "scheduler measures it and sends it with each admission (until it does, "
            "every hit above the threshold is loaded)",
            "metavar": "US",
            "forward": True,
        },
    )
    storage_backend: StorageBackendName | None = field(
        default=None,
        metadata={
            "flag": "--hicache-storage-backend",
            "help": "third tier, fed by host-tier eviction: file (a local directory), nixl "
            "(NIXL's POSIX storage plugin on the same directory) or mooncake (a Mooncake Store "
            "shared by every node on its master); unset: host eviction drops KV",
            "forward": True,
        },
    )
    storage_dir: str | None = field(  # the base of our own subdirectory; None: per user
        default=None,
        metadata={
            "flag": "--hicache-storage-dir",
            "metavar": "PATH",
            "help": "base directory of the storage tier (default: $XDG_CACHE_HOME/kvstack/"
            "hicache, else ~/.cache/kvstack/hicache); it must be yours and not writable by "
            "others. Each memsvc keeps its pages (0600, checksummed) in a 0700 subdirectory of "
            "its own, <role>-<pid>-<random>, removed when it stops",
            "forward": True,
        },
    )
    storage_size_bytes: int = field(  # 0: 4 x the host tier
        default=0,
        metadata={
            "flag": "--hicache-storage-size",
            "help": "storage tier cap in GB (1e9 bytes); 0: 4 x the host tier",
            "type": float,
            "scale": 1e9,
            "metavar": "GB",
            "forward": True,
        },
    )
    storage_keep: bool = field(
        default=False,
        metadata={
            "flag": "--hicache-storage-keep",
            "help": "keep the storage tier across restarts, in <storage dir>/kept-<role>: a "
            "kept page is served only if its key (model digest, dtype, KV layout, page size, "
            "cache namespace, token prefix) is the one asked for and its checksum holds; "
            "needs --model-digest (kvstack serve / up pass it)",
            "forward": True,
        },
    )
    storage_extra_config: str | None = field(
        default=None,
        metadata={
            "flag": "--hicache-storage-backend-extra-config",
            "metavar": "JSON",
            "help": "the storage backend's settings: a JSON object, or @path of a JSON file. "
            "mooncake: master_server_address, metadata_server, protocol, global_segment_size, "
            "... as SGLang reads them (else SGLANG_HICACHE_MOONCAKE_CONFIG_PATH, else "
            "MOONCAKE_MASTER and the other MOONCAKE_* variables)",
            "forward": True,
        },
    )
    storage_role: str = "normal"  # names the subdirectory: normal, prefill or decode (no flag)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))
        except ValueError:
            raise InvalidArgumentError(
                f"hicache write policy {self.write_policy!r} is not one of "
                f"{tuple(p.value for p in WritePolicy)}"
            ) from None
        if self.storage_backend is not None:
            try:
                backend = StorageBackendName(self.storage_backend)
            except ValueError:
                raise InvalidArgumentError(
                    f"unknown storage backend {self.storage_backend!r}; choose from "
                    f"{tuple(b.value for b in StorageBackendName)}"
                ) from None
            object.__setattr__(self, "storage_backend", backend)
        if self.storage_keep and self.storage_backend is None:
            raise InvalidArgumentError("--hicache-storage-keep needs --hicache-storage-backend")
        if self.storage_keep and self.storage_backend is StorageBackendName.MOONCAKE:
            raise InvalidArgumentError("--hicache-storage-keep keeps a directory: file or nixl")
        if self.ratio <= 0 and self.size_bytes <= 0:
            raise InvalidArgumentError("the host tier needs --hicache-ratio > 0 or --hicache-size")
        if self.size_bytes < 0 or self.storage_size_bytes < 0:
            raise InvalidArgumentError("hicache sizes must be >= 0")
        if not (self.copy_gb_per_s >= 0 and self.recompute_us_per_token >= 0):
            raise InvalidArgumentError(
                "--hicache-copy-bandwidth and --hicache-recompute-us-per-token must be >= 0"
            )

    def host_pages(self, device_pages: int, page_bytes: int) -> int:
        if self.size_bytes > 0:
            return self.size_bytes // page_bytes
        return int(device_pages * self.ratio)

    def storage_pages(self, host_pages: int, page_bytes: int) -> int:
        if self.storage_size_bytes > 0:
            return self.storage_size_bytes // page_bytes
        return 4 * host_pages
