"""``kvstack sim``: run a workload through the real scheduler and memsvc against a simulated worker.

Examples::

    kvstack sim --requests 500 --pool-tokens 60000 --output-len uniform:64:512
    kvstack sim --requests 300 --pool-tokens 20000 --max-new-factor 4 \\
        --sweep schedule_conservativeness=0.3,1.0,2.0 --plots out/ --json
    kvstack sim --trace trace.jsonl --sweep retract_mode=recompute,offload,auto
    kvstack sim --trace trace.jsonl --sweep retraction_policy=length,cost
    kvstack sim --requests 200 --input-len uniform:1024:4096 --sliding-window 512 \
        --sweep swa_full_tokens_ratio=0.2,0.8
    kvstack sim --skew --requests 2000 --pool-tokens 100000 \
        --set num_reserved_decode_tokens=16

``--skew``: two PD decode nodes of ``--pool-tokens`` each (kvstack.sim.pair),
every request to the first; each configuration runs twice, the hot node keeping
its retracted requests (``migrate=off``) and moving them to the cold one
(``migrate=on``).

Prints a table (one row per configuration; several with ``--sweep``), and with
``--json`` one JSON object on the last line. Exit status 2 on a bad setting.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.table import Table

from kvstack.sim import pair, runner
from kvstack.sim.costmodel import CostModel
from kvstack.sim.runner import SimResult
from kvstack.sim.settings import (
    SimSpec,
    apply_setting,
    expand_sweeps,
    label,
    parse_assignment,
    parse_sweep,
)
from kvstack.sim.workload import RequestSpec, load_trace, synthetic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    work = parser.add_argument_group("workload")
    work.add_argument("--requests", type=int, default=500, help="synthetic: number of requests")
    work.add_argument(
        "--rate", type=float, default=None, help="synthetic: Poisson arrivals/s; none: all at t=0"
    )
    work.add_argument("--input-len", default="uniform:128:1024", help="prompt length distribution")
    work.add_argument("--output-len", default="uniform:32:512", help="output length distribution")
    work.add_argument(
        "--max-new-factor",
        type=float,
        default=1.0,
        help="max_new_tokens = output_len x this (> 1: requests stop early on EOS)",
    )
    work.add_argument("--trace", help="JSONL trace of {arrival, input_len, output_len} instead")
    work.add_argument("--seed", type=int, default=0, help="workload and prompt seed")
    pool = parser.add_argument_group("pool")
    pool.add_argument("--pool-tokens", type=int, default=200_000)
    pool.add_argument("--page-size", type=int, default=16)
    pool.add_argument("--max-running-requests", type=int, default=256)
    pool.add_argument(
        "--host-store-tokens", type=int, help="host store size for offload; none: the pool's"
    )
    pool.add_argument(
        "--sliding-window",
        type=int,
        default=0,
        help="a hybrid model: W tokens of window on --swa-layers of its --num-layers layers, "
        "and two pools (full and SWA) in the bytes of --pool-tokens tokens of every layer "
        "(0: every layer full, one pool)",
    )
    pool.add_argument(
        "--swa-layers", type=int, default=5, help="hybrid: windowed layers (default 5)"
    )
    pool.add_argument("--num-layers", type=int, default=6, help="hybrid: layers in all (default 6)")
    pool.add_argument(
        "--swa-full-tokens-ratio",
        type=float,
        default=0.8,
        help="hybrid: SWA pool tokens per full pool token, per layer (SGLang's flag)",
    )
    cost = parser.add_argument_group("cost model (defaults: this CPU, the tiny model)")
    cost.add_argument("--cost", metavar="FILE", help="JSON object of CostModel fields")
    cost.add_argument("--prefill-tok-per-s", type=float)
    cost.add_argument("--decode-ms", metavar="B:MS,...", help="decode step time by batch size")
    cost.add_argument("--copy-gbps", type=float, help="offload/load bandwidth, GB/s")
    cost.add_argument("--bytes-per-token", type=int, help="KV bytes per token (offload/load)")
    runs = parser.add_argument_group("configurations")
    runs.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a SchedulerConfig, pool or cost field (repeatable)",
    )
    runs.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="run every value (repeatable: the cartesian product)",
    )
    runs.add_argument(
        "--skew",
        action="store_true",
        help="two PD decode nodes, every request to the first (hot) one: each configuration "
        "without and with the hot node moving its retracted requests to the cold one "
        "(issue 32's skewed load); the prefill node is a FIFO server at --prefill-tok-per-s",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--plots", metavar="DIR", help="write PNG plots here")
    out.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    out.add_argument(
        "--check", action="store_true", help="verify KV slots and every output (exit 1 if wrong)"
    )
    out.add_argument("--verbose", action="store_true", help="show the engine's retract warnings")


def run(args: argparse.Namespace) -> int:
    try:
        workload = _workload(args)
        runs = expand_sweeps(_base_spec(args), [parse_sweep(s) for s in args.sweep])
    except (ValueError, OSError) as exc:
        print(f"kvstack sim: {exc}", file=sys.stderr)
        return 2
    with _engine_logs(verbose=args.verbose):
        try:
            results = _run_all(args, runs, workload)
        except ValueError as exc:
            print(f"kvstack sim: {exc}", file=sys.stderr)
            return 2
    widest = max(len(label(r.settings)) for r in results)
    console = Console(width=max(Console().width, 120 + widest))
    console.print(_describe(args, workload))
    console.print(results_table(results, SKEW_COLUMNS if args.skew else []))
    if args.plots:
        from kvstack.sim.plots import write_plots  # matplotlib only when asked

        for path in write_plots(results, args.plots):
            console.print(f"wrote {path}")
    wrong = sum(r.totals["wrong_outputs"] or 0 for r in results)
    if wrong:
        console.print(f"[red]--check: {wrong} requests did not get their expected tokens[/red]")
    if args.json:
        print(json.dumps(_json_report(args, workload, runs[0][1], results)))
    return 1 if wrong else 0


def _run_all(
    args: argparse.Namespace, runs: list[tuple[dict[str, str], SimSpec]], workload: list
) -> list[SimResult]:
    if not args.skew:
        return [runner.run(spec, workload, settings=s, seed=args.seed) for s, spec in runs]
    return [
        pair.run(spec, workload, migrate=migrate, settings=s, seed=args.seed)
        for s, spec in runs
        for migrate in (False, True)
    ]


@contextlib.contextmanager
def _engine_logs(*, verbose: bool) -> Iterator[None]:
    """The engine warns on every retract; a simulation of thousands would drown the table."""
    logger = logging.getLogger("scheduler_svc")
    level = logger.level
    if not verbose:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _workload(args: argparse.Namespace) -> list[RequestSpec]:
    if args.trace:
        return load_trace(args.trace)
    return synthetic(
        args.requests,
        input_len=args.input_len,
        output_len=args.output_len,
        rate=args.rate,
        max_new_factor=args.max_new_factor,
        seed=args.seed,
    )


def _base_spec(args: argparse.Namespace) -> SimSpec:
    cost = CostModel.from_json(args.cost) if args.cost else CostModel()
    flags: dict[str, Any] = {
        "prefill_tok_per_s": args.prefill_tok_per_s,
        "decode_points": args.decode_ms,
        "copy_bytes_per_s": None if args.copy_gbps is None else args.copy_gbps * 1e9,
        "bytes_per_token": args.bytes_per_token,
    }
    cost = cost.with_values({k: v for k, v in flags.items() if v is not None})
    spec = SimSpec(
        pool_tokens=args.pool_tokens,
        page_size=args.page_size,
        max_running_requests=args.max_running_requests,
        host_store_tokens=args.host_store_tokens,
        sliding_window=args.sliding_window,
        swa_layers=args.swa_layers,
        num_layers=args.num_layers,
        swa_full_tokens_ratio=args.swa_full_tokens_ratio,
        cost=cost,
        check_tokens=args.check,
    )
    for text in args.set:
        spec = apply_setting(spec, *parse_assignment(text))
    spec.scheduler_config()  # validate before running anything
    return spec


def _describe(args: argparse.Namespace, workload: list[RequestSpec]) -> str:
    source = f"trace {args.trace}" if args.trace else f"synthetic (seed {args.seed})"
    inputs = sum(r.input_len for r in workload)
    outputs = sum(r.output_len for r in workload)
    hybrid = ""
    if args.sliding_window:
        hybrid = (
            f" (hybrid: window {args.sliding_window} on {args.swa_layers} of {args.num_layers} "
            f"layers, full and SWA pools in its bytes, ratio {args.swa_full_tokens_ratio})"
        )
    return (
        f"{len(workload)} requests from {source}: {inputs} prompt tokens, {outputs} output "
        f"tokens; pool {args.pool_tokens} tokens{hybrid}, page {args.page_size}"
    )


COLUMNS: list[tuple[str, str]] = [
    ("throughput_tok_s", "tok/s"),
    ("p50_latency_s", "p50 lat s"),
    ("p99_latency_s", "p99 lat s"),
    ("retractions", "retracts"),
    ("max_retractions_per_request", "max/req"),
    ("reprefilled_tokens", "re-prefilled"),
    ("copy_s", "copy s"),
    ("peak_running", "peak run"),
    ("peak_context", "peak ctx"),
    ("peak_used", "full peak"),
    ("peak_swa_used", "SWA peak"),
    ("aborted", "aborts"),
    ("sim_s", "sim s"),
]


# --skew adds: the TTFT tail and the hot node's moves
SKEW_COLUMNS: list[tuple[str, str]] = [("p99_ttft_s", "p99 TTFT s"), ("migrated_reqs", "moved")]


def results_table(results: list[SimResult], extra: list[tuple[str, str]] = ()) -> Table:
    columns = [*COLUMNS, *extra]
    table = Table(title="kvstack sim (simulated time)")
    table.add_column("configuration", no_wrap=True)
    for _, title in columns:
        table.add_column(title, justify="right")
    table.add_column("wall s", justify="right")
    for result in results:
        cells = [_cell(result.totals.get(key)) for key, _ in columns]
        table.add_row(label(result.settings), *cells, f"{result.wall_s:.2f}")
    return table


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _json_report(
    args: argparse.Namespace,
    workload: list[RequestSpec],
    spec: SimSpec,
    results: list[SimResult],
) -> dict[str, Any]:
    return {
        "workload": {
            "requests": len(workload),
            "trace": args.trace,
            "seed": args.seed,
            "input_tokens": sum(r.input_len for r in workload),
            "output_tokens": sum(r.output_len for r in workload),
        },
        "pool_tokens": args.pool_tokens,
        "page_size": args.page_size,
        "hybrid": {
            "sliding_window": args.sliding_window,
            "swa_layers": args.swa_layers,
            "num_layers": args.num_layers,
            "swa_full_tokens_ratio": args.swa_full_tokens_ratio,
        }
        if args.sliding_window
        else None,
        "cost": spec.cost.as_dict(),
        "results": [r.summary() for r in results],
        **({"skew": _skew_speedups(results)} if args.skew else {}),
    }


def _skew_speedups(results: list[SimResult]) -> list[dict[str, Any]]:
    """Per configuration: migrate=off's latency over migrate=on's (above 1: moving helps)."""
    out = []
    for static, moved in zip(results[::2], results[1::2], strict=True):
        settings = {k: v for k, v in static.settings.items() if k != "migrate"}
        row: dict[str, Any] = {"settings": settings}
        for key in ("p50_latency_s", "p99_latency_s", "p50_ttft_s", "p99_ttft_s"):
            a, b = static.totals.get(key), moved.totals.get(key)
            row[f"{key[:-2]}_speedup"] = round(a / b, 3) if a and b else None
        row["retractions"] = [static.totals["retractions"], moved.totals["retractions"]]
        row["migrated_reqs"] = moved.totals["migrated_reqs"]
        out.append(row)
    return out
