"""The figures of ``bench/hicache.py``: what one stack did in a cell, what the hierarchy
moved, whether two stacks agreed token for token, and the machine it ran on."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from hicache_workload import Turn  # bench/, on the path as the script's folder

# The scheduler's info stats a cell reports, as differences over its rounds.
STAT_KEYS = (
    "prefill_tokens",
    "generated_tokens",
    "forward_passes",
    "prefill_passes",  # batch composition: passes of each kind and the requests they carried
    "prefill_pass_reqs",
    "decode_passes",
    "decode_pass_reqs",
    "retracted_reqs",
    "prefill_s",
    "decode_s",
)
TIERS = ("device", "host", "storage")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def hit_tokens(turns: list[Turn]) -> dict[str, int]:
    """Prompt tokens that hit each tier, from the replies: ``cached_tokens_details`` where
    the hierarchy gives it, else every cached token is a device hit (radix-only)."""
    out = dict.fromkeys(TIERS, 0)
    for t in turns:
        details = t.meta_info.get("cached_tokens_details")
        if details:
            for tier in TIERS:
                out[tier] += int(details.get(tier) or 0)
        else:
            out["device"] += int(t.meta_info.get("cached_tokens", 0))
    return out


def summarize(rounds: list[dict[str, Any]], turns: list[Turn]) -> dict[str, Any]:
    wall_s = sum(r["wall_s"] for r in rounds)
    ttft = [t.ttft_s for t in turns]
    out = {
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_p99_s": round(percentile(ttft, 0.99), 4),
        "e2e_p50_s": round(statistics.median([t.e2e_s for t in turns]), 4),
        "wall_s": round(wall_s, 2),
        "round_wall_s": [round(r["wall_s"], 2) for r in rounds],  # the spread over rounds
        "round_ttft_p50_s": [round(r["ttft_p50_s"], 4) for r in rounds],
        "requests": len(turns),
        "requests_per_s": round(len(turns) / wall_s, 3),
        "output_tokens_per_s": round(sum(len(t.output_ids) for t in turns) / wall_s, 2),
        "prompt_tokens": sum(int(t.meta_info.get("prompt_tokens", 0)) for t in turns),
        "cached_tokens": sum(int(t.meta_info.get("cached_tokens", 0)) for t in turns),
        "hit_tokens": hit_tokens(turns),
        **{k: round(sum(r.get(k, 0) for r in rounds), 3) for k in STAT_KEYS},
    }
    if all("cpu_s" in r for r in rounds):  # each service's CPU seconds, over the rounds
        services = rounds[0]["cpu_s"]
        out["cpu_s"] = {s: round(sum(r["cpu_s"][s] for r in rounds), 2) for s in services}
        # the worker's CPU does not depend on the machine's load the way wall time does
        out["round_worker_cpu_s"] = [round(r["cpu_s"]["model_svc"], 2) for r in rounds]
    return out


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) the process has used so far, from /proc (None elsewhere,
    or once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_memcpy(nbytes: int, repeats: int = 5) -> float:
    """Best-of GB/s of one numpy copy of ``nbytes`` (the CPU backend's copy ceiling)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _numbers(stats: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """``stats`` flattened to its numbers (``hit_tokens.host`` ...)."""
    out: dict[str, float] = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            out |= _numbers(value, f"{prefix}{key}.")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[prefix + key] = value
    return out


def copy_figures(
    before: dict[str, Any], after: dict[str, Any], bytes_per_token: int
) -> dict[str, Any]:
    """What the hierarchy did over a cell (every number of memsvc's ``hicache`` stats, as a
    difference, so counters memsvc adds show up too): per token that hit the host or disk
    tier the bytes moved, and how fast its loads and host writes went."""
    old, new = _numbers(before), _numbers(after)
    delta = {k: round(v - old.get(k, 0), 6) for k, v in new.items()}
    load_bytes = delta.get("load_bytes", 0)
    write_bytes = delta.get("backup_bytes", 0)
    lower = delta.get("hit_tokens.host", 0) + delta.get("hit_tokens.storage", 0)
    out: dict[str, Any] = {
        "write_policy": after.get("write_policy"),
        "counters": delta,
        "memsvc_hit_tokens": {t: int(delta.get(f"hit_tokens.{t}", 0)) for t in TIERS},
        # hits not loaded, by reason (under load_back_threshold, dearer than recomputing)
        "load_skip_tokens": {
            k.split(".", 1)[1]: int(v)
            for k, v in delta.items()
            if k.startswith("load_skip_tokens.")
        },
        "kv_bytes_per_token": bytes_per_token,
        "bytes_moved_per_lower_hit_token": round((load_bytes + write_bytes) / lower, 1)
        if lower
        else None,
    }
    for kind, prefix in (("load", "load"), ("write", "backup")):
        seconds = delta.get(f"{prefix}_seconds", 0.0)
        nbytes = delta.get(f"{prefix}_bytes", 0)
        out[f"{kind}_gb_per_s"] = round(nbytes / seconds / 1e9, 3) if seconds > 0 else None
    return out


def compare(a: list[list[list[int]]], b: list[list[list[int]]]) -> dict[str, Any]:
    """Replies that differ, and per chat the first turn that did (a later turn's prompt
    holds the earlier replies, so one differing token changes every turn after it)."""
    first = []
    for chat_a, chat_b in zip(a, b, strict=True):
        turn = next(
            (t for t, (x, y) in enumerate(zip(chat_a, chat_b, strict=True)) if x != y), None
        )
        if turn is not None:
            first.append(turn)
    replies = sum(x != y for ca, cb in zip(a, b, strict=True) for x, y in zip(ca, cb, strict=True))
    return {"replies_differing": replies, "chats_differing": len(first), "first_turns": first}


def machine() -> dict[str, Any]:
    """The CPU model (/proc/cpuinfo), the cores this process may use, the load average."""
    model = None
    with_cpuinfo = Path("/proc/cpuinfo")
    if with_cpuinfo.is_file():
        for line in with_cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count()
    return {"cpu": model, "cores": cores, "loadavg": list(os.getloadavg())}


def table(cells: list[dict[str, Any]]) -> str:
    """The matrix as a Markdown table (the docs' form of the JSON's cells)."""
    rows = [
        "| workload | working set / pool | TTFT p50 hierarchy / radix-only | `ttft_p50_speedup` "
        "| TTFT p99 speedup | `throughput_ratio` | hierarchy hits device / host / storage "
        "| radix-only hits | prefill computed hierarchy / radix-only | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        if "hicache" not in c or "radix" not in c:
            continue
        hi, radix = c["hicache"], c["radix"]
        hits = "/".join(str(hi["hit_tokens"][t]) for t in TIERS)
        ttft = f"{hi['ttft_p50_s']:.3f} s / {radix['ttft_p50_s']:.3f} s"
        rows.append(
            f"| {c['workload']} | {c['working_set_tokens']} / {c['device_pool_tokens']} "
            f"({c['working_set_over_pool']}) | {ttft} "
            f"| {c.get('ttft_p50_speedup')} | {c.get('ttft_p99_speedup')} "
            f"| {c.get('throughput_ratio')} | {hits} | {radix['hit_tokens']['device']} "
            f"| {hi['prefill_tokens']} / {radix['prefill_tokens']} | {c['outputs_identical']} |"
        )
    return "\n".join(rows)
