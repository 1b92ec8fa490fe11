"""``python -m tests.faults.soak --scenarios N --seed S [--mode pd]``: many seeded fault scenarios.

One supervised stack (normal mode, or with ``--mode pd`` the PD stack: both
nodes and the router), N scenarios of random kinds (see :mod:`tests.faults.harness`),
one line per scenario, and on the last line one JSON object: scenarios run,
faults injected by kind, requests accepted, completed identical, ended with
an error, mismatched and lost (both must be 0), pages leaked and host-store
bytes left (both must be 0), and the problems found. Exits non-zero if any
check failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time

from tests.faults.harness import (
    KINDS,
    PD_KINDS,
    STORAGE_KIND,
    FaultHarness,
    Totals,
    temp_workdir,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.soak", description=__doc__)
    parser.add_argument("--scenarios", type=int, default=10, help="how many scenarios to run")
    parser.add_argument("--seed", type=int, default=0, help="seeds the workload and the faults")
    parser.add_argument(
        "--mode", choices=["normal", "pd"], default="normal", help="which stack to run"
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=sorted({*KINDS, *PD_KINDS, STORAGE_KIND}),
        default=None,
        help="draw only these scenario kinds (of the mode's)",
    )
    parser.add_argument(
        "--storage",
        action="store_true",
        help="every memsvc with the hierarchical cache and a file storage tier, all on one "
        f"directory, and the {STORAGE_KIND} kind",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    args = parser.parse_args(argv)
    allowed = (*(PD_KINDS if args.mode == "pd" else KINDS), *([STORAGE_KIND] * args.storage))
    if args.kinds and not set(args.kinds) <= set(allowed):
        parser.error(f"--mode {args.mode} has the kinds {', '.join(allowed)}")
    workdir = temp_workdir()
    totals = Totals()
    started = time.monotonic()
    try:
        with FaultHarness(workdir, args.seed, mode=args.mode, storage=args.storage) as harness:
            for index in range(args.scenarios):
                kind = harness.rng.choice(args.kinds) if args.kinds else None
                result = harness.run(harness.scenario(index, kind))
                totals.add(result)
                problems = f"; PROBLEMS {result.problems}" if result.problems else ""
                print(
                    f"{result.scenario.label}: {result.count('identical')} identical, "
                    f"{result.count('error')} errors, {result.count('mismatch')} mismatched, "
                    f"{result.count('lost')} lost, faults {dict(result.faults)}, "
                    f"{result.seconds:.1f}s{problems}",
                    flush=True,
                )
                for outcome in result.outcomes:
                    if outcome.status != "identical":
                        print(f"  {outcome.job}: {outcome.status}: {outcome.detail}", flush=True)
        totals.problems += harness.leftovers
    finally:
        if args.keep:
            print(f"work folder: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    seconds = round(time.monotonic() - started, 1)
    summary = {
        "mode": args.mode,
        "storage": args.storage,
        "seed": args.seed,
        **totals.as_dict(),
        "seconds": seconds,
    }
    print(json.dumps(summary), flush=True)
    bad = totals.lost or totals.mismatched or totals.pages_leaked or totals.host_bytes_left
    return 1 if bad or totals.problems else 0


if __name__ == "__main__":
    sys.exit(main())
