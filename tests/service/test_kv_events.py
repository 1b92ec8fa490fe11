"""``--kv-events-config`` (issue 31, part 4): SGLang's KV events on a ZMQ PUB socket, as a
KV-aware router subscribes to them: three frames (topic, 8-byte sequence, msgpack batch),
a replay ROUTER that returns buffered batches by sequence, and a config refused at start
with a clear error when it is wrong.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from memsvc import kv_events
from memsvc.client import MemClient
from memsvc.core.errors import InvalidArgumentError
from memsvc.kv_events import (
    END_SEQ,
    KVEventsConfig,
    kv_events_config_for_node,
    start_kv_events,
)
from tests.core.test_hicache import PAGE, finish, make_pool, run_request, seq
from tests.kv_events_subscriber import CPU, GPU, BlockIndex, expected_blocks, sglang_page_hashes
from tests.procs import REPO, SMALL_POOL

TOPIC = "kv-events"


def replay_from(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket for the batches from ``start`` on: [(seq, payload)]."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                return out
            empty, topic, seq_bytes, payload = frames
            assert empty == b"" and topic == TOPIC.encode()
            out.append((int.from_bytes(seq_bytes, "big"), payload))
    finally:
        dealer.close()


class Subscriber:
    """A router's side: SUB for the live batches, the replay socket for those it missed."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str | None) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.ctx = ctx
        self.index = BlockIndex()
        self.next_seq = 0
        self.payloads: dict[int, bytes] = {}
        self.num_replayed = 0

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        return replay_from(self.ctx, self.replay_endpoint, start)

    def _apply(self, seq_no: int, payload: bytes) -> None:
        assert seq_no == self.next_seq
        self.index.apply_payload(payload)
        self.payloads[seq_no] = payload
        self.next_seq += 1

    def drain(self, timeout_ms: int = 300) -> None:
        """Apply every batch published so far, in order, replaying any missed."""
        while self.sub.poll(timeout_ms):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode()
            seq_no = int.from_bytes(seq_bytes, "big")
            if seq_no < self.next_seq:
                continue
            if seq_no > self.next_seq:  # a gap: ask the replay socket
                for missed, missed_payload in self.replay(self.next_seq):
                    if missed < seq_no and missed == self.next_seq:
                        self._apply(missed, missed_payload)
                        self.num_replayed += 1
            self._apply(seq_no, payload)

    def catch_up(self) -> None:
        """:meth:`drain`, then replay what the SUB socket never saw (a subscription takes a
        moment to reach the publisher: batches sent before that are only in the buffer)."""
        self.drain()
        for seq_no, payload in self.replay(self.next_seq):
            self._apply(seq_no, payload)
            self.num_replayed += 1

    def close(self) -> None:
        self.sub.close()


def config(tmp_path, **extra) -> str:
    return json.dumps(
        {
            "publisher": "zmq",
            "endpoint": f"ipc://{tmp_path}/kv-events.sock",
            "replay_endpoint": f"ipc://{tmp_path}/kv-replay.sock",
            "topic": TOPIC,
            **extra,
        }
    )


def test_subscriber_rebuilds_every_tier_and_replays_what_it_missed(tmp_path):
    pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage="file", storage_pages=16)
    publisher = start_kv_events(config(tmp_path), pool.tree)
    ctx = zmq.Context()
    try:
        # joins after the first batch (AllBlocksCleared) went out: replay fills the gap
        replay = f"ipc://{tmp_path}/kv-replay.sock"
        for _ in range(50):
            if replay_from(ctx, replay, 0):
                break
        assert [s for s, _ in replay_from(ctx, replay, 0)] == [0]
        sub = Subscriber(ctx, f"ipc://{tmp_path}/kv-events.sock", replay)
        sub.drain()
        workload = [seq(40, 3), seq(41, 3), seq(42, 2)]
        for i, tokens in enumerate(workload):
            run_request(pool, f"r{i}", tokens)
            publisher.flush()
        pool.evict(pool.evictable_size())
        publisher.flush()
        run_request(pool, "again", workload[0])  # back from host or storage
        pool.settle_copies()
        publisher.flush()
        sub.drain()
        assert sub.num_replayed >= 1 and sub.index.num_cleared == 1
        view = sub.index.view()
        assert view == expected_blocks(pool.tree) and {GPU, CPU} <= set(view)
        # the replay socket returns what is buffered from a sequence on, byte for byte
        replayed = sub.replay(2)
        assert [s for s, _ in replayed] == list(range(2, sub.next_seq))
        assert all(sub.payloads[s] == p for s, p in replayed)
        pool.flush_cache()
        publisher.flush()
        sub.drain()
        assert sub.index.view() == {} and sub.index.num_cleared == 2
        sub.close()
    finally:
        publisher.close()
        ctx.destroy(linger=0)
    finish(pool)


def test_replay_keeps_the_last_buffer_steps_batches(tmp_path):
    pool = make_pool(num_pages=8, host_pages=4)
    publisher = start_kv_events(config(tmp_path, buffer_steps=3), pool.tree)
    ctx = zmq.Context()
    try:
        sub = Subscriber(
            ctx, f"ipc://{tmp_path}/kv-events.sock", f"ipc://{tmp_path}/kv-replay.sock"
        )
        for i in range(5):
            run_request(pool, f"r{i}", seq(50 + i, 1))
            publisher.flush()
        # No drain first: on a loaded machine the subscription can reach the publisher
        # after the first batches, and the gap is older than what the buffer keeps.
        batches = sub.replay(0)
        assert [s for s, _ in batches] == [3, 4, 5]  # 6 batches, the last 3 kept
        _ts, events, dp_rank = msgpack.unpackb(batches[-1][1])
        assert dp_rank == 0 and events[0]["type"] == "BlockStored"
        sub.close()
    finally:
        publisher.close()
        ctx.destroy(linger=0)
    assert not list(tmp_path.glob("kv-*.sock"))  # the ipc paths it bound are gone
    finish(pool)


