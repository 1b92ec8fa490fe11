"""PD pairing behind SMG, without processes: the prefill half waits for its decode node's
registration (before or after it comes), times out with a 504, and a node not in PD mode
refuses the bootstrap fields."""

from __future__ import annotations

import asyncio

import pytest

from kvstack.serve.errors import ApiError
from kvstack.serve.pairing import DecodePairing, NoPairing, PrefillPairing
from kvstack.serve.sglang.protocol import GenerateOne


def one(**bootstrap) -> GenerateOne:
    return GenerateOne(text="hi", **bootstrap)


def test_the_prefill_half_gets_the_decode_nodes_peer_and_rid_whichever_comes_first() -> None:
    async def go() -> list[dict]:
        pairing = PrefillPairing(timeout_s=5)
        pairing.offer(1, "decode-rid-1", "ipc:///tmp/d1.sock")  # registered first
        early = await pairing.kwargs(one(bootstrap_room=1), "p1")
        waiting = asyncio.ensure_future(pairing.kwargs(one(bootstrap_room=2), "p2"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        pairing.offer(2, "decode-rid-2", "ipc:///tmp/d2.sock")
        return [early, await waiting]

    early, late = asyncio.run(go())
    assert early == {
        "bootstrap_room": 1,
        "bootstrap_peer": "ipc:///tmp/d1.sock",
        "bootstrap_rid": "decode-rid-1",
    }
    assert late["bootstrap_peer"] == "ipc:///tmp/d2.sock" and late["bootstrap_rid"] == (
        "decode-rid-2"
    )


def test_a_prefill_half_nobody_registers_times_out() -> None:
    async def go() -> None:
        await PrefillPairing(timeout_s=0.1).kwargs(one(bootstrap_room=3), "p3")

    with pytest.raises(ApiError) as caught:
        asyncio.run(go())
    assert caught.value.status == 504 and caught.value.code == "bootstrap_timeout"


def test_bootstrap_fields_where_they_cannot_be_honoured() -> None:
    async def refused(pairing, body: GenerateOne) -> ApiError:
        with pytest.raises(ApiError) as caught:
            await pairing.kwargs(body, "r")
        return caught.value

    async def go() -> list[ApiError]:
        return [
            await refused(NoPairing(), one(bootstrap_room=5)),
            await refused(NoPairing(), one(bootstrap_host="127.0.0.1")),
            await refused(DecodePairing("ipc:///tmp/d.sock"), one(bootstrap_room=5)),
            await refused(PrefillPairing(), one()),
        ]

    room, host, decode, prefill = asyncio.run(go())
    assert (room.status, room.code, room.param) == (400, "unsupported_field", "bootstrap_room")
    assert host.param == "bootstrap_host"
    assert decode.status == 400 and "bootstrap_port" in decode.message
    assert prefill.status == 400 and "bootstrap_room" in prefill.message
    assert asyncio.run(NoPairing().kwargs(one(), "r")) == {}
