"""Storage faults under the scheduler (issue 26, items 1-2): seeded scenarios on a real
engine and memsvc core (in process), fast and deterministic.

Requests over shared prefixes run once; their KV goes down to the file storage tier;
then a fault hits it (a page file deleted, cut short, flipped, zeroed, swapped, linked,
or every write refused: a full disk) and the requests run again, next to one that
shares nothing with them. The model writes each position's KV as a function of its
token and position and checks every prefix it is handed, so a page served wrong fails
the scenario. Every request must finish with its exact tokens, no fault may reach the
scheduler's recovery (before: ``CopyFailedError`` ended every live request), and the
pool must pass the idle check, page files included.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import numpy as np
import pytest

from memsvc.core import KVPool
from memsvc.core.hicache import HiCacheConfig, page_hash_chain
from memsvc.core.storage.file import SUFFIX
from memsvc.handlers import MemService, ServiceConfig
from memsvc.ops import _Call, _nothing
from scheduler_svc.core import ReqState
from tests.core.storage_faults import DAMAGE_KINDS, FullDiskStorage, damage_file
from tests.faults.test_recovery import Rig
from tests.helpers import small_layout
from tests.scheduler.engine_harness import FakeModel, expected_output

PAGE = 4
MAX_NEW = 6
BASE_LEN = 40  # the prefix the prompts share


def kv_of(tokens: list[int], start: int, end: int, shape: tuple[int, ...]) -> np.ndarray:
    values = np.asarray(tokens[start:end], dtype=np.float32) * 256 + np.arange(start, end)
    return np.broadcast_to(values[:, None, None, None, None], (end - start, *shape)).copy()


class KVModel(FakeModel):
    """:class:`FakeModel` that writes each new position's KV (its token and position) and
    checks the KV of every prefix it is handed before it "computes"."""

    def __init__(self, pool: KVPool, tokens_of) -> None:
        super().__init__(pool.table.array)
        self.pool = pool
        self.tokens_of = tokens_of  # rid -> the request's fill ids
        shape = pool.layout.kv_shape
        self.shape = (shape[1], shape[2], shape[4], shape[5])
        self.checked_tokens = 0

    async def extend(self, items, sampling=None, pool_epoch=None, **kwargs):
        buffers = self.pool.buffers
        for row, prefix_len, new in items:
            tokens = list(self.tokens_of(self.pool.rid_of_row(row)))
            got = buffers.read_slots(self.table[row, :prefix_len].astype(np.int64))
            expected = kv_of(tokens, 0, prefix_len, self.shape)
            assert np.array_equal(got, expected), f"row {row}: wrong KV in its prefix"
            self.checked_tokens += prefix_len
            end = prefix_len + len(new)
            slots = self.table[row, prefix_len:end].astype(np.int64)
            buffers.write_slots(slots, kv_of(tokens, prefix_len, end, self.shape))
        return await super().extend(items, sampling, pool_epoch)

    async def decode(self, rows, seq_lens, token_ids, sampling=None, pool_epoch=None):
        for row, seq_len, token in zip(rows, seq_lens, token_ids, strict=True):
            position = int(seq_len) - 1
            slot = self.table[row, position : position + 1].astype(np.int64)
            values = kv_of([0] * position + [int(token)], position, position + 1, self.shape)
            self.pool.buffers.write_slots(slot, values)
        return await super().decode(rows, seq_lens, token_ids, sampling, pool_epoch)


class DelayedCopies:
    """Each hicache copy job starts a little late: a load is still running when its match
    returns, so a failure is found at the request's alloc_extend (the fence)."""

    def __init__(self, pool: KVPool, delay_s: float = 0.003) -> None:
        real = pool.buffers.submit

        def submit(fn, *args):
            def late(*a):
                time.sleep(delay_s)
                fn(*a)

            return real(late, *args)

        pool.buffers.submit = submit


def new_service(tmp_path) -> MemService:
    layout = small_layout(
        page_size=PAGE, num_pages=48, max_running_requests=16, max_context_len=256, dtype="float32"
    )
    config = HiCacheConfig(
        size_bytes=24 * layout.bytes_per_page,
        storage_backend="file",
        storage_dir=str(tmp_path / "store"),
        storage_size_bytes=96 * layout.bytes_per_page,
        # every storage hit is loaded: the fake model "prefills" so fast that the load
        # cost model, timed on a busy machine, may skip the loads the faults are on
        disable_load_cost_model=True,
    )
    return MemService(KVPool(layout, hicache=config), ServiceConfig(retract_decode_steps=20))


