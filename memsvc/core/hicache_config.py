"""The hierarchical cache's settings (``--hicache-*``) and its write policies."""

from __future__ import annotations

from dataclasses import dataclass
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
    """``--hicache-*``: sizes in bytes (the flags take GB)."""

    ratio: float = 2.0  # SGLang's default in cache mode
    size_bytes: int = 0  # > 0 overrides ratio
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH  # SGLang's default
    storage_backend: StorageBackendName | None = None
    storage_dir: str | None = None  # the base of our own subdirectory; None: per user
    storage_size_bytes: int = 0  # 0: 4 x the host tier
    storage_role: str = "normal"  # names the subdirectory: normal, prefill or decode

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
        if self.ratio <= 0 and self.size_bytes <= 0:
            raise InvalidArgumentError("the host tier needs --hicache-ratio > 0 or --hicache-size")
        if self.size_bytes < 0 or self.storage_size_bytes < 0:
            raise InvalidArgumentError("hicache sizes must be >= 0")

    def host_pages(self, device_pages: int, page_bytes: int) -> int:
        if self.size_bytes > 0:
            return self.size_bytes // page_bytes
        return int(device_pages * self.ratio)

    def storage_pages(self, host_pages: int, page_bytes: int) -> int:
        if self.storage_size_bytes > 0:
            return self.storage_size_bytes // page_bytes
        return 4 * host_pages
