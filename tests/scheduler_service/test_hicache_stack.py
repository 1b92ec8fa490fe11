"""The hierarchical prefix cache end to end: memsvc + model_svc + scheduler_svc as processes.

A multi-turn chat workload (a shared system prompt, each turn the whole
history so far plus a new user message) over a device pool a few times
smaller than its working set: radix-only evicts histories between turns and
recomputes them; the hierarchy keeps them in host memory (and on disk) and
loads them back. Judged by tokens (greedy outputs equal radix-only's), by
where the hits came from (``meta_info.cached_tokens_details``, memsvc's
``hicache`` stats) and by the pool's integrity check at the end.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstack.stack.launch import Launcher
from memsvc.client import MemClient
from scheduler_svc.client import AsyncGenerateClient, GenerateClient, GenerateResult
from tests.procs import SMALL_POOL, Stack, start_stack

PAGE_SIZE = 4
# 36 pages = 144 tokens: one chat's longest turn, under a quarter of the working set.
NUM_PAGES = 36
POOL = [
    "--page-size", str(PAGE_SIZE), "--dtype", "float32", "--max-context-len", "512",
    "--num-pages", str(NUM_PAGES), "--max-running-requests", "16",
]  # fmt: skip
BIG_POOL = [*POOL[:-4], "--num-pages", "256", "--max-running-requests", "16"]
HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", "8"]
NUM_CHATS, NUM_TURNS, SYSTEM_LEN, USER_LEN, OUTPUT_LEN = 6, 4, 40, 20, 4
GREEDY = {"max_new_tokens": OUTPUT_LEN, "ignore_eos": True, "temperature": 0.0}


def chats(seed: int) -> tuple[list[int], list[list[list[int]]]]:
    """A system prompt and, per chat, its users' turns (byte tokens of the tiny model)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 256) for _ in range(SYSTEM_LEN)]
    users = [
        [[rng.randrange(3, 256) for _ in range(USER_LEN)] for _ in range(NUM_TURNS)]
        for _ in range(NUM_CHATS)
    ]
    return system, users


def working_set_tokens() -> int:
    return SYSTEM_LEN + NUM_CHATS * NUM_TURNS * (USER_LEN + OUTPUT_LEN)


def run_chats(address: str, seed: int = 0) -> dict[str, GenerateResult]:
    """Every chat at once, each turn after the last one's reply; results by rid."""
    system, users = chats(seed)

    async def chat(client: AsyncGenerateClient, index: int) -> list[GenerateResult]:
        history, results = list(system), []
        for turn, user in enumerate(users[index]):
            prompt = history + user
            result = await client.generate(prompt, rid=f"c{index}-t{turn}", sampling=GREEDY)
            assert result.finish_reason.get("type") == "length", result.meta_info
            history = prompt + result.output_ids
            results.append(result)
        return results

    async def go() -> dict[str, GenerateResult]:
        async with AsyncGenerateClient(address, timeout_s=120) as client:
            done = await asyncio.gather(*(chat(client, i) for i in range(NUM_CHATS)))
        return {r.rid: r for results in done for r in results}

    return asyncio.run(go())


def outputs(results: dict[str, GenerateResult]) -> dict[str, list[int]]:
    return {rid: r.output_ids for rid, r in results.items()}


def tier_hits(results: dict[str, GenerateResult]) -> dict[str, int]:
    """Σ of ``cached_tokens_details`` over the replies, per tier."""
    total: dict[str, int] = {}
    for r in results.values():
        for tier, count in (r.meta_info.get("cached_tokens_details") or {}).items():
            if isinstance(count, int):
                total[tier] = total.get(tier, 0) + count
    return total


def mem_stats(stack: Stack) -> dict:
    with MemClient(stack.memsvc.address) as mem:
        return mem.stats()


def sched_stats(stack: Stack) -> dict:
    with GenerateClient(stack.scheduler.address) as client:
        return client.info()["stats"]


def assert_idle(stack: Stack) -> None:
    with MemClient(stack.memsvc.address) as mem:
        mem.check(idle=True)