def prompts(seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(3, 250) for _ in range(BASE_LEN)]
    out = {
        f"p{i}": base + [rng.randrange(3, 250) for _ in range(rng.randint(6, 18))] for i in range(5)
    }
    out["solo"] = [rng.randrange(3, 250) for _ in range(30)]
    return out


async def run_round(rig: Rig, reqs: dict[str, list[int]], tag: str) -> None:
    for rid, prompt in reqs.items():
        rig.submit(f"{rid}-{tag}", prompt, max_new=MAX_NEW)
    await rig.run()
    for rid, prompt in reqs.items():
        req = rig.done[f"{rid}-{tag}"]
        assert req.state is ReqState.FINISHED, (rid, req.finish_reason)
        assert req.output_ids == expected_output(prompt, MAX_NEW), rid


def page_files(pool: KVPool) -> list[str]:
    directory = pool.hicache.storage.directory
    return sorted(n for n in os.listdir(directory) if n.endswith(SUFFIX))


# found_at "fence": every copy starts late, so a failed load is found at the request's
# alloc_extend, not at its match; "any": whichever comes first.
SCENARIOS = [(kind, at) for kind in (*DAMAGE_KINDS, "disk_full") for at in ("any", "fence")]


@pytest.mark.parametrize(("fault", "found_at"), SCENARIOS)
def test_storage_fault_is_a_miss_for_its_requests_alone(tmp_path, fault, found_at) -> None:
    seed = SCENARIOS.index((fault, found_at))
    service = new_service(tmp_path)
    pool = service.pool
    reqs = prompts(seed)

    async def scenario() -> None:
        rig = await Rig(service).start()
        rig.engine.model = rig.model = KVModel(pool, lambda rid: rig.engine.reqs[rid].fill_ids)
        first = {rid: p for rid, p in reqs.items() if rid != "solo"}
        if fault == "disk_full":
            pool.hicache.storage = storage = FullDiskStorage(pool.hicache.storage)
            storage.full = True
        await run_round(rig, first, "a")
        pool.flush_cache(device_only=True)  # device -> host
        pool.hicache.evict_host(pool.hicache.host.num_pages)  # host -> storage
        pool.settle_copies()
        rng = random.Random(seed)
        if fault == "disk_full":
            assert pool.hicache.stats.storage_write_failures > 0
        else:  # pages of the shared prefix: every prompt meets them
            directory, names = pool.hicache.storage.directory, page_files(pool)
            keys = page_hash_chain("", np.asarray(reqs["p0"][:BASE_LEN]), PAGE)
            stored = [k + SUFFIX for k in keys if k + SUFFIX in names]
            assert stored, "the shared prefix never reached storage"
            for name in rng.sample(stored, min(2, len(stored))):
                other = os.path.join(directory, rng.choice(names))
                damage_file(os.path.join(directory, name), fault, other, rng.randrange(1 << 12))
        if found_at == "fence":
            DelayedCopies(pool)
        await run_round(rig, reqs, "b")  # every prompt again, and the solo one beside them
        assert not rig.failures, rig.failures  # nothing reached recovery
        assert rig.model.checked_tokens > 0
        stats = pool.hicache.stats
        if fault != "disk_full":
            assert stats.storage_load_failures > 0, "the fault was never met"
            if found_at == "fence":
                assert rig.engine.stats.cut_prefix_reqs > 0
        assert rig.done["solo-b"].retraction_count == 0
        if fault == "disk_full":  # nothing reached storage: no load from it, nothing stray
            assert stats.hit_tokens["storage"] == 0 and page_files(pool) == []
        pool.settle_copies()
        pool.flush_cache()  # pages damaged but never read back are dropped too
        await rig.engine.mem._invoke(_Call("goodbye", {}, None, _nothing))
        pool.settle_copies()
        pool.check_integrity(idle=True)

    try:
        asyncio.run(scenario())
    finally:
        pool.close()
