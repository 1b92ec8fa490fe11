"""``kvstack serve --curve-dir``: the stack it starts has CURVE on, and so does a front of one.

The front answers HTTP with the stack's client keys; the scheduler behind it
refuses a ZMQ client without them; a second front given ``--scheduler`` and the
same folder serves too, and one without the folder's keys gets a 503 from
``/health``, never tokens.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp

from kvstack.up.cli import pid_alive
from kvstack.up.health import check
from memsvc.core.backends.shm import list_segments, segment_owner_pid
from memsvc.curve import KeyFolder
from model_svc.tiny import write_tiny_checkpoint
from tests.http.test_http_front import GREEDY, POOL, start_front, stop_front


async def generate(url: str) -> tuple[int, Any]:
    body = {"input_ids": [9, 8, 7, 6], "sampling_params": GREEDY}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/generate", json=body) as response,
    ):
        return response.status, await response.json()


async def health(url: str) -> int:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/health") as response:
        return response.status


def test_serve_with_curve_dir(tmp_path: Path) -> None:
    keys_dir = tmp_path / "keys"
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt")
    server = start_front(
        tmp_path, "server", "--checkpoint", str(checkpoint), *POOL, "--curve-dir", str(keys_dir)
    )
    fronts = []
    try:
        status, body = asyncio.run(generate(server.url))
        assert status == 200 and len(body["output_ids"]) == GREEDY["max_new_tokens"], body
        scheduler = server.info["scheduler"]
        keys = KeyFolder.existing(keys_dir)
        assert check("scheduler_svc", scheduler, 5.0, keys.client_keys())[0]
        assert not check("scheduler_svc", scheduler, 1.0, None)[0]  # no keys: refused

        common = ["--scheduler", scheduler, "--checkpoint", str(checkpoint)]
        fronts.append(start_front(tmp_path, "keyed", *common, "--curve-dir", str(keys_dir)))
        fronts.append(start_front(tmp_path, "keyless", *common, "--control-timeout", "0.5"))
        keyed, keyless = (f.url for f in fronts)
        again, fronted = asyncio.run(generate(keyed))
        assert again == 200 and fronted["output_ids"] == body["output_ids"]  # greedy
        assert asyncio.run(health(keyless)) == 503
    finally:
        for front in fronts:
            stop_front(front, signal.SIGINT)
        code = stop_front(server, signal.SIGTERM)
    services = server.info["services"]
    assert code == 0, server.log()
    assert not [name for name, pid in services.items() if pid_alive(pid)]
    assert not [s for s in list_segments() if segment_owner_pid(s) in services.values()]
