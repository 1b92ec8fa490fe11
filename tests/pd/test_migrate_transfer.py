"""memsvc-D1 -> memsvc-D2: a decode node sends a running request's KV to another
decode node (issue 32, part 2: the pages a migrating request takes with it).

Two decode-role memsvc processes, each with its own transfer listener. D1 holds a
request mid-decode (its prompt and some output tokens written); D2 allocates a
row and the same number of tokens and expects the room; D1 sends with
``pd_send(..., peer=D2's listener)``: the same rooms, states and movers as a
prefill node's send. D2's pages must then hold D1's bytes exactly, with the last
output token carried as the room's ``first_token``, and both pools must end idle.
"""

from __future__ import annotations

import numpy as np
import pytest

from memsvc.client import MemClient, RetractTarget
from memsvc.core.backends import attach
from memsvc.core.errors import InvalidArgumentError
from memsvc.sessions import NotOwnerError
from memsvc.transfer import KVPoll
from tests.pd.test_transfer import BACKENDS, wait_state


def decode_pair(memsvc_factory, tmp_path, backend: str, *extra: str):
    common = ["--pd-role", "decode", "--transfer-backend", backend, "--transfer-timeout", "2"]
    common += extra
    listens = [f"ipc://{tmp_path}/xfer-{name}.sock" for name in ("d1", "d2")]
    nodes = [
        memsvc_factory(*common, "--transfer-listen", listen, name=name)
        for name, listen in zip(("d1", "d2"), listens, strict=True)
    ]
    return nodes, listens


def end_host_move(a: MemClient, b: MemClient, room: int) -> None:
    """After a move of "r" from D1's host store (``a``, which also holds "keep") into
    ``room`` on D2 (``b``): D1 drops its entry, both forget the room, both end idle."""
    a.host_discard("r")
    a.free_row("keep")
    a.pd_forget([room])
    b.pd_forget([room])
    b.free_row("r")
    a.check(idle=True)
    b.check(idle=True)


