"""Sliding-window models end to end, in normal mode: memsvc + model_svc + scheduler_svc as
real processes, started by the stack launcher from the checkpoint alone.

The launcher reads ``layer_types`` and ``sliding_window`` from the checkpoint's
config and gives memsvc its two pools (nothing passed by hand); greedy outputs
over contexts past 3 x W equal transformers' ``generate``, with no pressure and
with recompute retracts in a small pool; both pools check out idle at the end.
"""

from __future__ import annotations

import argparse
import asyncio

import pytest

from kvstack.stack.model_args import add_model_arguments, stack_model
from kvstack.stack.model_pool import PoolMismatchError, given_flags, pool_layout_args
from memsvc.client import MemClient
from scheduler_svc.client import AsyncGenerateClient, GenerateClient
from tests.model.swa_oracle import (
    FULL,
    HYBRID_LAYER_TYPES,
    KINDS,
    NUM_LAYERS,
    SLIDING,
    WINDOW,
    hf_greedy,
    prompt,
)
from tests.procs import start_stack

PAGE = ["--page-size", "4", "--dtype", "float32", "--max-context-len", "512"]
BIG_POOL = [*PAGE, "--num-pages", "1024", "--max-running-requests", "16"]
# 64 pages of every layer (256 tokens), as two pools in those bytes (hybrid: 304 full and
# 244 SWA tokens; pure: 320 and 256) hold about two of the six growing requests' contexts;
# a low conservativeness admits more, so decode retracts.
SMALL_POOL = [*PAGE, "--num-pages", "64", "--max-running-requests", "16"]
LAYER_TYPES = {"pure": [SLIDING] * NUM_LAYERS, "hybrid": HYBRID_LAYER_TYPES}


def requests(workload: str) -> list[tuple[str, list[int], int]]:
    """``(rid, prompt, max_new_tokens)``, six of them; every context ends past 4 x W.

    ``long``: prompts of 100-130 tokens, 40 new tokens each. ``growing``: prompts of
    40-60 tokens, 80 new tokens each: admission reserves a running request's output at
    its new-token ratio, so decode outgrows a small pool and retracts.
    """
    if workload == "long":
        return [(f"r{i}", prompt(100 + 6 * i, 100 + i), 40) for i in range(6)]
    return [(f"g{i}", prompt(40 + 4 * i, 200 + i), 80) for i in range(6)]


@pytest.fixture(scope="module")
def oracle(hf_swa_models) -> dict[str, dict[str, list[int]]]:
    """transformers' greedy continuation of every request of both workloads, per model."""
    return {
        kind: {
            rid: hf_greedy(hf_swa_models[kind], ids, new)
            for workload in ("long", "growing")
            for rid, ids, new in requests(workload)
        }
        for kind in KINDS
    }


def run_all(address: str, workload: str) -> dict:
    """Every request of ``workload`` at once (greedy; the model has no EOS token)."""

    async def go():
        async with AsyncGenerateClient(address, timeout_s=300) as client:
            return await asyncio.gather(
                *(
                    client.generate(ids, rid=rid, sampling={"max_new_tokens": new})
                    for rid, ids, new in requests(workload)
                )
            )

    return {r.rid: r for r in asyncio.run(go())}


def outputs(results: dict, want: dict[str, list[int]]) -> tuple[dict, dict]:
    return {rid: r.output_ids for rid, r in results.items()}, {rid: want[rid] for rid in results}


def test_the_launcher_gives_memsvc_the_checkpoints_windows(swa_checkpoints) -> None:
    for kind in KINDS:
        args = pool_layout_args(swa_checkpoints[kind])
        flags = given_flags(args)
        assert flags["--layer-types"] == ",".join(LAYER_TYPES[kind])
        assert flags["--sliding-window"] == str(WINDOW)
        # flags that agree are fine; every layer full is one pool (no --sliding-window)
        assert pool_layout_args(swa_checkpoints[kind], args) == args
        all_full = ["--layer-types", ",".join([FULL] * NUM_LAYERS)]
        assert "--layer-types" not in pool_layout_args(swa_checkpoints[kind], all_full)
        with pytest.raises(PoolMismatchError, match="sliding_window = 32"):
            pool_layout_args(swa_checkpoints[kind], ["--sliding-window", "16"])
        with pytest.raises(PoolMismatchError, match="layer_types"):
            other = [SLIDING] * (NUM_LAYERS - 1) + [FULL]
            pool_layout_args(swa_checkpoints[kind], ["--layer-types", ",".join(other)])
        with pytest.raises(PoolMismatchError, match="no SWA pool"):
            pool_layout_args(swa_checkpoints[kind], [*all_full, "--sliding-window", "32"])