@pytest.fixture(scope="module")
def radix_stack(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack on the same small pool, radix cache only (today's kvstack), for the module."""
    with Launcher(tmp_path_factory.mktemp("radix")) as up:
        yield Stack(*up.start_normal_stack(checkpoint, POOL))
    assert not up.leaked_segments


@pytest.fixture(scope="module")
def radix_only(radix_stack: Stack) -> dict:
    """The chat workload's results on the radix-only stack."""
    results = run_chats(radix_stack.scheduler.address)
    stats = sched_stats(radix_stack)
    assert_idle(radix_stack)
    return {"results": results, "stats": stats, "hicache": mem_stats(radix_stack).get("hicache")}


def test_working_set_is_several_pools() -> None:
    assert working_set_tokens() >= 4 * NUM_PAGES * PAGE_SIZE


def test_radix_only_is_today(radix_only: dict) -> None:
    """Hierarchy off: no tier breakdown in meta_info, no hicache stats, histories recomputed."""
    results = radix_only["results"]
    assert all("cached_tokens_details" not in r.meta_info for r in results.values())
    assert radix_only["hicache"] is None
    assert radix_only["stats"]["host_hit_tokens"] == 0
    # The pool cannot hold the histories: later turns recompute much of theirs.
    history_tokens = sum(len(r.output_ids) + USER_LEN for r in results.values())
    assert radix_only["stats"]["prefill_tokens"] > history_tokens


def test_host_tier_outputs_identical_and_hits_host(launcher, checkpoint, radix_only) -> None:
    stack = start_stack(launcher, checkpoint, [*POOL, *HICACHE], name="-hicache")
    got = run_chats(stack.scheduler.address)
    assert outputs(got) == outputs(radix_only["results"])
    hits = tier_hits(got)
    assert hits.get("host", 0) > 0, hits
    assert "storage" not in hits  # no storage tier configured
    for r in got.values():  # the split adds up to the hit it splits
        details = r.meta_info.get("cached_tokens_details")
        if details is not None:
            assert details["device"] + details["host"] == r.meta_info["cached_tokens"]
    stats = sched_stats(stack)
    assert stats["host_hit_tokens"] >= hits["host"]  # re-admissions count there too
    assert stats["prefill_tokens"] < radix_only["stats"]["prefill_tokens"]
    hicache = mem_stats(stack)["hicache"]
    assert hicache["hit_tokens"]["host"] >= hits["host"]
    assert hicache["load_bytes"] > 0
    assert_idle(stack)


def test_three_tiers_under_pressure(launcher, checkpoint, radix_only, tmp_path) -> None:
    """A host tier as small as the device pool, a file disk tier under it: histories
    demoted to disk come back from it, token for token."""
    disk = tmp_path / "disk"
    flags = [
        "--enable-hierarchical-cache", "--hicache-ratio", "1",
        "--hicache-storage-backend", "file", "--hicache-storage-dir", str(disk),
    ]  # fmt: skip
    stack = start_stack(launcher, checkpoint, [*POOL, *flags], name="-tiers")
    got = run_chats(stack.scheduler.address)
    assert outputs(got) == outputs(radix_only["results"])
    hits = tier_hits(got)
    assert hits.get("storage", 0) > 0 and hits.get("device", 0) > 0, hits
    for r in got.values():
        details = r.meta_info.get("cached_tokens_details")
        if details is not None:
            assert details["storage_backend"] == "file"
            tiers = details["device"] + details["host"] + details["storage"]
            assert tiers == r.meta_info["cached_tokens"]
    hicache = mem_stats(stack)["hicache"]
    assert hicache["storage_backend"] == "file"
    assert hicache["hit_tokens"]["storage"] >= hits["storage"]
    assert hicache["storage_write_bytes"] > 0 and hicache["storage_read_bytes"] > 0
    assert hicache["storage_used_bytes"] <= hicache["storage_capacity_bytes"]
    assert any(disk.iterdir()), "the disk tier wrote no file"
    assert_idle(stack)


# -- retract into the host tier ------------------------------------------------------


def shared_prefix_workload(seed: int) -> list[tuple[str, list[int], int]]:
    """Requests over one long shared prefix, each with its own tail."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 256) for _ in range(32)]
    return [
        (f"r{i}", prefix + [rng.randrange(3, 256) for _ in range(rng.randint(4, 12))], 16)
        for i in range(5)
    ]


def run_all(address: str, reqs) -> dict[str, GenerateResult]:
    async def go() -> dict[str, GenerateResult]:
        async with AsyncGenerateClient(address, timeout_s=120) as client:
            results = await asyncio.gather(
                *(
                    client.generate(prompt, rid=rid, sampling={**GREEDY, "max_new_tokens": max_new})
                    for rid, prompt, max_new in reqs
                )
            )
        return {r.rid: r for r in results}

    return asyncio.run(go())


def test_retract_goes_into_the_tree_and_back(launcher, checkpoint, radix_stack) -> None:
    """``--retract-mode offload`` with the hierarchy on: a victim's KV is inserted into
    the tree (backed up to the host tier), not parked privately; its re-admission is a
    prefix hit that recomputes less than a page, and the tokens are unchanged."""
    reqs = shared_prefix_workload(3)
    reference = run_all(radix_stack.scheduler.address, reqs)
    assert_idle(radix_stack)
    stack = start_stack(
        launcher,
        checkpoint,
        [*BIG_POOL, *HICACHE],
        ["--retract-mode", "offload"],
        name="-retract",
        env={"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "3"},
    )
    got = run_all(stack.scheduler.address, reqs)
    assert outputs(got) == outputs(reference)
    stats = sched_stats(stack)
    retractions = sum(r.meta_info["num_retractions"] for r in got.values())
    assert retractions > 0 and stats["retracted_reqs"] == retractions
    assert stats["tree_retracted_reqs"] == retractions
    assert stats["offloaded_reqs"] == 0 and stats["loaded_reqs"] == 0  # no private entries
    # Each re-admission matched all its KV but the last page-aligned part.
    assert stats["reprefilled_tokens"] <= PAGE_SIZE * retractions
    hicache = mem_stats(stack)["hicache"]
    assert hicache["backup_bytes"] > 0
    assert_idle(stack)


# -- the storage tier under attack (issue 26) ------------------------------------------------

STORAGE = [
    "--enable-hierarchical-cache",
    "--hicache-ratio",
    "1",
    "--hicache-storage-backend",
    "file",
]
NUM_PROMPTS, PROMPT_LEN = 10, 40


def storage_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(PROMPT_LEN)] for _ in range(NUM_PROMPTS + 1)]


def generate_all(address: str, prompts: list[list[int]], tag: str) -> list[GenerateResult]:
    """One request after another (so the oldest prompts' KV goes down to disk)."""
    with GenerateClient(address, timeout_s=120) as client:
        return [client.generate(p, rid=f"{tag}{i}", sampling=GREEDY) for i, p in enumerate(prompts)]


def both_at_once(address: str, first: list[int], second: list[int]) -> list[GenerateResult]:
    """``first`` (long: still running), then ``second`` 50 ms later."""

    async def go() -> list[GenerateResult]:
        async with AsyncGenerateClient(address, timeout_s=120) as client:

            async def later() -> GenerateResult:
                await asyncio.sleep(0.05)
                return await client.generate(second, rid="again", sampling=GREEDY)

            long = {**GREEDY, "max_new_tokens": 40}
            return list(
                await asyncio.gather(
                    client.generate(first, rid="unrelated", sampling=long), later()
                )
            )

    return asyncio.run(go())


def page_files(disk: Path) -> list[Path]:
    return sorted(disk.rglob("*.kvpage"))


@pytest.mark.parametrize("fault", ["delete", "flip"])
def test_lost_or_corrupt_page_files_are_misses(launcher, checkpoint, tmp_path, fault) -> None:
    """Issue 26 items 1-2. After ten prompts, every page file is deleted (or has bits
    flipped); then an unrelated request and, 50 ms later, prompt 0 again. Before: both
    ended in ``abort`` with "scheduler could not continue: CopyFailedError" (delete), or
    wrong tokens were served from the flipped pages with ``storage`` hits (flip). Now:
    both finish with the tokens of the first pass, prompt 0's damaged pages are misses,
    and the pool passes the idle check (page files == the tree's index)."""
    disk = tmp_path / "disk"
    stack = start_stack(
        launcher, checkpoint, [*POOL, *STORAGE, "--hicache-storage-dir", str(disk)], name="-st"
    )
    prompts = storage_prompts(26)
    unrelated = prompts.pop()
    first = generate_all(stack.scheduler.address, prompts, "p")
    files = page_files(disk)
    assert files, "nothing reached the storage tier"
    for path in files:
        if fault == "delete":
            path.unlink()
        else:
            data = bytearray(path.read_bytes())
            for at in range(0, len(data), 97):
                data[at] ^= 0x5A
            path.write_bytes(bytes(data))
    reference = generate_all(stack.scheduler.address, [unrelated], "ref")[0].output_ids
    alone, again = both_at_once(stack.scheduler.address, unrelated, prompts[0])
    for result in (alone, again):
        assert result.finish_reason.get("type") == "length", result.meta_info
    assert alone.output_ids[: len(reference)] == reference
    assert again.output_ids == first[0].output_ids
    assert (again.meta_info.get("cached_tokens_details") or {}).get("storage", 0) == 0
    assert mem_stats(stack)["hicache"]["storage_load_failures"] > 0  # prompt 0 met them
    later = generate_all(stack.scheduler.address, prompts, "q")  # every other prompt too
    assert [r.output_ids for r in later] == [r.output_ids for r in first]
    assert_idle(stack)


def test_pd_nodes_on_one_storage_dir_never_collide(launcher, checkpoint, tmp_path) -> None:
    """Issue 26 item 5: both PD memsvc got the same --hicache-storage-dir; memsvc-P's idle
    check counted memsvc-D's pages as stray, and a memsvc restarted there (or a second
    stack) deleted every page at start. Each has its own subdirectory now."""
    disk = tmp_path / "disk"
    flags = [*POOL, *STORAGE, "--hicache-storage-dir", str(disk)]
    up = launcher.start_pd_stack(checkpoint, flags, transfer_backend="zmq")
    prompts = storage_prompts(5)
    first = generate_all(up["router"].address, prompts, "p")
    roles = sorted(p.name.split("-")[0] for p in disk.iterdir())
    assert roles == ["decode", "prefill"]
    for name in ("memsvc-p", "memsvc-d"):
        with MemClient(up[name].address) as mem:
            mem.check(idle=True)
    before = page_files(disk)
    assert before, "nothing reached the storage tier"
    # a memsvc started later on the same directory (a restart, another stack)
    other = launcher.start("memsvc", *SMALL_POOL, *STORAGE, "--hicache-storage-dir", str(disk))
    assert page_files(disk) == before
    with MemClient(up["memsvc-p"].address) as mem:
        mem.check(idle=True)
    again = generate_all(up["router"].address, prompts, "q")
    assert [r.output_ids for r in again] == [r.output_ids for r in first]
    for name in ("memsvc-p", "memsvc-d"):
        with MemClient(up[name].address) as mem:
            mem.check(idle=True)
    assert other.stop() == 0
