"""model_svc as a real process, next to a real memsvc: tokens, bad input, re-runs, layout."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstack.stack.launch import Launcher
from kvstack.stack.model_pool import pool_layout_args
from memsvc.client import MemClient
from model_svc.client import ForwardError, ModelClient
from model_svc.model import LlamaModel
from model_svc.reference import generate_dense
from tests.procs import REPO, SMALL_POOL

POOL_SIZE = [
    "--page-size",
    "4",
    "--num-pages",
    "128",
    "--max-running-requests",
    "8",
    "--max-context-len",
    "512",
]


@contextlib.contextmanager
def model_stack(checkpoint: Path, workdir: Path) -> Iterator[tuple]:
    """memsvc and model_svc on ``checkpoint``: (memsvc, model_svc's address, its ready info)."""
    with Launcher(workdir) as launcher:
        svc = launcher.start("memsvc", *SMALL_POOL, *pool_layout_args(checkpoint), *POOL_SIZE)
        model = launcher.start(
            "model_svc", "--memsvc", svc.address, "--checkpoint", str(checkpoint), "--threads", "1"
        )
        yield svc, model.address, model.info
    assert not launcher.leaked_segments


@pytest.fixture(scope="module")
def stack(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """One memsvc and model_svc for the tests below, which each leave the pool idle."""
    with model_stack(checkpoint, tmp_path_factory.mktemp("stack")) as running:
        yield running


def generate(
    mem: MemClient, model: ModelClient, rid: str, prompt: list[int], steps: int, pool_epoch: str
) -> list[int]:
    """What a scheduler does for one request: row, prefix, extend, then decode steps."""
    row = mem.alloc_row(rid)
    prefix = mem.match_prefix(rid, prompt[:-1])
    assert mem.alloc_extend([(rid, len(prompt) - prefix)]).fits
    out = model.extend([(row, prefix, prompt[prefix:])], pool_epoch=pool_epoch)
    tokens = [int(out.next_token_ids[0])]
    while len(tokens) < steps:
        assert mem.decode_step([row]).fits
        seq_len = len(prompt) + len(tokens)
        out = model.decode([row], [seq_len], [tokens[-1]], pool_epoch=pool_epoch)
        tokens.append(int(out.next_token_ids[0]))
    mem.release(rid, prompt + tokens[:-1], is_insert=True)
    return tokens


def test_greedy_tokens_match_the_dense_reference(stack, checkpoint) -> None:
    svc, address, info = stack
    reference = LlamaModel.from_checkpoint(checkpoint)
    prompts = [list(b"Hello, kvstack!"), list(b"Hello, world and more"), [256, 7, 7, 7, 1]]
    with MemClient(svc.address) as mem, ModelClient(address) as model:
        assert model.info()["pool_epoch"] == mem.epoch == info["pool_epoch"]
        for i, prompt in enumerate(prompts):
            got = generate(mem, model, f"r{i}", prompt, 12, mem.epoch)
            assert got == generate_dense(reference, prompt, 12), prompt
        # the second prompt reused the first's cached "Hello, " prefix pages
        assert mem.stats()["counters"]["op.match_prefix.ok"] == 3
        mem.check(idle=True)


def test_bad_batches_are_refused_and_write_nothing(stack) -> None:
    svc, address, _ = stack
    with MemClient(svc.address) as mem, ModelClient(address) as model, mem.attach() as pool:
        row = mem.alloc_row("a")
        mem.alloc_extend([("a", 6)])
        before = pool.kv.copy()
        bad = [
            lambda: model.extend([(row, 0, list(range(7)))]),  # position 6 has no slot
            lambda: model.extend([(99, 0, [1])]),  # row out of range
            lambda: model.extend([(row + 1, 0, [1])]),  # a row nobody opened
            lambda: model.extend([(row, 0, [1, 2]), (row, 2, [3])]),  # the same row twice
            lambda: model.decode([row], [7], [1]),  # decode past the allocated slots
            lambda: model.decode([row, row], [3], [1]),  # lengths disagree
            lambda: model.extend([(row, 0, [1])], pool_epoch="f" * 16),  # another memsvc
        ]
        for call in bad:
            with pytest.raises(ForwardError) as info:
                call()
            assert info.value.code in ("invalid_batch", "stale_pool"), info.value
        assert np.array_equal(pool.kv, before)
        mem.free_row("a")
        mem.check(idle=True)


def test_rerunning_a_forward_pass_gives_same_tokens_and_bytes(stack) -> None:
    svc, address, _ = stack
    with MemClient(svc.address) as mem, ModelClient(address) as model, mem.attach() as pool:
        row = mem.alloc_row("a")
        mem.alloc_extend([("a", 9)])
        first = model.extend([(row, 0, list(range(10, 19)))])
        snapshot = pool.kv.copy()
        again = model.extend([(row, 0, list(range(10, 19)))])
        assert first.next_token_ids.tolist() == again.next_token_ids.tolist()
        assert np.array_equal(pool.kv, snapshot)
        sampled = [
            model.extend(
                [(row, 0, list(range(10, 19)))],
                sampling=[{"temperature": 1.0, "seed": 5, "logprobs": True}],
            )
            for _ in range(2)
        ]
        assert sampled[0].next_token_ids.tolist() == sampled[1].next_token_ids.tolist()
        assert sampled[0].logprobs[0] is not None and sampled[0].logprobs[0] <= 0
        mem.free_row("a")
        mem.check(idle=True)


def test_layout_mismatch_is_a_clear_error(tmp_path, memsvc_factory, checkpoint) -> None:
    wrong = [*pool_layout_args(checkpoint), *POOL_SIZE]
    wrong[wrong.index("--head-dim") + 1] = "32"
    svc = memsvc_factory(*wrong)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "model_svc",
            "--memsvc",
            svc.address,
            "--listen",
            f"ipc://{tmp_path}/m.sock",
            "--checkpoint",
            str(checkpoint),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert out.returncode == 2, out.stderr
    assert "head" in out.stderr.lower()
