"""memsvc.rpc.AsyncRequester: the asyncio client's request / reply (issue 28, item 5).

It waits on a plain socket's file descriptor through the event loop instead of
``zmq.asyncio``'s futures; these pin what :func:`memsvc.rpc.request_async` did:
the reply to this op_id (not a stale one), retries, a timeout that raises,
and a reader that goes with :meth:`close`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import zmq

from memsvc import protocol as p
from memsvc import rpc


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, rpc.AsyncRequester]]:
    """A ROUTER the test answers by hand, and a requester on a DEALER connected to it."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("inproc://memsvc-rpc-test")
    dealer = rpc.dealer(ctx, "inproc://memsvc-rpc-test")
    requester = rpc.AsyncRequester(dealer)
    try:
        yield router, requester
    finally:
        requester.close()
        dealer.close(0)
        router.close(0)
        ctx.term()


def test_the_reply_to_this_op_id_is_returned_and_a_stale_one_skipped(pair) -> None:
    router, requester = pair

    async def scenario() -> dict:
        task = asyncio.create_task(requester.request(p.pack({"op_id": 7}), 7, 5.0, 0))
        await asyncio.sleep(0)  # the request is sent before the task first waits
        identity, header = router.recv_multipart()
        assert p.unpack([header]) == {"op_id": 7}
        await asyncio.sleep(0.01)  # the task waits on the descriptor now
        router.send_multipart([identity, *p.pack({"op_id": 6, "late": True})])
        router.send_multipart([identity, b"\xc1"])  # not msgpack: no reply, skipped
        router.send_multipart([identity, *p.pack({"op_id": 7, "answer": 42})])
        return await task

    assert asyncio.run(scenario()) == {"op_id": 7, "answer": 42}


def test_a_reply_queued_before_the_wait_is_seen(pair) -> None:
    """The descriptor signals changes, not a queued message: one that came while the
    loop was busy elsewhere must still be read (ZMQ_EVENTS before each wait)."""
    router, requester = pair

    async def scenario() -> list[dict]:
        got = []
        for op_id in (1, 2, 3):
            requester.sock.send_multipart(p.pack({"op_id": 0}))  # primes the router
            identity, _ = router.recv_multipart()
            router.send_multipart([identity, *p.pack({"op_id": op_id})])
            await asyncio.sleep(0.01)  # the reply is queued before the request is even sent
            got.append(await requester.request(p.pack({"op_id": op_id}), op_id, 1.0, 0))
            router.recv_multipart()  # the request itself
        return got

    assert asyncio.run(scenario()) == [{"op_id": 1}, {"op_id": 2}, {"op_id": 3}]


def test_silence_is_retried_then_raises(pair) -> None:
    router, requester = pair
    with pytest.raises(rpc.NoReplyError):
        asyncio.run(requester.request(p.pack({"op_id": 9}), 9, 0.05, 1))
    tries = 0
    while router.poll(100):
        router.recv_multipart()
        tries += 1
    assert tries == 2  # the first send and one retry, the same op_id


def test_the_reader_follows_the_event_loop_and_goes_with_close(pair) -> None:
    router, requester = pair

    async def one(op_id: int) -> dict:
        task = asyncio.create_task(requester.request(p.pack({"op_id": op_id}), op_id, 5.0, 0))
        await asyncio.sleep(0)
        identity, _ = router.recv_multipart()
        router.send_multipart([identity, *p.pack({"op_id": op_id})])
        return await task

    for op_id in (1, 2):  # two event loops, one after the other
        assert asyncio.run(one(op_id)) == {"op_id": op_id}

    async def close_then_check() -> bool:
        await one(3)
        requester.close()
        return asyncio.get_running_loop().remove_reader(requester.sock.getsockopt(zmq.FD))

    assert asyncio.run(close_then_check()) is False  # no reader left to remove