def test_a_stuck_publisher_never_blocks_the_pool(tmp_path, monkeypatch):
    """SGLang's publish waits on a full queue; memsvc's drops the batch and counts it."""
    gate = threading.Event()
    real_encode = kv_events.encode_batch

    def stuck_encode(ts, events, dp_rank=0):
        gate.wait(10)
        return real_encode(ts, events, dp_rank)

    monkeypatch.setattr(kv_events, "encode_batch", stuck_encode)
    pool = make_pool(num_pages=8, host_pages=4)
    publisher = start_kv_events(config(tmp_path, max_queue_size=1), pool.tree)
    try:
        deadline = time.monotonic() + 5
        while publisher._queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)  # the thread took the first batch and is stuck on it
        for i in range(3):
            started = time.monotonic()
            run_request(pool, f"r{i}", seq(60 + i, 1))
            publisher.flush()
            assert time.monotonic() - started < 1.0
        assert publisher.num_dropped_batches == 2  # one queued, two dropped
    finally:
        gate.set()
        publisher.close()
    finish(pool)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"publisher": "kafka"}', "unknown publisher 'kafka'"),
        ('{"publisher": "zmq", "endpoint": "http://x"}', "endpoint must be a tcp://"),
        ('{"publisher": "zmq", "hwm": -1}', "hwm must be an integer >= 0"),
        ('{"publisher": "zmq", "buffer_steps": "many"}', "buffer_steps must be an integer"),
        ('{"publisher": "zmq", "endpont": "tcp://*:1"}', "unknown key(s) ['endpont']"),
        ('{"publisher": "zmq", "format": "xml"}', "format must be"),
    ],
)
def test_bad_config_is_a_clear_error(text, message):
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        KVEventsConfig.parse(text)


def test_sglang_defaults_and_bind_rule():
    config = KVEventsConfig.parse('{"publisher": "zmq"}')
    assert (config.endpoint, config.buffer_steps, config.hwm, config.topic) == (
        "tcp://*:5557",
        10_000,
        100_000,
        "",
    )
    assert config.binds
    assert not KVEventsConfig.parse('{"endpoint": "tcp://127.0.0.1:1"}').binds  # connects
    assert KVEventsConfig.parse('{"endpoint": "tcp://127.0.0.1:1", "bind": true}').binds
    assert KVEventsConfig.parse('{"endpoint": "ipc:///tmp/x"}').binds


def test_each_node_of_a_cluster_gets_its_own_endpoints():
    text = json.dumps({"publisher": "zmq", "replay_endpoint": "tcp://*:5600", "topic": "t"})
    assert json.loads(kv_events_config_for_node(text, 0))["replay_endpoint"] == "tcp://*:5600"
    node2 = json.loads(kv_events_config_for_node(text, 2))
    assert node2 == {
        "publisher": "zmq",
        "endpoint": "tcp://*:5559",  # SGLang's default 5557, plus 2
        "replay_endpoint": "tcp://*:5602",
        "topic": "t",
    }
    ipc = json.dumps({"publisher": "zmq", "endpoint": "ipc:///run/ev.sock"})
    assert json.loads(kv_events_config_for_node(ipc, 1))["endpoint"] == "ipc:///run/ev.sock-1"


def test_an_endpoint_in_use_is_refused_at_start(tmp_path):
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    pool = make_pool(num_pages=8, host_pages=4)
    try:
        text = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "bind": True})
        with pytest.raises(InvalidArgumentError, match="cannot open"):
            start_kv_events(text, pool.tree)
        assert not pool.tree.events.enabled  # nothing attached
    finally:
        holder.close(0)
        ctx.destroy(linger=0)
    finish(pool)


def run_memsvc(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memsvc", *SMALL_POOL, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )


def test_memsvc_refuses_a_bad_config_and_a_wildcard_without_allow_remote():
    out = run_memsvc("--kv-events-config", '{"publisher": "zmq", "topic": 3}')
    assert out.returncode == 2 and "--kv-events-config: topic must be a string" in out.stderr
    out = run_memsvc("--kv-events-config", '{"publisher": "zmq"}')  # SGLang's tcp://*:5557
    assert out.returncode == 2 and "non-loopback" in out.stderr, out.stderr


def test_memsvc_publishes_its_tree(tmp_path, memsvc_factory):
    svc = memsvc_factory("--kv-events-config", config(tmp_path))
    ctx = zmq.Context()
    try:
        sub = Subscriber(
            ctx, f"ipc://{tmp_path}/kv-events.sock", f"ipc://{tmp_path}/kv-replay.sock"
        )
        tokens = np.random.default_rng(7).integers(1, 30000, size=3 * PAGE + 1).tolist()
        with MemClient(svc.address) as mem:
            mem.alloc_row("r1")
            assert mem.match_prefix("r1", tokens[:-1]) == 0
            mem.alloc_extend([("r1", len(tokens))])
            mem.release("r1", tokens, is_insert=True)
            sub.catch_up()
            assert sub.index.view() == {
                GPU: {
                    h: tokens[i * PAGE : (i + 1) * PAGE]
                    for i, h in enumerate(sglang_page_hashes(tokens, PAGE))
                }
            }
            mem.flush_cache()
            sub.catch_up()
            assert sub.index.view() == {} and sub.index.num_cleared == 2
            mem.check(idle=True)
        sub.close()
    finally:
        ctx.destroy(linger=0)
