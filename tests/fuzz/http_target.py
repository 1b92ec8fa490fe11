"""``kvstack serve`` fronting a live normal stack, fuzzed over HTTP.

The front runs as its own process (``kvstack serve --scheduler ADDR``) so that
a crash is seen as one. A 5xx reply is an internal error; no reply within the
timeout is a hang. After each batch the stack's checks run
(:class:`tests.fuzz.targets.SchedulerTarget`), and a legitimate greedy
``/generate`` must give the tokens it gave before the run.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvstack.stack.launch import Launcher
from kvstack.stack.process import REPO
from memsvc.lifeline import child_env
from tests.fuzz.http_gen import HttpMessages, HttpRequest
from tests.fuzz.scheduler_gen import LEGIT_PROMPT
from tests.fuzz.targets import SchedulerTarget


class HttpChannel:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.conn: http.client.HTTPConnection | None = None

    def send(self, message: HttpRequest, timeout_s: float) -> list[dict[str, Any]] | None:
        method, path, body, content_type = message
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        try:
            self.conn.request(method, path, body=body, headers={"Content-Type": content_type})
            response = self.conn.getresponse()
            data = response.read()
        except (TimeoutError, OSError, http.client.HTTPException):
            self.reset()
            return None
        text = data[:300].decode(errors="replace")
        status = response.status
        code = "ok" if status < 400 else ("internal" if status >= 500 else str(status))
        reply = {"ok": status < 400, "code": code, "message": text or f"HTTP {status}"}
        return [{**reply, "body": data}]

    def reset(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = None

    def close(self) -> None:
        self.reset()


class HttpTarget:
    name = "http"

    def __init__(
        self, launcher: Launcher, checkpoint: Path, stack: SchedulerTarget | None = None
    ) -> None:
        """``stack``: a running one to front (left running by :meth:`close`)."""
        self.owns_stack = stack is None
        self.stack = stack or SchedulerTarget(launcher, checkpoint)
        workdir = launcher.workdir
        ready = workdir / "serve-fuzz.ready"
        command = [sys.executable, "-m", "kvstack.cli", "serve", "--scheduler"]
        command += [self.stack.address, "--port", "0", "--ready-file", str(ready)]
        command += ["--log-level", "WARNING"]
        with open(workdir / "serve-fuzz.log", "ab") as log:
            self.proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env={**os.environ, **child_env()},
            )
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError((workdir / "serve-fuzz.log").read_text())
            time.sleep(0.05)
        self.url = json.loads(ready.read_text())["address"]
        self.messages = HttpMessages()
        self.before = self._legit_output()

    def _legit_output(self) -> Any:
        body = {"input_ids": LEGIT_PROMPT, "sampling_params": {"max_new_tokens": 12}}
        body["sampling_params"]["ignore_eos"] = True
        replies = HttpChannel(self.url).send(
            ("POST", "/generate", json.dumps(body).encode(), ""), 60
        )
        if not replies or not replies[0]["ok"]:
            return f"legit /generate failed: {replies}"
        return json.loads(replies[0]["body"]).get("output_ids")

    def channel(self) -> HttpChannel:
        return HttpChannel(self.url)

    def alive(self) -> bool:
        return self.proc.poll() is None and self.stack.alive()

    def end_batch(self, channel: HttpChannel) -> None:
        pass

    def problems(self) -> list[str]:
        found = self.stack.problems()
        after = self._legit_output()
        if after != self.before:
            found.append(f"legit /generate gave {after}, before {self.before}")
        return found

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.owns_stack:
            self.stack.close()
