"""The demo's report: the table of each run, its aborts, the answers under pressure,
whether the outputs are token-identical to the reference, and each run's retract cost."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvstack.demo.runs import RunResult, measure_copy_bytes_per_s
from kvstack.demo.workload import Workload


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def summarize(result: RunResult) -> dict[str, Any]:
    """The numbers the table shows (and the plots use) for one run."""
    stats, bpt = result.stats, result.bytes_per_token
    generated = sum(len(ids) for ids in result.outputs.values())
    return {
        "requests": len(result.outputs),
        "generated": generated,
        "retract_events": stats["retract_events"],
        "retracted_reqs": stats["retracted_reqs"],
        "reprefilled": stats["reprefilled_tokens"],
        "offloaded_bytes": stats["offloaded_tokens"] * bpt,
        "loaded_bytes": stats["loaded_tokens"] * bpt,
        "aborts": len(result.aborts),
        "tokens_per_s": generated / max(result.seconds, 1e-9),
        "p50": percentile(result.latencies, 0.50),
        "p99": percentile(result.latencies, 0.99),
        "seconds": result.seconds,
        "capacity": result.capacity,
        "peak_used": max((x.used for x in result.samples), default=0),
        "swa_capacity": result.swa_capacity,
        "peak_swa_used": max((x.swa_used or 0 for x in result.samples), default=0)
        if result.swa_capacity is not None
        else None,
    }


TABLE_ROWS = [
    ("requests", "requests", "{:d}"),
    ("tokens generated", "generated", "{:d}"),
    ("retractions (events)", "retract_events", "{:d}"),
    ("retracted requests", "retracted_reqs", "{:d}"),
    ("tokens re-prefilled", "reprefilled", "{:d}"),
    ("bytes offloaded", "offloaded_bytes", "{:,d}"),
    ("bytes loaded", "loaded_bytes", "{:,d}"),
    ("aborts", "aborts", "{:d}"),
    ("tokens/s", "tokens_per_s", "{:.1f}"),
    ("p50 latency (s)", "p50", "{:.2f}"),
    ("p99 latency (s)", "p99", "{:.2f}"),
    ("wall time (s)", "seconds", "{:.1f}"),
    ("KV pool tokens", "capacity", "{:,d}"),
    ("peak KV tokens held", "peak_used", "{:,d}"),
]
# Shown when a run's model is hybrid (sliding-window layers): its second pool.
SWA_ROWS = [
    ("SWA pool tokens", "swa_capacity", "{:,d}"),
    ("peak SWA tokens held", "peak_swa_used", "{:,d}"),
]


def render_table(summaries: dict[str, dict[str, Any]]) -> Table:
    """One column per mode, one row per measure."""
    table = Table(title="kvstack demo: retract under KV-memory pressure")
    table.add_column("measure")
    for mode in summaries:
        table.add_column(mode, justify="right")
    rows = TABLE_ROWS
    if any(s.get("swa_capacity") is not None for s in summaries.values()):
        rows = [*TABLE_ROWS, *SWA_ROWS]
    for label, key, fmt in rows:
        table.add_row(
            label,
            *("-" if s.get(key) is None else fmt.format(s[key]) for s in summaries.values()),
        )
    return table


def abort_lines(runs: dict[str, RunResult]) -> list[str]:
    """One line per aborted request: the run, the rid, the message and the status code."""
    return [
        f"{name}: {rid} aborted: {reason.get('message') or '(no message)'} "
        f"(status {reason.get('status_code', '?')})"
        for name, run in runs.items()
        for rid, reason in sorted(run.aborts.items())
    ]


def check_identical(
    reference: dict[str, list[int]], runs: dict[str, dict[str, list[int]]]
) -> tuple[int, str]:
    """(0, a line saying so) if every run's outputs equal ``reference``; else (1, what differs)."""
    problems = []
    for name, outputs in runs.items():
        differing = sorted(rid for rid in reference if outputs.get(rid) != reference[rid])
        extra = sorted(set(outputs) - set(reference))
        if differing or extra:
            problems.append(
                f"{name}: {len(differing) + len(extra)} differ {(differing + extra)[:8]}"
            )
    if problems:
        return 1, "FAIL: outputs differ from the no-pressure reference: " + "; ".join(problems)
    modes = " and ".join(runs)
    return 0, (
        f"all {len(reference)} outputs of {modes} are token-identical to the no-pressure reference"
    )


def retract_cost(runs: dict[str, RunResult], reference: RunResult) -> dict[str, dict[str, float]]:
    """Per pressure run: tokens of retract work, bytes moved and estimated seconds."""
    copy_rate = measure_copy_bytes_per_s()
    cost = {}
    for name, run in runs.items():
        s = summarize(run)
        moved = s["offloaded_bytes"] + s["loaded_bytes"]
        cost[name] = {
            "reprefilled_tokens": s["reprefilled"],
            "moved_bytes": moved,
            "seconds": s["reprefilled"] / max(reference.prefill_tokens_per_s, 1e-9)
            + moved / copy_rate,
        }
    return cost


def render_answers(
    work: Workload,
    runs: dict[str, RunResult],
    reference: RunResult,
    tokenizer: Any,
    count: int,
) -> Group:
    """Questions and the answers given under pressure, the most retracted first; each
    says how often it was retracted in each mode and whether it equals the reference."""
    retracted = {
        rid: sum(r.retractions.get(rid, 0) for r in runs.values()) for rid in work.questions
    }
    shown = sorted(work.questions, key=lambda rid: (-retracted[rid], rid))[:count]
    lines: list[Text] = [Text("answers under retract pressure", style="bold")]
    for rid in shown:
        marks = []
        for mode, run in runs.items():
            same = run.outputs.get(rid) == reference.outputs[rid]
            marks.append(
                f"{mode} {run.retractions.get(rid, 0)}x {'identical' if same else 'DIFFERS'}"
            )
        cut = reference.finish_reasons.get(rid, {}).get("type") == "length"
        answer = tokenizer.decode(reference.outputs[rid]).strip() + (" ..." if cut else "")
        lines.append(
            Text.assemble(
                ("Q: ", "bold"), work.questions[rid], (f"  [retracted: {', '.join(marks)}]", "dim")
            )
        )
        lines.append(Text.assemble(("A: ", "bold"), answer))
    return Group(*lines)