def fill(kv, slots: np.ndarray, page_size: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for slot in slots:
        kv.kv[slot // page_size, :, :, slot % page_size] = rng.standard_normal(
            kv.kv.shape[2:3] + kv.kv.shape[4:]
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_running_requests_kv_moves_to_another_decode_node(memsvc_factory, tmp_path, backend):
    (d1, d2), (_, d2_listen) = decode_pair(memsvc_factory, tmp_path, backend)
    prompt, decoded = 21, 6  # the KV of prompt + decoded tokens; one more token is sampled
    num_tokens = prompt + decoded
    with MemClient(d1.address) as a, MemClient(d2.address) as b:
        a_kv, b_kv = attach(a.handle), attach(b.handle)
        try:
            a.alloc_row("other")  # so D1's pages differ from D2's
            a.alloc_extend([("other", 9)])
            a.alloc_row("r")
            a_slots = list(a.alloc_extend([("r", prompt)]).slots)
            for _ in range(decoded):  # decode steps, a slot each
                a_slots += list(a.alloc_extend([("r", 1)]).slots)
            a_slots = np.array(a_slots)
            page_size = a.layout.page_size
            fill(a_kv, a_slots, page_size, seed=1)
            b.alloc_row("r")
            b_slots = b.alloc_extend([("r", num_tokens)]).slots
            b.pd_expect("r", 11)
            a.pd_send("r", 11, num_tokens, first_token=77, cached_tokens=0, peer=d2_listen)
            report = wait_state(b, 11)
            assert report["state"] == KVPoll.SUCCESS, report
            assert report["first_token"] == 77
            assert wait_state(a, 11)["state"] == KVPoll.SUCCESS
            for a_slot, b_slot in zip(a_slots, b_slots, strict=True):
                np.testing.assert_array_equal(
                    b_kv.kv[b_slot // page_size, :, :, b_slot % page_size],
                    a_kv.kv[a_slot // page_size, :, :, a_slot % page_size],
                )
            # Each side counts its own direction: D1 sent one room, D2 received one.
            for client in (a, b):
                stats = client.stats()["transfer"]
                assert stats["role"] == "decode" and stats["success"] == 1, stats
            a.pd_forget([11])
            b.pd_forget([11])
            a.free_row("r")  # the request lives on at D2
            a.free_row("other")
            b.free_row("r")
            a.check(idle=True)
            b.check(idle=True)
        finally:
            a_kv.close()
            b_kv.close()


def test_a_decode_node_sends_only_where_told_and_its_rooms_are_its_own(memsvc_factory, tmp_path):
    """A decode node has no default peer; a room id names one room, sent or received;
    another session cannot see or drop a sent room."""
    (d1, _), (_, d2_listen) = decode_pair(memsvc_factory, tmp_path, "zmq")
    with MemClient(d1.address) as a, MemClient(d1.address) as other:
        a.alloc_row("r")
        a.alloc_extend([("r", 8)])
        with pytest.raises(InvalidArgumentError, match="no decode node to send to"):
            a.pd_send("r", 4, 8, first_token=0)
        a.pd_expect("r", 3)
        with pytest.raises(InvalidArgumentError, match="already in use"):
            a.pd_send("r", 3, 8, first_token=0, peer=d2_listen)  # 3 is a received room
        a.pd_send("r", 5, 8, first_token=0, peer=d2_listen)  # D2 never expects it
        with pytest.raises(InvalidArgumentError, match="already in use"):
            a.pd_expect("r", 5)  # 5 is a sent room
        with pytest.raises(NotOwnerError):
            other.pd_status([5])
        with pytest.raises(NotOwnerError):
            other.pd_forget([5])
        assert a.pd_status([5])[0]["state"] == KVPoll.BOOTSTRAPPING
        a.pd_forget([3, 5])  # the send is cancelled, the room dropped
        assert [r["why"] for r in a.pd_status([3, 5])] == ["unknown room"] * 2
        a.free_row("r")
        a.check(idle=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_retracted_requests_host_copy_moves_to_another_decode_node(
    memsvc_factory, tmp_path, backend
):
    """A request retracted to D1's host store migrates from there: D2's pages get the
    entry's bytes (as data frames, whatever the backend), and D1's entry stays until
    D1 drops it."""
    host = ["--host-store-bytes", str(1 << 20)]
    (d1, d2), (_, d2_listen) = decode_pair(memsvc_factory, tmp_path, backend, *host)
    num_tokens = 26
    with MemClient(d1.address) as a, MemClient(d2.address) as b:
        a_kv, b_kv = attach(a.handle), attach(b.handle)
        try:
            page_size = a.layout.page_size
            keep = a.alloc_row("keep")
            a.alloc_extend([("keep", 4)])
            row = a.alloc_row("r")
            a_slots = a.alloc_extend([("r", num_tokens)]).slots
            fill(a_kv, a_slots, page_size, seed=2)
            want = np.stack([a_kv.kv[s // page_size, :, :, s % page_size] for s in a_slots])
            # a retract pops one victim at least (from the end), here to the host store
            targets = [RetractTarget.HOST_ENTRY] * 2
            assert a.retract([keep, row], targets).retracted == ["r"]
            assert a.stats()["host_store_entries"] == 1
            with pytest.raises(InvalidArgumentError, match="holds 26 tokens, not 25"):
                a.pd_send("r", 12, num_tokens - 1, first_token=5, peer=d2_listen, from_host=True)
            b.alloc_row("r")
            b_slots = b.alloc_extend([("r", num_tokens)]).slots
            b.pd_expect("r", 12)
            a.pd_send("r", 12, num_tokens, first_token=5, peer=d2_listen, from_host=True)
            report = wait_state(b, 12)
            assert report["state"] == KVPoll.SUCCESS and report["first_token"] == 5, report
            assert wait_state(a, 12)["state"] == KVPoll.SUCCESS
            got = np.stack([b_kv.kv[s // page_size, :, :, s % page_size] for s in b_slots])
            np.testing.assert_array_equal(got, want)
            assert a.stats()["host_store_entries"] == 1  # D1 drops it once D2 has it
            end_host_move(a, b, 12)
            assert a.stats()["host_store_entries"] == 0
        finally:
            a_kv.close()
            b_kv.close()
