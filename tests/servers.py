"""`packed-ss serve` as a real process for the server tests: started on a free port (read
back from its "serving ... on http://host:port/v1" line), its output collected, always
stopped; and a plain HTTP client (the standard library's, so that malformed, oversized or
half-sent requests can be sent as they are)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVING = re.compile(r"serving \S+ on http://(\S+):(\d+)/v1")


class Server:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: list[str] = []
        self.base: str | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            self.lines.append(line)
            m = SERVING.search(line)
            if m and self.base is None:
                self.base = f"http://{m.group(1)}:{m.group(2)}"
                self._ready.set()
        self._ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float) -> None:
        self._ready.wait(timeout)
        if self.base is None:
            raise RuntimeError(f"the server did not start:\n{self.output[-3000:]}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if request(self.base, "GET", "/health", timeout=2)[0] == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"the server does not answer:\n{self.output[-3000:]}")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return code


@contextlib.contextmanager
def running(*args: str, timeout: float = 180, env: dict | None = None):
    """A `packed-ss serve --port 0 ARGS` process (`env`: more environment), ready;
    killed on the way out. Its programs are kept whole in the run's compilation cache
    (executables.py), so the servers after the first of a kind read theirs back rather
    than tracing and lowering each again (a test's `env` may say otherwise)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PACKED_SS_EXECUTABLES": "on", **(env or {})}
    env.pop("PACKED_SS_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "packed_ss_jax", "serve", "--port", "0",
                             *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    server = Server(proc)
    try:
        server.wait_ready(timeout)
        yield server
    finally:
        server.stop()


def request(base: str, method: str, path: str, body=None, headers=None,
            timeout: float = 60) -> tuple[int, object]:
    """(status, the JSON body or the raw text) of one request."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    try:
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body).encode()
        conn.request(method, path, body=body,
                     headers={"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
        try:
            return r.status, json.loads(raw or b"null")
        except ValueError:
            return r.status, raw.decode(errors="replace")
    finally:
        conn.close()


def events(base: str, path: str, body: dict, headers=None, timeout: float = 60):
    """(status, the `data:` payloads of a streamed response, in order)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        if r.status != 200:
            return r.status, [json.loads(r.read() or b"null")]
        out = []
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: "):]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
        return r.status, out
    finally:
        conn.close()


def is_openai_error(body) -> bool:
    """An OpenAI-shaped error body: {"error": {"message", "type", "param", "code"}}."""
    return (isinstance(body, dict) and isinstance(body.get("error"), dict)
            and set(body["error"]) == {"message", "type", "param", "code"}
            and isinstance(body["error"]["message"], str) and body["error"]["message"] != "")


@contextlib.contextmanager
def in_process(app):
    """An app (`create_app`) served by uvicorn on a thread of this process, so that a
    test's wrappers see the server's calls; its base URL. Stopped on the way out."""
    import uvicorn

    from packed_ss_jax.server import bind

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the app did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
