"""What a hostile client costs ``kvstack serve``'s front: peak RSS and ``/health`` latency.

Issue 26, items 6 and 8. Starts ``kvstack serve --model-path tiny`` under the
usual open-file limit (``--nofile``, 1,024), measures ``/health`` on the idle
front (the baseline), then, one after the other:

1. ``big_body``: a ``--body-mb`` MB ``input_ids`` body (62: the issue's), which
   the body cap turns into a quick 413;
2. ``body_under_cap``: the largest ``input_ids`` body the cap takes (a 400:
   too many ids), decoded and validated in a worker thread;
3. ``slow_clients``: ``--slow-headers`` connections that never finish their
   headers and ``--slow-bodies`` that never finish their bodies (1,000 and
   300, the issue's), each sending a byte a second.

For each: the status the attacker got, how long it took, ``/health`` latency
while the attack runs (polled every 20 ms from a separate thread, each poll a
new connection: p50, max, and the ratio of max to the idle baseline's max),
failed polls, the front's peak RSS (``VmHWM``, which only grows: after each
phase) and its open descriptors. The services behind the front are not
measured. The last line is JSON.

    .venv/bin/python bench/front_attack.py
    .venv/bin/python bench/front_attack.py --body-mb 62 --slow-headers 1000 --slow-bodies 300
    .venv/bin/python bench/front_attack.py -- --max-connections 64   # flags for kvstack serve
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serve_process import kvstack_serve

POLL_S = 0.02
HEALTH_TIMEOUT_S = 30.0
FLAGS = ["--model-path", "tiny", "--log-level", "WARNING"]  # kvstack serve's, before the user's


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def health_once(url: str) -> float | None:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=HEALTH_TIMEOUT_S) as response:
            ok = response.status == 200
    except (urllib.error.URLError, OSError):
        ok = False
    return time.monotonic() - started if ok else None


def _poll(url: str, stop: Any, results: Any) -> None:
    latencies, failures = [], 0
    while not stop.is_set():
        seconds = health_once(url)
        if seconds is None:
            failures += 1
        else:
            latencies.append(seconds)
        stop.wait(POLL_S)
    results.put((latencies, failures))


class HealthPoller:
    """``/health`` every ``POLL_S`` from a process of its own (so that the attacker's work
    here does not delay the polls), while ``with`` lasts."""

    def __init__(self, url: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = ctx.Event()
        self._results = ctx.Queue()
        self._proc = ctx.Process(target=_poll, args=(url, self._stop, self._results))

    def __enter__(self) -> HealthPoller:
        self._proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.latencies, self.failures = self._results.get(timeout=HEALTH_TIMEOUT_S * 2)
        self._proc.join()

    def summary(self, baseline_max: float | None = None) -> dict[str, Any]:
        lat = self.latencies
        out: dict[str, Any] = {
            "health_polls": len(lat) + self.failures,
            "health_failures": self.failures,
            "health_p50_ms": round(statistics.median(lat) * 1000, 1) if lat else None,
            "health_max_ms": round(max(lat) * 1000, 1) if lat else None,
        }
        if baseline_max and lat:
            out["ratio_health_max_vs_idle"] = round(max(lat) / baseline_max, 2)
        return out


def post_raw(url: str, path: str, body: bytes) -> tuple[int | None, float]:
    """POST ``body`` on a raw socket (the answer may come before the body is sent)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    started = time.monotonic()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=600) as sock:
        with contextlib.suppress(OSError):  # refused early and closed: read the answer
            sock.sendall(head + body)
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                answer += chunk
    seconds = time.monotonic() - started
    try:
        return int(answer.split(b" ", 2)[1]), seconds
    except (IndexError, ValueError):
        return None, seconds


def ids_body(num_bytes: int) -> bytes:
    """``{"input_ids": [12345, 12345, ...]}`` of about ``num_bytes`` bytes."""
    return b'{"input_ids": [' + b", ".join([b"12345"] * (num_bytes // 7)) + b"]}"


def phase(
    url: str, pid: int, baseline_max: float, attack: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    with HealthPoller(url) as poller:
        time.sleep(1.0)  # the poller's interpreter starts
        result = attack()
        time.sleep(0.2)
    return {
        **result,
        **poller.summary(baseline_max),
        "front_peak_rss_mib": round(status_kib(pid, "VmHWM") / 1024, 1),
        "front_fds_after": len(os.listdir(f"/proc/{pid}/fd")),
    }


def is_open(sock: socket.socket) -> bool:
    """Whether the server still holds ``sock`` (what it sent before closing is read)."""
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return True
    except OSError:  # reset
        pass
    return False


def slow_clients(url: str, pid: int, num_headers: int, num_bodies: int, hold_s: float) -> dict:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    starts = [b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: "] * num_headers
    starts += [
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{"
    ] * num_bodies
    socks, open_failures, most_fds = [], 0, 0
    try:
        for start in starts:
            try:
                sock = socket.create_connection((host, int(port)), timeout=5)
                sock.sendall(start)
                sock.setblocking(False)
                socks.append(sock)
            except OSError:
                open_failures += 1
        deadline = time.monotonic() + hold_s
        while time.monotonic() < deadline:
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.send(b"a")
            with contextlib.suppress(OSError):
                most_fds = max(most_fds, len(os.listdir(f"/proc/{pid}/fd")))
            time.sleep(1.0)
        still_open = sum(1 for sock in socks if is_open(sock))
    finally:
        for sock in socks:
            sock.close()
    return {
        "connections": num_headers + num_bodies,
        "connect_failures": open_failures,
        "held_s": hold_s,
        "still_open_at_end": still_open,
        "front_most_fds": most_fds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nofile", type=int, default=1024, help="the front's open-file limit")
    parser.add_argument("--body-mb", type=float, default=62.0)
    parser.add_argument("--under-cap-mb", type=float, default=15.0)
    parser.add_argument("--slow-headers", type=int, default=1000)
    parser.add_argument("--slow-bodies", type=int, default=300)
    parser.add_argument("--hold", type=float, default=15.0, help="seconds the slow clients hold")
    parser.add_argument("serve_args", nargs="*", help="after --: flags for kvstack serve")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"nofile": args.nofile}

    def limit() -> None:  # in the front, before it starts
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))

    with (
        tempfile.TemporaryDirectory(prefix="kvstack-front-attack-") as tmp,
        kvstack_serve(
            Path(tmp), [*FLAGS, *args.serve_args], timeout_s=300, preexec_fn=limit
        ) as serve,
    ):
        url, pid = serve.address, serve.proc.pid
        with HealthPoller(url) as idle:
            time.sleep(3.0)
        out["idle"] = {
            **idle.summary(),
            "front_rss_mib": round(status_kib(pid, "VmRSS") / 1024, 1),
        }
        baseline = max(idle.latencies)

        def body(megabytes: float) -> Callable[[], dict[str, Any]]:
            data = ids_body(int(megabytes * 1e6))  # made before the polls start

            def attack() -> dict[str, Any]:
                status, seconds = post_raw(url, "/generate", data)
                return {
                    "body_mb": round(len(data) / 1e6, 1),
                    "status": status,
                    "seconds": round(seconds, 2),
                }

            return attack

        out["big_body"] = phase(url, pid, baseline, body(args.body_mb))
        out["body_under_cap"] = phase(url, pid, baseline, body(args.under_cap_mb))
        out["slow_clients"] = phase(
            url,
            pid,
            baseline,
            lambda: slow_clients(url, pid, args.slow_headers, args.slow_bodies, args.hold),
        )
        out["after"] = {"health_ms": round((health_once(url) or float("nan")) * 1000, 1)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
