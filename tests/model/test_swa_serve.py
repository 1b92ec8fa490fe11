"""``kvstack serve --model-path <hybrid HF folder>``: the user passes nothing about windows.

The served stack's memsvc has the checkpoint's two pools, its greedy tokens over a
context past 3 x W are transformers', the merged /metrics carry both pools'
SGLang and kvstack families, and the pools check out idle; then serve stops and
takes its services along.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

from memsvc.client import MemClient
from tests.model.swa_oracle import HYBRID_LAYER_TYPES, WINDOW, hf_greedy, prompt
from tests.procs import REPO, kill_processes, processes_with, wait_for

NUM_NEW = 30


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def test_serve_derives_the_two_pools_from_the_checkpoint(
    tmp_path_factory, swa_checkpoints, hf_swa_models
) -> None:
    tmp = tmp_path_factory.mktemp("serve-swa")
    ready = tmp / "serve.ready"
    command = [
        sys.executable, "-m", "kvstack.cli", "serve", "--port", "0", "--ready-file", str(ready),
        "--model-path", str(swa_checkpoints["hybrid"]), "--num-pages", "256", "--page-size", "4",
        "--max-context-len", "512", "--log-level", "WARNING",
    ]  # fmt: skip
    serve = subprocess.Popen(
        command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)}
    )
    try:
        wait_for(ready.exists, 300, "kvstack serve to be ready")
        info = json.loads(ready.read_text())
        ids = prompt(110, 42)
        reply = post(
            f"{info['address']}/generate",
            {"input_ids": ids, "sampling_params": {"max_new_tokens": NUM_NEW, "temperature": 0}},
        )
        assert reply["output_ids"] == hf_greedy(hf_swa_models["hybrid"], ids, NUM_NEW)
        with urllib.request.urlopen(f"{info['address']}/metrics", timeout=30) as page:
            text = page.read().decode()
        for family in ("sglang:swa_token_usage", "sglang:full_token_usage",
                       "kvstack_swa_kv_tokens", "memsvc_swa_tokens"):  # fmt: skip
            assert f"\n{family}{{" in text, family
        memsvc = info["scheduler"].replace("scheduler_svc.sock", "memsvc.sock")
        with MemClient(memsvc) as mem:
            layout = mem.layout
            assert list(layout.layer_types) == HYBRID_LAYER_TYPES
            assert layout.sliding_window == WINDOW and layout.swa_num_pages > 0
            mem.check(idle=True)  # both pools
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0
        assert not processes_with(str(tmp)), "serve left services behind"
    finally:
        serve.kill()
        serve.wait()
        kill_processes(list(processes_with(str(tmp))))
