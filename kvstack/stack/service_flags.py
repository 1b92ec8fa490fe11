"""The services' tuning flags, as ``kvstack serve`` and ``kvstack up`` take and forward them.

Each flag keeps the name of the service flag it becomes (SGLang's name where
SGLang has the knob) and goes to one service: memsvc, scheduler_svc or the PD
router. A flag is forwarded only when the user set it, so each service keeps
its own default (``python -m scheduler_svc --help`` and friends list them).
``--help`` shows the flags in argparse groups, one per concern (see
:data:`FLAG_GROUPS`).

The PD transfer flags (``--transfer-backend``, ``--transfer-timeout``) also
go to memsvc, but only in PD mode and through the launcher, which wires the
transfer socket (:func:`transfer_options`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler_svc.core.config import RETRACTION_POLICIES

MEMSVC = "memsvc"
SCHEDULER = "scheduler"
ROUTER = "router"
SERVICE_NAMES = {MEMSVC: "memsvc", SCHEDULER: "scheduler_svc", ROUTER: "the PD router"}


def number(kind: Callable[[str], Any]) -> Callable[[str], str]:
    """An argparse ``type`` that checks the value parses as ``kind`` and keeps the user's text.

    The text is what reaches the service, so ``--hicache-size 4`` stays ``4``
    for a service that parses an int, not ``4.0``.
    """

    def parse(text: str) -> str:
        try:
            kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        return text

    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


@dataclass(frozen=True)
class Flag:
    """One service flag: ``name`` on the command line and on ``service``'s."""

    name: str
    service: str
    help: str
    type: Callable[[str], Any] | None = None  # None with choices / store_true
    choices: tuple[str, ...] | None = None
    switch: bool = False  # store_true
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def add_to(self, group: Any) -> None:
        # SUPPRESS: an unset flag is absent from the namespace, and --help adds no
        # "(default: None)" (the help text names whose default applies).
        if self.switch:
            group.add_argument(
                self.name, action="store_true", default=argparse.SUPPRESS, help=self.help
            )
            return
        group.add_argument(
            self.name,
            type=self.type,
            choices=self.choices,
            default=argparse.SUPPRESS,
            metavar=self.metavar,
            help=self.help
            if "default" in self.help
            else f"{self.help} (default: {SERVICE_NAMES[self.service]}'s own)",
        )

    def argv(self, args: argparse.Namespace) -> list[str]:
        """``[name, value]`` (``[name]`` for a switch) if the user set it, else ``[]``."""
        value = getattr(args, self.dest, None)
        if self.switch:
            return [self.name] if value else []
        return [] if value is None else [self.name, str(value)]


RETRACT_MODES = ("recompute", "offload", "auto")

POOL_FLAGS = [
    Flag(
        "--max-running-requests",
        MEMSVC,
        "requests holding KV at once (memsvc's "
        "req_to_token rows; the scheduler runs at most as many)",
        type=int,
    ),
    Flag("--disable-radix-cache", MEMSVC, "no prefix reuse between requests", switch=True),
    Flag(
        "--host-store-bytes",
        MEMSVC,
        "CPU RAM for offloaded (retracted) KV, in bytes (memsvc's default: the KV pool's size)",
        type=int,
        metavar="BYTES",
    ),
    Flag(
        "--offload-copy",
        MEMSVC,
        "how an offload copies: async (returns once the copy is "
        "issued), sync, auto (async on cuda, sync on shm)",
        choices=("auto", "sync", "async"),
    ),
]

SCHEDULING_FLAGS = [
    Flag("--max-prefill-tokens", SCHEDULER, "most tokens one prefill batch computes", type=int),
    Flag(
        "--chunked-prefill-size",
        SCHEDULER,
        "split long prompts into chunks of this many tokens",
        type=int,
    ),
    Flag(
        "--schedule-conservativeness",
        SCHEDULER,
        "scales the initial new_token_ratio (higher: admit fewer)",
        type=float,
    ),
    Flag(
        "--enable-priority-scheduling",
        SCHEDULER,
        "honour request priorities (needed by --retraction-policy priority)",
        switch=True,
    ),
    Flag(
        "--schedule-low-priority-values-first",
        SCHEDULER,
        "a lower priority value is more important",
        switch=True,
    ),
]

