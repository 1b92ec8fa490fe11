"""The launcher sizes memsvc's layout from the checkpoint, not from the tiny model's geometry.

The reproducer: a checkpoint of another shape than the bundled tiny model (here
3 layers, 3 KV heads of 32, the ratios of SmolLM2) made every launcher start
memsvc with the tiny model's layout, and model_svc refused the pool.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstack.stack.model_pool import (
    PoolMismatchError,
    given_flags,
    pool_layout_args,
    worker_threads,
)
from kvstack.stack.spec import StackOptions, StackUnavailableError, build_process_list
from memsvc.client import MemClient
from model_svc.errors import CheckpointError
from model_svc.tiny import tiny_config, tiny_state_dict, write_checkpoint
from scheduler_svc.client import GenerateClient

POOL = ["--page-size", "4", "--num-pages", "128", "--max-context-len", "512"]
SIX_TOKENS = {"max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def other_shape(tmp_path_factory) -> Path:
    config = tiny_config(
        num_hidden_layers=3,
        hidden_size=288,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=32,
    )
    return write_checkpoint(tmp_path_factory.mktemp("shape"), config, tiny_state_dict(config))


def test_layout_args_are_the_checkpoints(other_shape):
    from kvstack.model.digest import model_digest

    path = other_shape
    assert pool_layout_args(path) == [
        "--num-layers",
        "3",
        "--num-kv-heads",
        "3",
        "--head-dim",
        "32",
        "--model-digest",  # the KV's model identity (issue 30)
        model_digest(path),
    ]
    # a flag that agrees is fine, in either spelling
    assert pool_layout_args(path, ["--num-layers=3", "--head-dim", "32"]) == pool_layout_args(path)


def test_a_contradicting_flag_names_both_values(other_shape):
    path = other_shape
    with pytest.raises(PoolMismatchError) as err:
        pool_layout_args(path, [*POOL, "--num-kv-heads", "2"])
    message = str(err.value)
    assert "--num-kv-heads 2" in message and "num_key_value_heads = 3" in message


def test_an_unreadable_checkpoint_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        pool_layout_args(tmp_path)


def test_given_flags_reads_both_spellings_last_wins():
    assert given_flags(["--a", "1", "--b=2", "--a", "3", "positional"]) == {
        "--a": "3",
        "--b": "2",
    }


def test_workers_split_the_usable_cores(monkeypatch):
    monkeypatch.setattr("kvstack.stack.model_pool.usable_cores", lambda: 16)
    assert [worker_threads(n) for n in (1, 2, 3, 32)] == [16, 8, 5, 1]


def test_the_stack_spec_derives_memsvc_layout_and_threads(tmp_path, other_shape, monkeypatch):
    path = other_shape
    monkeypatch.setattr("kvstack.stack.model_pool.usable_cores", lambda: 8)
    for mode, threads in (("normal", "8"), ("pd", "4")):
        specs = build_process_list(mode, tmp_path, StackOptions(checkpoint=str(path)))
        for spec in specs:
            flags = given_flags(spec.command)
            if spec.kind == "memsvc":
                assert (flags["--num-layers"], flags["--num-kv-heads"]) == ("3", "3"), spec.name
                assert flags["--head-dim"] == "32"
            if spec.kind == "model_svc":
                assert flags["--threads"] == threads, (mode, spec.name)


def test_normal_stack_serves_a_checkpoint_of_another_shape(launcher, other_shape):
    path = other_shape
    mem, _, sched = launcher.start_normal_stack(path, POOL)
    with GenerateClient(sched.address) as client:
        result = client.generate([1, 5, 9, 13], sampling=SIX_TOKENS)
    assert len(result.output_ids) == 6
    with MemClient(mem.address) as client:
        client.check(idle=True)


def test_pd_stack_serves_a_checkpoint_of_another_shape(launcher, other_shape):
    path = other_shape
    up = launcher.start_pd_stack(
        path, POOL, ["--num-reserved-decode-tokens", "8"], transfer_backend="zmq"
    )
    with GenerateClient(up["router"].address) as client:
        result = client.generate([1, 5, 9, 13], sampling=SIX_TOKENS)
    assert len(result.output_ids) == 6
    for name in ("memsvc-p", "memsvc-d"):
        with MemClient(up[name].address) as client:
            client.check(idle=True)


def test_a_contradicting_pool_flag_starts_nothing(launcher, other_shape):
    path = other_shape
    with pytest.raises(PoolMismatchError, match="--head-dim 64"):
        launcher.start_normal_stack(path, [*POOL, "--head-dim", "64"])
    assert launcher.services == []


def test_kvstack_up_says_why_a_checkpoint_does_not_fit(tmp_path, other_shape):
    """A clear StackUnavailableError (kvstack up prints it and exits 2), not a traceback."""
    bad = StackOptions(checkpoint=str(other_shape), memsvc_args=["--num-layers", "4"])
    with pytest.raises(StackUnavailableError, match="--num-layers 4 contradicts"):
        build_process_list("pd", tmp_path, bad)
    with pytest.raises(StackUnavailableError, match="no such file"):
        build_process_list("normal", tmp_path, StackOptions(checkpoint=str(tmp_path / "none")))
