"""memsvc-P sending to the decode node each ``pd_send`` names (``peer``), not one configured.

What a prefill node behind SGLang's router (SMG) needs: SMG pairs one prefill
node with any of several decode nodes per request, so memsvc-P reaches each
decode memsvc's transfer socket as a send names it.
"""

from __future__ import annotations

import numpy as np
import pytest

from memsvc.client import MemClient
from memsvc.core.backends import attach
from memsvc.core.errors import InvalidArgumentError
from memsvc.transfer import KVPoll
from tests.pd.test_transfer import wait_state


def test_one_prefill_memsvc_sends_to_the_decode_memsvc_each_send_names(memsvc_factory, tmp_path):
    common = ["--transfer-backend", "zmq", "--transfer-timeout", "2"]
    listens = [f"ipc://{tmp_path}/transfer-{i}.sock" for i in range(2)]
    decodes = [
        memsvc_factory("--pd-role", "decode", "--transfer-listen", listen, *common, name=f"d{i}")
        for i, listen in enumerate(listens)
    ]
    prefill = memsvc_factory("--pd-role", "prefill", *common, name="p")  # no --transfer-peer
    num_tokens = 21
    with (
        MemClient(prefill.address) as p,
        MemClient(decodes[0].address) as d0,
        MemClient(decodes[1].address) as d1,
    ):
        p_kv, d_kvs = attach(p.handle), [attach(d0.handle), attach(d1.handle)]
        try:
            ps = p.layout.page_size
            rng = np.random.default_rng(1)
            sent = {}
            for i, (d, listen) in enumerate(zip((d0, d1), listens, strict=True)):
                rid, room = f"r{i}", 100 + i
                d.alloc_row(rid)
                d_slots = d.alloc_extend([(rid, num_tokens)]).slots
                d.pd_expect(rid, room)
                p.alloc_row(rid)
                p_slots = p.alloc_extend([(rid, num_tokens)]).slots
                for slot in p_slots:
                    p_kv.kv[slot // ps, :, :, slot % ps] = rng.standard_normal(
                        p_kv.kv.shape[2:3] + p_kv.kv.shape[4:]
                    )
                p.pd_send(rid, room, num_tokens, first_token=7 + i, peer=listen)
                sent[i] = (rid, room, p_slots, d_slots)
            for i, d in enumerate((d0, d1)):
                rid, room, p_slots, d_slots = sent[i]
                report = wait_state(d, room)
                assert report["state"] == KVPoll.SUCCESS, report
                assert report["first_token"] == 7 + i
                assert wait_state(p, room)["state"] == KVPoll.SUCCESS
                for p_slot, d_slot in zip(p_slots, d_slots, strict=True):
                    np.testing.assert_array_equal(
                        d_kvs[i].kv[d_slot // ps, :, :, d_slot % ps],
                        p_kv.kv[p_slot // ps, :, :, p_slot % ps],
                    )
                # the other decode node never heard of this room
                other = (d1, d0)[i]
                assert other.pd_status([room])[0]["state"] != KVPoll.SUCCESS
                p.pd_forget([room])
                d.pd_forget([room])
                p.release(rid, is_insert=False)
                d.free_row(rid)
            # no peer named and none configured; a non-loopback peer without --allow-remote
            p.alloc_row("x")
            p.alloc_extend([("x", 4)])
            with pytest.raises(InvalidArgumentError, match="no decode node"):
                p.pd_send("x", 200, 4, first_token=1)
            with pytest.raises(InvalidArgumentError, match="loopback"):
                p.pd_send("x", 201, 4, first_token=1, peer="tcp://10.1.2.3:5555")
            p.free_row("x")
            for client in (p, d0, d1):
                client.check(idle=True)
        finally:
            p_kv.close()
            for kv in d_kvs:
                kv.close()