RETRACT_FLAGS = [
    Flag(
        "--retract-mode",
        SCHEDULER,
        "what a retracted request's KV becomes: dropped and "
        "re-prefilled (recompute, SGLang's), parked in memsvc's host store (offload), or per "
        "victim the cheaper of the two (auto)",
        choices=RETRACT_MODES,
    ),
    Flag(
        "--retraction-policy",
        SCHEDULER,
        "victim order: fewest outputs first (length, "
        "SGLang's), lowest priority (priority), cheapest to bring back (cost)",
        choices=RETRACTION_POLICIES,
    ),
    Flag(
        "--retract-cooldown-steps",
        SCHEDULER,
        "thrash guard: a re-admitted request is not a "
        "victim again for this many forward passes unless nothing else can be (0: off)",
        type=int,
    ),
    Flag(
        "--readmit-charge",
        SCHEDULER,
        "what re-admitting a retracted request reserves for its "
        "output: what it has left (remaining) or its whole max_new_tokens (full, SGLang's)",
        choices=("remaining", "full"),
    ),
    Flag(
        "--retract-decode-steps",
        MEMSVC,
        "after each retract, evict remaining x this many "
        "tokens (SGLang's SGLANG_RETRACT_DECODE_STEPS)",
        type=int,
    ),
]

PD_FLAGS = [
    Flag(
        "--num-reserved-decode-tokens",
        SCHEDULER,
        "decode node: tokens reserved per active request when preallocating",
        type=int,
    ),
    Flag(
        "--pd-retract-fallback",
        SCHEDULER,
        "decode node: a victim the host store cannot take "
        "is aborted (SGLang's) or re-prefilled through the prefill node",
        choices=("abort", "recompute"),
    ),
    Flag(
        "--prefill-timeout",
        ROUTER,
        "seconds of silence from the prefill scheduler before its requests fail",
        type=float,
    ),
    Flag(
        "--stall-timeout",
        ROUTER,
        "seconds without progress on a node with queued work before /health calls the stack wedged",
        type=float,
    ),
]

HICACHE_FLAGS = [
    Flag(
        "--enable-hierarchical-cache",
        MEMSVC,
        "keep evicted radix-tree KV in a host-memory tier (and a storage tier) and load it "
        "back on a prefix match instead of recomputing it",
        switch=True,
    ),
    Flag(
        "--hicache-ratio",
        MEMSVC,
        "host tier size as a multiple of the device KV pool",
        type=number(float),
        metavar="FLOAT",
    ),
    Flag(
        "--hicache-size",
        MEMSVC,
        "host tier size in GB (1e9 bytes); > 0 overrides --hicache-ratio",
        type=number(float),
        metavar="GB",
    ),
    Flag(
        "--hicache-write-policy",
        MEMSVC,
        "write_through: copy a node to host when it is inserted; write_through_selective: "
        "once it has been hit; write_back: when it is evicted",
        choices=("write_back", "write_through", "write_through_selective"),
    ),
    Flag(
        "--hicache-storage-backend",
        MEMSVC,
        "third tier, fed by host-tier eviction: file (a local directory) or nixl (NIXL's "
        "POSIX storage plugin on the same directory); unset: host eviction drops KV",
        choices=("file", "nixl"),
    ),
    Flag(
        "--hicache-storage-dir",
        MEMSVC,
        "base directory of the storage tier (default: $XDG_CACHE_HOME/kvstack/hicache, else "
        "~/.cache/kvstack/hicache); yours and not writable by others. Each memsvc (both in PD "
        "mode) keeps its checksummed 0600 pages in a 0700 subdirectory of its own, removed "
        "when it stops",
        metavar="PATH",
    ),
    Flag(
        "--hicache-storage-size",
        MEMSVC,
        "storage tier cap in GB (1e9 bytes); memsvc's default 0 is 4 x the host tier",
        type=number(float),
        metavar="GB",
    ),
]

FAULT_FLAGS = [
    Flag(
        "--memsvc-timeout",
        SCHEDULER,
        "seconds memsvc has to answer one op (tried 3 times) before the scheduler counts it dead",
        type=float,
    ),
    Flag(
        "--memsvc-lease",
        SCHEDULER,
        "memsvc reclaims the scheduler's KV this long after it goes silent",
        type=float,
    ),
    Flag(
        "--worker-timeout",
        SCHEDULER,
        "seconds model_svc has to answer one forward call",
        type=float,
    ),
    Flag(
        "--recovery-timeout",
        SCHEDULER,
        "how long to wait for a dead memsvc or model_svc "
        "to come back before failing the live requests",
        type=float,
    ),
]

