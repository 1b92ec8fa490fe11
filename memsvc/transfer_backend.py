"""``--transfer-backend``: how a PD memsvc pair moves KV pages (:mod:`memsvc.transfer`)."""

from __future__ import annotations

import importlib.util
from enum import StrEnum


class TransferBackend(StrEnum):
    AUTO = "auto"  # nixl if the nixl-cu12 wheel is installed, else zmq
    NIXL = "nixl"  # NIXL/UCX writes straight into the peer's pool
    ZMQ = "zmq"  # raw bytes frames

    def resolve(self) -> TransferBackend:
        """The backend :data:`AUTO` stands for here; any other is itself."""
        if self is not TransferBackend.AUTO:
            return self
        return (
            TransferBackend.NIXL if importlib.util.find_spec("nixl_cu12") else TransferBackend.ZMQ
        )


# What a TransferAgent runs: every backend but auto.
TRANSFER_BACKENDS = tuple(b.value for b in TransferBackend if b is not TransferBackend.AUTO)
