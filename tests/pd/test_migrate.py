"""Retracted requests move to another decode node with their KV (issue 32, part 2).

A PD stack with two decode nodes: the router sends every request to D1, whose
pool is too small for them (it retracts to its host store); D1 has
``--migrate-to`` D2, a roomy decode node. A retracted request that cannot
resume on D1 moves to D2 with its host copy and decodes on there; D1 relays its
replies (the router's ``--relay-moves``; by default the router follows the move,
as the drain test checks). Outputs must equal normal mode's without pressure token for token,
nothing may be computed again, and every memsvc must end idle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import subprocess
import sys

import numpy as np

from kvstack import drain
from memsvc import protocol as wire
from memsvc import rpc
from memsvc.client import MemClient
from scheduler_svc.client import AsyncGenerateClient, Chunk, GenerateClient, GenerateError
from tests.pd.test_pd_mode import (
    PD_SCHEDULER,
    POOL,
    PRESSURE,
    SMALL_DECODE,
    growth,  # noqa: F401 (a fixture)
    idle_check,
    info,
    references,  # noqa: F401 (a fixture)
)
from tests.scheduler_service.test_normal_mode import finish_ids, run_all

ROOMY = ["--num-pages", "1024"]


def test_retracted_requests_move_to_the_other_decode_node(launcher, checkpoint, growth):  # noqa: F811
    up = launcher.start_pd_stack(
        checkpoint,
        POOL,
        [*PD_SCHEDULER, "--migrate-in-timeout", "3"],
        decode_pool=SMALL_DECODE,
        decode_scheduler=PRESSURE,
        migrate_to_pool=ROOMY,
        transfer_backend="zmq",
        router=["--relay-moves"],
    )
    reqs = growth["reqs"]
    got = run_all(up["router"].address, reqs)
    assert finish_ids(got) == growth["outputs"]
    state = info(up["router"])
    d1 = state["stats"]
    with GenerateClient(up["scheduler-d2"].address) as client:
        d2 = client.info()["stats"]
    assert d1["retracted_reqs"] > 0, "the small decode pool should force retracts"
    assert d1["migrated_out_reqs"] > 0, d1
    assert d2["migrated_in_reqs"] == d1["migrated_out_reqs"], (d1, d2)
    assert d1["migrate_failed"] == 0 and d1["aborted_reqs"] == 0
    # --relay-moves: D1 relayed each moved request's replies (the router followed none).
    assert d1["migrated_handed_off_reqs"] == 0 and state["router"]["moves_followed"] == 0
    # Every retracted request resumed on D1 or moved: none was computed again.
    assert d1["loaded_reqs"] + d1["migrated_out_reqs"] == d1["offloaded_reqs"]
    assert d1["reprefilled_tokens"] == 0 and d2["prefill_tokens"] == 0
    assert state["prefill"]["stats"]["prefill_tokens"] == sum(len(p) for _, p, _ in reqs)
    # D2 generated the rest of each moved request: its tokens count there.
    moved = [rid for _, kind, rid in state["timeline"] if kind == "migrated"]
    assert moved and d2["generated_tokens"] > 0
    assert sum(r.meta_info["completion_tokens"] for r in got.values()) == sum(
        len(ids) for ids in growth["outputs"].values()
    )
    check_migrate_in_is_guarded(up)
    idle_check(up["memsvc-p"], up["memsvc-d"], up["memsvc-d2"])


def migrate_in(address: str, rid: str, prompt: list[int], outputs: list[int], **fields):
    """Send a ``migrate_in`` as a peer decode node would; the first reply."""
    arrays = {"input_ids": np.asarray(prompt), "output_ids": np.asarray(outputs)}
    with GenerateClient(address) as client:
        header = {"op": "migrate_in", "rid": rid, "client": client.client_id, "room": 9}
        header.update(sampling={"max_new_tokens": 8}, **fields)
        return rpc.request(client._sock, wire.pack({**header, "op_id": 1}, arrays), 1, 30, 1)


def check_migrate_in_is_guarded(up) -> None:
    """What a peer may not do to a decode node: send tokens outside the vocabulary, or a
    request whose KV never comes (it ends with an error once the room gives up, and
    leaves nothing held); a normal or prefill node takes no moved request at all."""
    d2 = up["scheduler-d2"].address
    reply = migrate_in(d2, "x", [1, 2, 3], [70000])
    assert reply["ok"] is False and reply["status_code"] == 400, reply
    assert "out of vocabulary" in reply["message"]
    reply = migrate_in(d2, "y", [1, 2, 3], [4, 5], room=77)  # nobody sends room 77: 3 s
    assert reply.get("type") == "done", reply
    assert reply["meta_info"]["finish_reason"]["type"] == "abort", reply
    assert "did not arrive within 3s" in reply["meta_info"]["finish_reason"]["message"], reply
    reply = migrate_in(up["scheduler-p"].address, "z", [1, 2, 3], [4])
    assert reply["ok"] is False and "does not take moved requests" in reply["message"], reply


def kvstack_drain(address: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstack", "drain", address, "--timeout", "120"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def drain_in_process(address: str) -> tuple[int, str]:
    """``kvstack drain ADDRESS`` run here (a new interpreter takes seconds to start on a
    busy machine, by which time the requests may have ended): its status and output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = drain.run(argparse.Namespace(address=address, timeout=120.0))
    return status, out.getvalue()


