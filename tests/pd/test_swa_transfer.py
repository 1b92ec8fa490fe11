"""memsvc-P -> memsvc-D transfer of a hybrid (sliding-window) pool, both backends, real
processes: every page's full KV and the SWA KV of the window alone (the SWA tail of the
prompt, page aligned) arrive; D's pages below the window keep no copied SWA KV."""

from __future__ import annotations

import time

import numpy as np
import pytest

from memsvc.client import MemClient, RetractTarget
from memsvc.core.backends import attach
from memsvc.transfer import KVPoll
from tests.pd.test_migrate_transfer import decode_pair, end_host_move
from tests.pd.test_transfer import BACKENDS, pd_pair, wait_state

F, S = "full_attention", "sliding_attention"
W, PS = 10, 4


def hybrid_flags(layer_types: str) -> list[str]:
    num_layers = len(layer_types.split(","))
    return ["--num-layers", str(num_layers), "--layer-types", layer_types, "--sliding-window",
            str(W), "--head-dim", "8"]  # fmt: skip


@pytest.mark.parametrize(
    ("backend", "layer_types"),
    [("zmq", f"{S},{F},{S}"), ("nixl", f"{S},{F},{S}"), ("zmq", f"{S},{S}"), ("nixl", f"{S},{S}")],
)
def test_full_pages_and_the_window_arrive(memsvc_factory, tmp_path, backend, layer_types):
    prefill, decode = pd_pair(memsvc_factory, tmp_path, backend, *hybrid_flags(layer_types))
    num_tokens = 37  # SWA tail from floor_page(37 - W) = 24: pages 6..9
    with MemClient(prefill.address) as p, MemClient(decode.address) as d:
        p_kv, d_kv = attach(p.handle), attach(d.handle)
        try:
            assert p.layout.is_hybrid and d.layout.is_hybrid
            d.alloc_row("r")
            d_slots = d.alloc_extend([("r", num_tokens)]).slots
            p.alloc_row("other")  # so P's pages differ from D's
            p.alloc_extend([("other", 9)])
            p.alloc_row("r")
            p_slots = p.alloc_extend([("r", num_tokens)]).slots
            p_f2s, d_f2s = p_kv.full_to_swa_page, d_kv.full_to_swa_page
            rng = np.random.default_rng(0)
            for slot in p_slots:
                page, off = slot // PS, slot % PS
                if p_kv.kv.shape[1]:
                    p_kv.kv[page, :, :, off] = rng.standard_normal(p_kv.kv[page, :, :, off].shape)
                swa = p_kv.swa_kv[p_f2s[page], :, :, off]
                p_kv.swa_kv[p_f2s[page], :, :, off] = rng.standard_normal(swa.shape)
            for slot in d_slots:  # D's SWA pages start poisoned
                d_kv.swa_kv[d_f2s[slot // PS], :, :, slot % PS] = np.nan
            p.pd_send("r", 7, num_tokens, first_token=42, cached_tokens=0)
            time.sleep(0.05)
            d.pd_expect("r", 7)
            report = wait_state(d, 7)
            assert report["state"] == KVPoll.SUCCESS, report
            assert wait_state(p, 7)["state"] == KVPoll.SUCCESS
            swa_from = (num_tokens - W) // PS * PS
            for pos, (p_slot, d_slot) in enumerate(zip(p_slots, d_slots, strict=True)):
                pp, dp, off = p_slot // PS, d_slot // PS, p_slot % PS
                np.testing.assert_array_equal(d_kv.kv[dp, :, :, off], p_kv.kv[pp, :, :, off])
                d_swa = d_kv.swa_kv[d_f2s[dp], :, :, off]
                if pos >= swa_from:  # the window: copied
                    np.testing.assert_array_equal(d_swa, p_kv.swa_kv[p_f2s[pp], :, :, off])
                else:  # below it: never sent
                    assert np.isnan(d_swa).all()
            stats = d.stats()["transfer"]
            assert stats["backend"] == backend and stats["success"] == 1
            p.pd_forget([7])
            d.pd_forget([7])
            p.release("r", is_insert=False)
            p.free_row("other")
            d.free_row("r")
            p.check(idle=True)
            d.check(idle=True)
        finally:
            p_kv.close()
            d_kv.close()


def test_a_decode_node_of_another_window_is_refused(memsvc_factory, tmp_path):
    listen = f"ipc://{tmp_path}/transfer.sock"
    common = ["--transfer-backend", "zmq", "--transfer-timeout", "2", "--num-layers", "2",
              "--layer-types", f"{S},{F}", "--head-dim", "8"]  # fmt: skip
    decode = memsvc_factory("--pd-role", "decode", "--transfer-listen", listen, *common,
                            "--sliding-window", "8", name="d")  # fmt: skip
    prefill = memsvc_factory("--pd-role", "prefill", "--transfer-peer", listen, *common,
                             "--sliding-window", "12", name="p")  # fmt: skip
    with MemClient(prefill.address) as p, MemClient(decode.address) as d:
        d.alloc_row("r")
        d.alloc_extend([("r", 20)])
        p.alloc_row("r")
        p.alloc_extend([("r", 20)])
        p.pd_send("r", 3, 20, first_token=1, cached_tokens=0)
        d.pd_expect("r", 3)
        report = wait_state(p, 3)
        assert report["state"] == KVPoll.FAILED and "geometry" in report["why"]
        p.pd_forget([3])
        d.pd_forget([3])
        p.release("r", is_insert=False)
        d.free_row("r")
        p.check(idle=True)
        d.check(idle=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_host_entry_of_a_hybrid_pool_moves_with_its_window(memsvc_factory, tmp_path, backend):
    """Decode node to decode node (issue 32, a retracted request migrating): a hybrid
    pool's host-store entry goes with every position's full KV and its window's SWA KV
    (as data frames, whatever the backend); D2's pages below the window get no SWA KV.
    Before: refused ("a hybrid pool's host entries cannot be sent yet")."""
    flags = [*hybrid_flags(f"{S},{F},{S}"), "--host-store-bytes", str(1 << 20)]
    (d1, d2), (_, d2_listen) = decode_pair(memsvc_factory, tmp_path, backend, *flags)
    num_tokens = 37  # window from floor_page(37 - W) = 24
    with MemClient(d1.address) as a, MemClient(d2.address) as b:
        a_kv, b_kv = attach(a.handle), attach(b.handle)
        try:
            keep = a.alloc_row("keep")
            a.alloc_extend([("keep", 4)])
            row = a.alloc_row("r")
            a_slots = a.alloc_extend([("r", num_tokens)]).slots
            a_f2s, b_f2s = a_kv.full_to_swa_page, b_kv.full_to_swa_page
            rng = np.random.default_rng(3)
            for slot in a_slots:
                page, off = slot // PS, slot % PS
                a_kv.kv[page, :, :, off] = rng.standard_normal(a_kv.kv[page, :, :, off].shape)
                swa = a_kv.swa_kv[a_f2s[page], :, :, off]
                a_kv.swa_kv[a_f2s[page], :, :, off] = rng.standard_normal(swa.shape)
            swa_from = (num_tokens - W) // PS * PS
            want_full = [a_kv.kv[s // PS, :, :, s % PS].copy() for s in a_slots]
            want_swa = [a_kv.swa_kv[a_f2s[s // PS], :, :, s % PS].copy() for s in a_slots]
            targets = [RetractTarget.HOST_ENTRY] * 2
            assert a.retract([keep, row], targets).retracted == ["r"]
            b.alloc_row("r")
            b_slots = b.alloc_extend([("r", num_tokens)]).slots
            for slot in b_slots:  # D2's SWA pages start poisoned
                b_kv.swa_kv[b_f2s[slot // PS], :, :, slot % PS] = np.nan
            b.pd_expect("r", 12)
            a.pd_send("r", 12, num_tokens, first_token=5, peer=d2_listen, from_host=True)
            report = wait_state(b, 12)
            assert report["state"] == KVPoll.SUCCESS, report
            assert wait_state(a, 12)["state"] == KVPoll.SUCCESS
            for pos, slot in enumerate(b_slots):
                page, off = slot // PS, slot % PS
                np.testing.assert_array_equal(b_kv.kv[page, :, :, off], want_full[pos])
                got = b_kv.swa_kv[b_f2s[page], :, :, off]
                if pos >= swa_from:
                    np.testing.assert_array_equal(got, want_swa[pos])
                else:
                    assert np.isnan(got).all()
            end_host_move(a, b, 12)
        finally:
            a_kv.close()
            b_kv.close()
