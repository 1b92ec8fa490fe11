"""model_svc against bad messages (issue 18, defects 3 and 4): a real memsvc and worker.

An invalid message is answered under its own op_id (the client matches replies
by it), and sampling values float32 cannot use are refused or made greedy at
the worker's edge too, not turned into NaNs inside a batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from memsvc import protocol as wire
from memsvc import rpc
from memsvc.client import MemClient
from model_svc.client import ModelClient
from tests.bounds import assert_messages_bounded
from tests.model_service.test_model_svc_process import model_stack


@pytest.fixture(scope="module")
def stack(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """One memsvc and model_svc for both tests, each of which checks that the worker still
    serves and the pool is idle."""
    with model_stack(checkpoint, tmp_path_factory.mktemp("stack")) as (svc, address, _):
        yield svc, address


def _ask(sock: zmq.Socket, frames: list[bytes]) -> dict:
    sock.send_multipart(frames)
    assert sock.poll(10_000), "no reply"
    return wire.unpack(sock.recv_multipart())


def test_errors_echo_the_op_id_and_float32_edges_are_handled(stack) -> None:
    svc, address = stack
    ctx = zmq.Context()
    sock = rpc.dealer(ctx, address)
    try:
        with MemClient(svc.address) as mem, ModelClient(address) as model:
            row = mem.alloc_row("a")
            mem.alloc_extend([("a", 5)])
            arrays = {
                "rows": np.array([row]),
                "prefix_lens": np.array([0]),
                "num_tokens": np.array([5]),
                "token_ids": np.arange(10, 15),
            }
            header = {"op": "extend", "pool_epoch": mem.epoch}
            greedy = _ask(sock, wire.pack({**header, "op_id": 1}, arrays))
            assert greedy["ok"], greedy
            for op_id, frames in [
                (2, wire.pack({"op": "extend", "op_id": 2, "rows": [1]})),
                (3, wire.pack({"op": "teleport", "op_id": 3})),
                (4, wire.pack({**header, "op_id": 4, "sampling": [{"top_p": 1e-46}]}, arrays)),
            ]:
                reply = _ask(sock, frames)
                assert reply["ok"] is False and reply["op_id"] == op_id, reply
                assert reply["code"] in ("bad_request", "unknown_op"), reply
            assert "float32" in reply["message"]
            tiny = [{"temperature": 1e-300, "seed": 3}]  # SGLang: below _SAMPLING_EPS, greedy
            cold = _ask(sock, wire.pack({**header, "op_id": 5, "sampling": tiny}, arrays))
            assert cold["ok"], cold
            assert cold["next_token_ids"].tolist() == greedy["next_token_ids"].tolist()
            assert model.info()["pool_epoch"] == mem.epoch  # still serving
            mem.free_row("a")
            mem.check(idle=True)
    finally:
        sock.close(0)
        ctx.term()


def test_a_message_is_bounded_in_frames_not_only_per_frame(stack) -> None:
    """Issue 18, defect 5, on the worker's socket: over 64 MiB in all, or more frames than
    any forward call has, gets ``too_large``, read and dropped frame by frame."""
    svc, address = stack
    assert_messages_bounded(address, {"op": "info"}, over_bytes=[33 << 20, 33 << 20])
    with MemClient(svc.address) as mem, ModelClient(address) as model:
        assert model.info()["pool_epoch"] == mem.epoch  # still serving
        mem.check(idle=True)
