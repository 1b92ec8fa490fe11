"""Two normal-mode ``kvstack serve`` nodes, with and without a shared KV tier on Mooncake Store.

A seeded, synthetic multi-turn chat workload (each conversation: a long first turn,
then short user turns; every turn's prompt is the whole history, the replies token
for token, as ``input_ids``) is served by:

- ``single``: one node alone (the reference for token identity);
- ``rr_local``: two nodes, round-robin by turn (turn ``t`` of conversation ``c`` on
  node ``(c + t) % 2``: every later turn lands on the other node), each with its
  own hierarchical cache (host tier) and no shared tier: a later turn recomputes
  what the other node computed;
- ``rr_shared``: the same, both nodes on one ``mooncake_master`` (loopback, TCP)
  with ``--hicache-storage-backend mooncake``: a later turn on the other node
  finds the previous turns' pages in the shared tier (its match continues the
  prompt's hash chain through the store) and loads them, verified;
- ``smg_shared`` (not with ``--no-smg``): SGLang's router (``smg launch --policy
  cache_aware``, unmodified) in front of the two shared-tier nodes, which it picks.

Per setup: later turns' TTFT p50 / p90 (submission to the first streamed token),
the cross-node prefix hit rate (later turns' cached prompt tokens over their prompt
tokens, and the storage tier's share), requests and output tokens per wall second,
and whether the replies equal the single node's, token for token (greedy,
``ignore_eos``). The last line is JSON with ``shared_tier_ttft_speedup`` (later-turn
TTFT p50 of ``rr_local`` over ``rr_shared``) and ``outputs_identical`` (every
setup's replies equal the single node's). Exits non-zero if they differ.
``--quick``: the tiny model, a few short conversations, no SMG (a smoke test:
tests/test_bench_cluster.py). Run with the repository on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
WORKLOAD_KEYS = ("conversations", "turns", "first_len", "turn_len", "output_len", "in_flight",
                 "seed", "page_size")  # fmt: skip
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the bench


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}")
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port}")


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> int:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


# -- processes: the Mooncake master, kvstack serve nodes, SMG -------------------------------


def start_master(workdir: Path) -> tuple[subprocess.Popen, str]:
    import mooncake

    port = free_port()
    argv = [
        str(Path(mooncake.__file__).parent / "mooncake_master"),
        f"--rpc_port={port}",
        "--rpc_address=127.0.0.1",
        f"--metrics_port={free_port()}",
        "--metrics_host=127.0.0.1",
    ]
    with open(workdir / "mooncake_master.log", "wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
    wait_port(port, proc, "mooncake_master")
    return proc, f"127.0.0.1:{port}"


@dataclass
class Node:
    proc: subprocess.Popen
    url: str
    log_path: Path


def start_nodes(
    workdir: Path, names: list[str], args: list[str], env: dict[str, str]
) -> list[Node]:
    """``kvstack serve`` per name, started together, once each one's ready file is there."""
    started = []
    for name in names:
        ready = workdir / f"{name}.ready"
        log_path = workdir / f"{name}.log"
        argv = [sys.executable, "-m", "kvstack.cli", "serve", "--port", "0"]
        argv += ["--ready-file", str(ready), "--log-level", "WARNING", *args]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env={**os.environ, **env, "PYTHONPATH": str(REPO)},
                preexec_fn=_die_with_parent,
            )
        started.append((proc, ready, log_path))
    nodes = []
    deadline = time.monotonic() + 600
    try:
        for proc, ready, log_path in started:
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kvstack serve did not start:\n{log_path.read_text()}")
                time.sleep(0.1)
            nodes.append(Node(proc, json.loads(ready.read_text())["address"], log_path))
    except BaseException:
        for proc, _, _ in started:
            stop(proc)
        raise
    return nodes


