"""``MemsvcConfig``: every setting of ``python -m memsvc``, each declared once with its flag.

Parts: the pool's layout (:class:`PoolLayout`), the hierarchical cache
(:class:`HiCacheConfig`, None unless ``--enable-hierarchical-cache``) and the
service's limits (:class:`ServiceConfig`); the rest are memsvc's own options.
``build_parser`` in :mod:`memsvc.__main__` and the ``kvstack`` commands
(the flags marked ``forward``) are built from it (:mod:`memsvc.settings`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from memsvc.cli import DEFAULT_NUM_PAGES, DEFAULT_PAGE_SIZE
from memsvc.core.backends import BACKENDS
from memsvc.core.errors import InvalidArgumentError
from memsvc.core.hicache_config import HiCacheConfig
from memsvc.core.identity import KVIdentity
from memsvc.core.layout import (
    DEFAULT_SWA_FULL_TOKENS_RATIO,
    LAYER_TYPES,
    PoolLayout,
    hybrid_layout,
)
from memsvc.handlers import ServiceConfig
from memsvc.kv_events import check_kv_events_config
from memsvc.sessions import REPLY_CACHE_SIZE
from memsvc.settings import setting
from memsvc.transfer_backend import TransferBackend

POOL = "pool layout (the model's; kvstack serve / up read it from the checkpoint)"
MEMORY = "memory"
HICACHE = "hierarchical cache (radix tree over device pool, host memory and storage)"
PD = "PD disaggregation (KV transfer between two memsvc)"
SERVICE = "service"
EVENTS = "KV cache events (for KV-aware routers)"

# PoolLayout is the core's; its flags (and memsvc's defaults for them) are declared here.
LAYOUT_FLAGS = {
    "num_layers": {"help": "transformer layers (num_hidden_layers)"},
    "num_kv_heads": {"help": "KV heads per layer (num_key_value_heads)"},
    "head_dim": {"help": "dimension of one head"},
    "page_size": {"help": "tokens per page", "default": DEFAULT_PAGE_SIZE},
    "num_pages": {
        "help": "usable pages (capacity = num_pages x page_size tokens)",
        "default": DEFAULT_NUM_PAGES,
    },
    "dtype": {
        "help": "KV element type",
        "choices": ("float16", "bfloat16", "float32", "float64"),
        "default": "float32",
    },
    "max_running_requests": {
        "help": "requests holding KV at once (req_to_token rows; the scheduler runs at most "
        "as many)",
        "default": 256,
        "forward": True,
    },
    "max_context_len": {"help": "longest request (prompt + output) in tokens", "default": 4096},
}

SERVICE_FLAGS = {
    "retract_decode_steps": {
        "help": "after each retract release, evict remaining x this many tokens "
        "(env SGLANG_RETRACT_DECODE_STEPS)",
        "env": "SGLANG_RETRACT_DECODE_STEPS",
        "group": MEMORY,
        "forward": True,
    },
    "max_message_bytes": {
        "help": "larger requests get a too_large error reply (read and dropped frame by frame)"
    },
    "max_sessions": {"help": "sessions open at once; one more hello gets too_many_sessions"},
    "max_lease_s": {
        "flag": "--max-lease",
        "help": "longest session lease (seconds) a hello may ask for",
    },
    "reply_cache_bytes": {
        "help": "bytes of replies (with their requests) each session keeps to answer a "
        "retried op (and at most "
        f"{REPLY_CACHE_SIZE} replies); the oldest go first, the newest is always kept"
    },
}


@dataclass(frozen=True)
class MetricsConfig:
    """``--metrics-port`` / ``--metrics-host``: memsvc's and the scheduler's Prometheus."""

    port: int | None = setting(
        None,
        "serve Prometheus metrics on --metrics-host:PORT (0: any free port)",
        flag="--metrics-port",
    )
    host: str = setting(
        "127.0.0.1",
        "address the metrics server binds (non-loopback needs --allow-remote)",
        flag="--metrics-host",
    )


@dataclass(frozen=True)
class MemsvcConfig:
    layout: PoolLayout = field(metadata={"part": PoolLayout, "group": POOL, "fields": LAYOUT_FLAGS})
    # A hybrid (sliding-window) model: the layout's num_pages is the byte budget of every
    # layer full, split into the two pools by swa_full_tokens_ratio (SGLang's sizing).
    layer_types: str | None = setting(
        None,
        "each layer's attention, comma-separated: full_attention or sliding_attention "
        "(transformers' config.layer_types); with a sliding layer the pool is two pools, "
        "full and SWA, in the bytes --num-pages pages of every layer would take",
        metavar="TYPES",
        group=POOL,
    )
    sliding_window: int = setting(
        0, "tokens a sliding_attention layer attends to (config.sliding_window)", group=POOL
    )
    swa_full_tokens_ratio: float = setting(
        DEFAULT_SWA_FULL_TOKENS_RATIO,
        "SWA pool tokens per full pool token, per layer (SGLang's --swa-full-tokens-ratio)",
        group=POOL,
        forward=True,
    )
    disable_radix_cache: bool = setting(
        False,
        "no prefix reuse: finished requests' KV is freed, not cached",
        group=POOL,
        forward=True,
    )
    max_cached_tokens_per_salt: int = setting(
        0,
        "cap on the device tokens the prefix cache holds for one cache namespace (a "
        "cache_salt / extra_key): past it, that namespace evicts its own least recently "
        "used unlocked prefixes, never another's; the default namespace is exempt; 0: no cap",
        metavar="N",
        group=POOL,
        forward=True,
    )
    model_digest: str | None = setting(
        None,
        "sha256 of the checkpoint's config and weights (kvstack serve / up pass it): it names "
        "every stored KV page with the dtype, KV layout, page size and cache namespace; "
        "--hicache-storage-keep needs it",
        metavar="SHA256",
        group=POOL,
    )
    backend: str = setting(
        "shm",
        "shm: POSIX shared memory (no GPU); cuda: cupy + CUDA IPC",
        choices=BACKENDS,
        group=MEMORY,
    )
    device: int = setting(0, "GPU index for --backend cuda", group=MEMORY)
    host_store_bytes: int | None = setting(
        None,
        "CPU RAM for offloaded (retracted) KV, in bytes (default: the size of the KV pool; "
        "a hybrid model's two pools)",
        metavar="BYTES",
        group=MEMORY,
        forward=True,
    )
    offload_copy: str = setting(
        "auto",
        "async: an offload returns once its copy is issued (CUDA copy stream / shm copy "
        "thread) and the pages it reads are reused only after it has finished; sync: it "
        "returns when the copy is done; auto (default): async on cuda, sync on shm",
        choices=("auto", "sync", "async"),
        group=MEMORY,
        forward=True,
    )
    zero_freed_kv: bool = setting(
        False,
        "zero the pages (device pool and host tiers) that held a salted request's KV (a "
        "non-default cache namespace) before anyone else gets them",
        group=MEMORY,
        forward=True,
    )
    hicache: HiCacheConfig | None = field(
        default=None,
        metadata={
            "part": HiCacheConfig,
            "switch": "--enable-hierarchical-cache",
            "help": "keep evicted radix-tree KV in a host-memory tier (and a storage tier) and "
            "load it back on a prefix match instead of recomputing it",
            "group": HICACHE,
            "forward": True,
        },
    )
    pd_role: str = setting(
        "none",
        "prefill: send prompt KV to the decode node's memsvc (--transfer-peer); decode: "
        "receive it (--transfer-listen)",
        choices=("none", "prefill", "decode"),
        group=PD,
    )
    transfer_backend: TransferBackend = setting(  # noqa: RUF009 (a field)
        TransferBackend.AUTO,
        "nixl: NIXL/UCX writes straight into the peer's pool (UCX on the loopback device "
        "only, unless --allow-remote); zmq: raw bytes frames; auto: nixl if the nixl-cu12 "
        "wheel is installed, else zmq",
        group=PD,
        forward=True,
    )
    transfer_listen: str | None = setting(
        None,
        "decode role: where prefill-node memsvc connect (tcp://HOST:PORT or ipc://PATH)",
        group=PD,
    )
    transfer_peer: str | None = setting(
        None,
        "prefill role: the decode-node memsvc's --transfer-listen address (the default "
        "peer: a pd_send may name another)",
        group=PD,
    )
    transfer_timeout: float = setting(
        5.0,
        "seconds without a word from the peer memsvc before its transfers fail",
        group=PD,
        forward=True,
    )
    service: ServiceConfig = field(
        default_factory=ServiceConfig,
        metadata={"part": ServiceConfig, "group": SERVICE, "fields": SERVICE_FLAGS},
    )
    reap_interval: float = setting(
        0.25, "seconds between checks for expired session leases", group=SERVICE
    )
    metrics: MetricsConfig = field(
        default_factory=MetricsConfig,
        metadata={"part": MetricsConfig, "group": SERVICE},
    )
    kv_events_config: str | None = setting(
        None,
        "publish SGLang's KV cache events (BlockStored / BlockRemoved / AllBlocksCleared) "
        "for KV-aware routers, configured as SGLang's flag: a JSON object, e.g. "
        '\'{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": '
        '"tcp://*:5558"}\' (docs/cluster.md)',
        metavar="JSON",
        group=EVENTS,
        forward=True,
    )

    def __post_init__(self) -> None:
        if self.layer_types is not None:
            object.__setattr__(self, "layout", self._hybrid_layout(self.layer_types))
        elif self.sliding_window:
            raise InvalidArgumentError("--sliding-window needs --layer-types")
        identity = self.identity  # a bad --model-digest is refused here
        check_kv_events_config(self.kv_events_config)
        if self.hicache is not None and self.hicache.storage_keep:
            identity.require_model("--hicache-storage-keep")
        if self.hicache is not None and self.hicache.storage_backend == "mooncake":
            identity.require_model("--hicache-storage-backend mooncake (a shared tier)")
        # The storage tier's subdirectory is named after the PD role.
        role = "normal" if self.pd_role == "none" else self.pd_role
        if self.hicache is not None and self.hicache.storage_role != role:
            hicache = dataclasses.replace(self.hicache, storage_role=role)
            object.__setattr__(self, "hicache", hicache)

    def _hybrid_layout(self, text: str) -> PoolLayout:
        layer_types = tuple(t.strip() for t in text.split(",") if t.strip())
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise InvalidArgumentError(
                f"--layer-types: unknown layer type(s) {unknown}; each is one of {LAYER_TYPES}"
            )
        if len(layer_types) != self.layout.num_layers:
            raise InvalidArgumentError(
                f"--layer-types names {len(layer_types)} layers, --num-layers is "
                f"{self.layout.num_layers}"
            )
        return hybrid_layout(
            self.layout, layer_types, self.sliding_window, self.swa_full_tokens_ratio
        )

    @property
    def identity(self) -> KVIdentity:
        """Whose KV the pool's stored pages hold (seeds their keys: memsvc.core.identity)."""
        return KVIdentity.of(self.layout, self.model_digest)

    @property
    def async_offload(self) -> bool:
        """``--offload-copy``: async, or auto on cuda."""
        return self.offload_copy == "async" or (
            self.offload_copy == "auto" and self.backend == "cuda"
        )