# (title, flags); ``--help`` shows one argparse group per entry, in this order.
FLAG_GROUPS: list[tuple[str, list[Flag]]] = [
    ("KV pool and host store (memsvc)", POOL_FLAGS),
    ("scheduling (scheduler_svc)", SCHEDULING_FLAGS),
    ("retract (scheduler_svc; --retract-decode-steps: memsvc)", RETRACT_FLAGS),
    ("hierarchical cache (memsvc)", HICACHE_FLAGS),
    ("fault tolerance (scheduler_svc)", FAULT_FLAGS),
]
PD_GROUP = "PD disaggregation (--mode pd)"
ALL_FLAGS = [flag for _, flags in FLAG_GROUPS for flag in flags] + PD_FLAGS


def add_service_flags(parser: argparse.ArgumentParser) -> None:
    """Every group of :data:`FLAG_GROUPS`, then the PD group with the transfer flags."""
    for title, flags in FLAG_GROUPS:
        group = parser.add_argument_group(title)
        for flag in flags:
            flag.add_to(group)
    pd = parser.add_argument_group(PD_GROUP)
    pd.add_argument(
        "--transfer-backend",
        choices=["auto", "nixl", "zmq"],
        default=argparse.SUPPRESS,
        help="how the memsvc pair moves KV pages: nixl (NIXL/UCX), zmq, or auto (nixl if "
        "the nixl-cu12 wheel is installed, else zmq; default: auto)",
    )
    pd.add_argument(
        "--transfer-timeout",
        type=float,
        default=argparse.SUPPRESS,
        help="seconds without a word from the peer memsvc before its transfers fail "
        "(default: memsvc's own)",
    )
    for flag in PD_FLAGS:
        flag.add_to(pd)


def service_argv(args: argparse.Namespace, service: str) -> list[str]:
    """The flags of ``service`` the user set, as that service takes them."""
    return [part for flag in ALL_FLAGS if flag.service == service for part in flag.argv(args)]


def transfer_options(args: argparse.Namespace) -> dict[str, Any]:
    """``transfer_backend`` / ``transfer_timeout`` the user set (for the PD launchers)."""
    names = ("transfer_backend", "transfer_timeout")
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def add_model_flags(group: Any) -> None:
    """``serve`` / ``up``'s own model flags, into the model group of :mod:`model_args`.

    SGLang's ``--served-model-name`` (the model's name in the API and the
    metrics) and ``--max-context-len`` (the longest request, memsvc's rows).
    """
    group.add_argument(
        "--served-model-name",
        default=argparse.SUPPRESS,
        metavar="NAME",
        help="the model's name in /v1/models, responses and the metrics' model_name label "
        "(default: --model-path as given, as SGLang; serve --scheduler without it: the "
        "scheduler's)",
    )
    group.add_argument(
        "--max-context-len",
        type=int,
        default=argparse.SUPPRESS,
        help="longest request (prompt + output) in tokens (default: the checkpoint's "
        "max_position_embeddings)",
    )


def served_model_name(args: argparse.Namespace) -> str | None:
    return getattr(args, "served_model_name", None) or args.model_path


def add_ready_timeout(group: Any) -> None:
    """``--ready-timeout``: how long ``serve`` and ``up`` give each service to start."""
    from kvstack.stack.launch import LOAD_S_PER_GB, READY_TIMEOUT_S

    group.add_argument(
        "--ready-timeout",
        type=float,
        default=argparse.SUPPRESS,
        metavar="SECONDS",
        help="seconds each service may take to start (default: "
        f"{READY_TIMEOUT_S:g}, plus {LOAD_S_PER_GB:g} per GB of checkpoint, which model_svc "
        "loads)",
    )


def ready_timeout(args: argparse.Namespace, checkpoint: str | Path | None) -> float:
    """``--ready-timeout``, or its default for ``checkpoint`` (None: no model to load)."""
    from kvstack.stack.launch import READY_TIMEOUT_S, model_ready_timeout

    given = getattr(args, "ready_timeout", None)
    if given is not None:
        return given
    return READY_TIMEOUT_S if checkpoint is None else model_ready_timeout(checkpoint)