def start_smg(workdir: Path, urls: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    binary = Path(sys.executable).parent / "smg"
    argv = [str(binary), "launch", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    argv += ["--health-check-interval-secs", "1", "--policy", "cache_aware"]
    argv += ["--worker-urls", *urls]
    with open(workdir / "smg.log", "wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited {proc.returncode}")
        with contextlib.suppress(Exception):
            import urllib.request

            with urllib.request.urlopen(f"{url}/workers", timeout=2) as response:
                workers = json.load(response)["workers"]
            if sum(
                bool(w.get("is_healthy")) and w.get("status") == "ready" for w in workers
            ) >= len(urls):
                return proc, url
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError("smg did not register the workers")


# -- the workload -------------------------------------------------------------------------


@dataclass
class Conversation:
    name: str
    user_turns: list[list[int]]
    history: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)


def conversations(args: argparse.Namespace, vocab: int) -> list[Conversation]:
    rng = np.random.default_rng(args.seed)
    out = []
    for c in range(args.conversations):
        turns = [rng.integers(10, vocab, args.first_len).tolist()]
        turns += [rng.integers(10, vocab, args.turn_len).tolist() for _ in range(args.turns - 1)]
        out.append(Conversation(f"c{c}", turns))
    return out


@dataclass
class TurnResult:
    conversation: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    storage_tokens: int
    output_ids: list[int]


async def generate(http: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int):
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    }
    start = time.perf_counter()
    first, last = None, None
    async with http.post(f"{url}/generate", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {await response.text()}")
        async for line in response.content:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            item = json.loads(line[5:])
            if first is None and item.get("output_ids"):
                first = time.perf_counter()
            last = item
    if (
        last is None
        or (last.get("meta_info", {}).get("finish_reason") or {}).get("type") == "abort"
    ):
        raise RuntimeError(f"{url}: no reply ({last})")
    return (first or time.perf_counter()) - start, last


async def serve(
    urls: list[str], convs: list[Conversation], args: argparse.Namespace, route: str
) -> tuple[list[TurnResult], float]:
    """Every conversation, ``in_flight`` at a time; turn ``t`` of conversation ``c`` on
    ``urls[(c + t) % len(urls)]`` (``route`` "rr"), or on ``urls[0]``."""
    slots = asyncio.Semaphore(args.in_flight)
    results: list[TurnResult] = []
    timeout = aiohttp.ClientTimeout(total=1800)

    async def one(index: int, conv: Conversation, http: aiohttp.ClientSession) -> None:
        async with slots:
            for t, user in enumerate(conv.user_turns):
                prompt = conv.history + user
                url = urls[(index + t) % len(urls)] if route == "rr" else urls[0]
                ttft, reply = await generate(http, url, prompt, args.output_len)
                meta = reply["meta_info"]
                output = list(reply["output_ids"])
                details = meta.get("cached_tokens_details") or {}
                results.append(
                    TurnResult(
                        index,
                        t,
                        ttft,
                        int(meta["prompt_tokens"]),
                        int(meta.get("cached_tokens", 0)),
                        int(details.get("storage", 0)),
                        output,
                    )
                )
                conv.outputs.append(output)
                conv.history = prompt + output

    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout) as http:
        warm = list(range(20, 52))  # untimed: first-call costs out of the way
        for url in urls:
            await generate(http, url, warm, 2)
        start = time.perf_counter()
        await asyncio.gather(*(one(i, c, http) for i, c in enumerate(convs)))
    return results, time.perf_counter() - start


def figures(results: list[TurnResult], wall_s: float) -> dict[str, Any]:
    later = [r for r in results if r.turn > 0]
    ttft = sorted(r.ttft_s for r in later)
    prompt = sum(r.prompt_tokens for r in later)
    return {
        "later_turns": len(later),
        "later_ttft_p50_s": round(statistics.median(ttft), 4),
        "later_ttft_p90_s": round(ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))], 4),
        "first_ttft_p50_s": round(statistics.median(r.ttft_s for r in results if r.turn == 0), 4),
        "later_prefix_hit_rate": round(sum(r.cached_tokens for r in later) / prompt, 4),
        "later_storage_hit_rate": round(sum(r.storage_tokens for r in later) / prompt, 4),
        "later_storage_hit_tokens": sum(r.storage_tokens for r in later),
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(len(results) / wall_s, 3),
        "output_tokens_per_s": round(sum(len(r.output_ids) for r in results) / wall_s, 2),
    }


def outputs(results: list[TurnResult]) -> dict[tuple[int, int], list[int]]:
    return {(r.conversation, r.turn): r.output_ids for r in results}


# -- the setups ----------------------------------------------------------------------------


def node_args(args: argparse.Namespace, model: str) -> list[str]:
    flags = ["--model-path", model, "--page-size", str(args.page_size)]
    flags += ["--max-total-tokens", str(args.max_total_tokens)]
    flags += ["--enable-hierarchical-cache", "--hicache-ratio", "2"]
    flags += ["--hicache-write-policy", "write_through"]
    return flags