def test_kvstack_drain_moves_a_decode_node_onto_its_peer(launcher, checkpoint, growth):  # noqa: F811
    """``kvstack drain`` (the node's SIGTERM) on a decode node with a peer: every running
    request moves there with its KV (sent straight from its pool pages, no host-store
    copy; before, each was parked in the host store first) and ends token for
    token as without the move; the router follows each to the peer (before, the first
    node relayed their replies and could not stop until the last one ended), so the
    node stops while they still decode there. A new request is refused meanwhile
    (503). Nothing is computed again. A node with no peer is not drained."""
    up = launcher.start_pd_stack(
        checkpoint, [*POOL, "--num-pages", "512"], PD_SCHEDULER, migrate_to_pool=ROOMY
    )
    reqs = growth["reqs"]
    streamed: dict[str, list[int]] = {rid: [] for rid, _, _ in reqs}
    results: dict[str, object] = {}
    refused: list[str] = []

    async def one(client, rid: str, prompt: list[int], n: int) -> None:
        async for item in client.stream(prompt, rid=rid, sampling={"max_new_tokens": n}):
            if isinstance(item, Chunk):
                streamed[rid].extend(item.token_ids)
            else:
                results[rid] = item

    async def go() -> None:
        async with AsyncGenerateClient(up["router"].address, timeout_s=120) as client:
            tasks = [asyncio.create_task(one(client, *req)) for req in reqs]
            while min(len(t) for t in streamed.values()) < 8:  # all running, mid-decode
                await asyncio.sleep(0.005)
            draining = asyncio.create_task(asyncio.to_thread(drain_in_process, address))
            while not info(up["scheduler-d"]).get("draining"):
                await asyncio.sleep(0.01)
            ended_before.append(len(results))
            try:
                await client.generate([5, 6, 7], rid="late", sampling={"max_new_tokens": 4})
            except GenerateError as exc:
                refused.append(f"{exc.status_code} {exc}")
            stopped = await asyncio.to_thread(up["scheduler-d"].proc.wait, 120)
            ended_at_stop.append(len(results))
            await asyncio.gather(*tasks)
            drained.append((stopped, *await draining))

    address = up["scheduler-d"].address
    drained: list[tuple[int, int, str]] = []
    ended_before: list[int] = []
    ended_at_stop: list[int] = []
    refused_drain = kvstack_drain(up["scheduler-d2"].address)  # no --migrate-to
    assert refused_drain.returncode == 2 and "nowhere to go" in refused_drain.stderr
    asyncio.run(go())
    assert drained[0][:2] == (0, 0) and "drained and stopped" in drained[0][2], drained
    assert {rid: r.output_ids for rid, r in results.items()} == growth["outputs"]
    for rid, want in growth["outputs"].items():  # each token once, in order, through the
        # move (the last step's tokens come with the result, not in a chunk)
        assert streamed[rid] == want[: len(streamed[rid])] and len(streamed[rid]) >= 8, rid
    assert refused and refused[0].startswith("503") and "draining" in refused[0], refused
    with GenerateClient(up["scheduler-d2"].address) as client:
        d2 = client.info()["stats"]
    # Those still running when it drained moved (the shortest may have ended before).
    moved = d2["migrated_in_reqs"]
    assert 1 <= moved <= len(reqs) - ended_before[0], d2
    # The router followed each move: the node stopped before the moved requests ended.
    assert info(up["router"])["router"]["moves_followed"] == moved
    assert ended_at_stop[0] < len(reqs), (ended_at_stop, ended_before, moved)
    assert d2["prefill_tokens"] == 0, d2
    with GenerateClient(up["scheduler-p"].address) as client:
        prefilled = client.info()["stats"]["prefill_tokens"]
    # Each prompt once: none again for the move (the refused one's 3 tokens may have been
    # prefilled before the router's abort reached the prefill node).
    assert prefilled - sum(len(p) for _, p, _ in reqs) in (0, 3), prefilled
    with MemClient(up["memsvc-d"].address) as mem:  # sent from the rows: nothing parked
        assert mem.stats()["counters"].get("op.offload.ok", 0) == 0
    idle_check(up["memsvc-d"], up["memsvc-d2"])