def test_serve_flags_disable_hybrid_swa_memory(swa_checkpoints) -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, default_model=None)
    path = str(swa_checkpoints["hybrid"])
    model = stack_model(parser.parse_args(["--model-path", path]))
    assert "--layer-types" not in model.memsvc_args  # the launcher adds the checkpoint's
    model = stack_model(parser.parse_args(["--model-path", path, "--disable-hybrid-swa-memory"]))
    one_pool = given_flags(model.memsvc_args)["--layer-types"]
    assert one_pool == ",".join([FULL] * NUM_LAYERS)
    assert "--layer-types" not in pool_layout_args(path, model.memsvc_args)


def check_idle_pools(stack, hybrid: bool) -> None:
    with MemClient(stack.memsvc.address) as mem:
        mem.check(idle=True)  # both pools: available + evictable == capacity, no slot twice
        assert mem.layout.is_hybrid is hybrid


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_transformers_with_and_without_retract(
    launcher, swa_checkpoints, oracle, kind: str
) -> None:
    checkpoint = swa_checkpoints[kind]
    roomy = start_stack(launcher, checkpoint, BIG_POOL, name=f"-{kind}-big")
    with MemClient(roomy.memsvc.address) as mem:
        assert mem.layout.is_hybrid and mem.layout.sliding_window == WINDOW
        assert list(mem.layout.layer_types) == LAYER_TYPES[kind]
    for workload in ("long", "growing"):
        got = run_all(roomy.scheduler.address, workload)
        mine, want = outputs(got, oracle[kind])
        assert mine == want
        assert sum(r.meta_info["num_retractions"] for r in got.values()) == 0
    check_idle_pools(roomy, hybrid=True)

    small = start_stack(
        launcher,
        checkpoint,
        SMALL_POOL,
        ["--schedule-conservativeness", "0.3"],
        name=f"-{kind}-small",
    )
    got = run_all(small.scheduler.address, "growing")
    mine, want = outputs(got, oracle[kind])
    assert mine == want
    retractions = sum(r.meta_info["num_retractions"] for r in got.values())
    assert retractions > 0, "the small pool should have forced retracts"
    with GenerateClient(small.scheduler.address) as client:
        stats = client.info()["stats"]
    assert stats["retracted_reqs"] == retractions and stats["reprefilled_tokens"] > 0
    check_idle_pools(small, hybrid=True)


def test_one_pool_for_every_layer_gives_the_same_tokens(launcher, swa_checkpoints, oracle):
    """--disable-hybrid-swa-memory's pool flags: one pool, the worker still windowing."""
    all_full = ["--layer-types", ",".join([FULL] * NUM_LAYERS)]
    stack = start_stack(launcher, swa_checkpoints["hybrid"], [*SMALL_POOL, *all_full],
                        ["--schedule-conservativeness", "0.3"], name="-one-pool")  # fmt: skip
    got = run_all(stack.scheduler.address, "growing")
    mine, want = outputs(got, oracle["hybrid"])
    assert mine == want
    check_idle_pools(stack, hybrid=False)


def test_kvstack_up_gives_every_memsvc_the_checkpoints_windows(swa_checkpoints, tmp_path) -> None:
    """``kvstack up``'s process list (normal and PD): each memsvc gets the layout flags."""
    from kvstack.stack.spec import StackOptions, build_process_list

    path = str(swa_checkpoints["hybrid"])
    for mode in ("normal", "pd"):
        specs = build_process_list(mode, tmp_path, StackOptions(checkpoint=path))
        mems = [s for s in specs if s.kind == "memsvc"]
        assert len(mems) == (1 if mode == "normal" else 2)
        for spec in mems:
            flags = given_flags(list(spec.command))
            assert flags["--layer-types"] == ",".join(HYBRID_LAYER_TYPES)
            assert flags["--sliding-window"] == str(WINDOW)
