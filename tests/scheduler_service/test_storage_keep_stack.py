"""A kept storage tier across whole-stack restarts (issue 30, item 2), as processes.

Ten prompts push their oldest KV down to a kept disk tier; the stack stops (memsvc
keeps the pages) and starts again on the same directory: the first prompt's KV
comes back from storage, with the first run's tokens. Restarted instead on another
checkpoint, another KV dtype or another page size, the same prompt gets 0 storage
hits: the launcher passes each checkpoint's model digest, and memsvc's page keys
name it with the dtype, the layout and the page size.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from model_svc.tiny import write_tiny_checkpoint
from scheduler_svc.client import GenerateResult
from tests.procs import Stack, start_stack
from tests.scheduler_service.test_hicache_stack import (
    POOL,
    STORAGE,
    assert_idle,
    generate_all,
    mem_stats,
    page_files,
    storage_prompts,
)

pytestmark = pytest.mark.timeout(600)


def stop(stack: Stack) -> None:
    for service in (stack.scheduler, stack.model, stack.memsvc):
        assert service.stop() == 0, service.name


def storage_hits(result: GenerateResult) -> int:
    return (result.meta_info.get("cached_tokens_details") or {}).get("storage", 0)


def test_a_kept_tier_serves_the_same_identity_alone_after_a_restart(
    launcher, checkpoint, tmp_path
) -> None:
    disk = tmp_path / "disk"
    keep = [*POOL, *STORAGE, "--hicache-storage-keep", "--hicache-storage-dir", str(disk)]
    prompts = storage_prompts(30)[:-1]
    stack = start_stack(launcher, checkpoint, keep, name="-1")
    first = generate_all(stack.scheduler.address, prompts, "p")
    assert_idle(stack)
    stop(stack)
    kept = page_files(disk)
    assert kept and {p.parent.name for p in kept} == {"kept-normal"}

    stack = start_stack(launcher, checkpoint, keep, name="-2")
    (again,) = generate_all(stack.scheduler.address, prompts[:1], "again")
    assert again.output_ids == first[0].output_ids
    assert storage_hits(again) > 0, again.meta_info
    assert mem_stats(stack)["hicache"]["hit_tokens"]["storage"] == storage_hits(again)
    assert_idle(stack)
    stop(stack)

    other_ckpt = write_tiny_checkpoint(tmp_path / "other", seed=12345)
    half = ["--dtype", "float16"]  # the worker computes in the pool's dtype
    for name, ckpt, flags, model in (
        ("ckpt", other_ckpt, [], []),
        ("dtype", checkpoint, half, half),
        ("page", checkpoint, ["--page-size", "8"], []),
    ):
        stack = Stack(
            *launcher.start_normal_stack(
                Path(ckpt), [*keep, *flags], model=model, suffix=f"-{name}"
            )
        )
        (result,) = generate_all(stack.scheduler.address, prompts[:1], name)
        assert storage_hits(result) == 0, (name, result.meta_info)
        hicache = mem_stats(stack)["hicache"]
        assert hicache["hit_tokens"]["storage"] == 0 and hicache["storage_read_bytes"] == 0
        assert_idle(stack)
        stop(stack)