@contextlib.contextmanager
def cluster(
    name: str,
    workdir: Path,
    args: argparse.Namespace,
    model: str,
    *,
    num_nodes: int,
    shared: bool,
    smg: bool = False,
) -> Iterator[list[str]]:
    """``num_nodes`` nodes (on a fresh Mooncake master when ``shared``; behind SMG when
    ``smg``): the URLs to send to. Everything is stopped and reaped on the way out."""
    here = workdir / name
    here.mkdir()
    flags = node_args(args, model)
    env: dict[str, str] = {}
    master = None
    router = None
    nodes: list[Node] = []
    try:
        if shared:
            master, address = start_master(here)
            config = here / "mooncake.json"
            mc = {
                "master_server_address": address,
                "metadata_server": "P2PHANDSHAKE",
                "protocol": "tcp",
                "local_hostname": "127.0.0.1",
                "global_segment_size": args.segment_mb << 20,
            }
            config.write_text(json.dumps(mc))
            env["SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"] = str(config)
            flags += ["--hicache-storage-backend", "mooncake"]
        started = time.perf_counter()
        nodes = start_nodes(here, [f"node{i}" for i in range(num_nodes)], flags, env)
        print(f"{name}: {num_nodes} node(s) up in {time.perf_counter() - started:.1f}s",
              file=sys.stderr, flush=True)  # fmt: skip
        urls = [n.url for n in nodes]
        if smg:
            router, url = start_smg(here, urls)
            urls = [url]
        yield urls
    finally:
        if router is not None:
            stop(router, 30)
        codes = [stop(n.proc) for n in nodes]
        if master is not None:
            stop(master, 15)
        if any(codes):
            raise RuntimeError(f"{name}: a node exited {codes}")


def measure(
    name: str, urls: list[str], args: argparse.Namespace, vocab: int, route: str = "rr"
) -> tuple[dict[str, Any], list[TurnResult]]:
    results, wall_s = asyncio.run(serve(urls, conversations(args, vocab), args, route))
    out = figures(results, wall_s)
    print(f"{name}: {json.dumps(out)}", file=sys.stderr, flush=True)
    return out, results


async def flush(urls: list[str]) -> None:
    """Every tier of every node emptied (SGLang's ``/flush_cache``)."""
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.post(f"{url}/flush_cache") as response:
                if response.status != 200:
                    raise RuntimeError(f"{url}/flush_cache: {response.status}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvstack-cluster-") as tmp:
        workdir = Path(tmp)
        if args.quick:
            from model_svc.tiny import write_tiny_checkpoint

            model, vocab = str(write_tiny_checkpoint(workdir / "tiny")), 250
        else:
            model, vocab = args.model_path, 40000
        setups: dict[str, dict[str, Any]] = {}
        identical: dict[str, bool] = {}
        with cluster("local", workdir, args, model, num_nodes=2, shared=False) as urls:
            # the reference: node 0 alone; then both nodes emptied for round-robin
            setups["single"], reference = measure("single", urls[:1], args, vocab, "one")
            asyncio.run(flush(urls))
            setups["rr_local"], results = measure("rr_local", urls, args, vocab)
            identical["rr_local"] = outputs(results) == outputs(reference)
        plan = [("rr_shared", False)] + ([] if args.no_smg else [("smg_shared", True)])
        for name, smg in plan:
            with cluster(name, workdir, args, model, num_nodes=2, shared=True, smg=smg) as urls:
                setups[name], results = measure(name, urls, args, vocab)
            identical[name] = outputs(results) == outputs(reference)
        for name, same in identical.items():
            setups[name]["outputs_identical_to_single"] = same
    local, shared = setups["rr_local"], setups["rr_shared"]
    return {
        "setups": setups,
        "workload": {k: getattr(args, k) for k in WORKLOAD_KEYS},
        "model": "tiny" if args.quick else args.model_path,
        "shared_tier_ttft_speedup": round(
            local["later_ttft_p50_s"] / shared["later_ttft_p50_s"], 3
        ),
        "shared_tier_ttft_p90_speedup": round(
            local["later_ttft_p90_s"] / shared["later_ttft_p90_s"], 3
        ),
        "cross_node_storage_hit_rate": shared["later_storage_hit_rate"],
        "outputs_identical": all(identical.values()),
        "smg": None if args.no_smg else "smg 1.13.0 launch --policy cache_aware",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default="smollm2")
    parser.add_argument("--quick", action="store_true", help="tiny model, tiny workload, no SMG")
    parser.add_argument("--no-smg", action="store_true", help="leave the SMG setup out")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-len", type=int, default=1024, help="first turn's tokens")
    parser.add_argument("--turn-len", type=int, default=64, help="later turns' new tokens")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument("--segment-mb", type=int, default=1024, help="each node lends the store")
    args = parser.parse_args(argv)
    if args.quick:
        args.no_smg = True
        args.conversations, args.turns, args.first_len = 2, 3, 96
        args.turn_len, args.output_len, args.page_size = 16, 4, 4
        args.max_total_tokens, args.segment_mb = 2048, 64
    out = run(args)
    print(json.dumps(out))
    if not out["outputs_identical"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
