"""SIGTERM and SIGINT drain the server: at a random moment, with requests queued, streaming
and compiling, every client gets a 200 or an OpenAI-shaped error (a stream ends with an
error event, then `data: [DONE]`), and the process exits with status 0 within the drain
bound, without a traceback."""

import http.client
import json
import random
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

import packed_ss_jax as ps
from servers import events, is_openai_error, request, running

DRAIN = 2.0
EXIT_BOUND = DRAIN + 5   # the drain, then uvicorn closing and the decoder thread let go


def _body(i: int) -> dict:
    body = {"model": "nld-tiny", "prompt": f"Question: Ava has {i} apples. How many?",
            "max_tokens": 300, "temperature": 0}
    if i % 4 == 3:  # a temperature of its own: its sampled program compiles
        body.update(temperature=0.3 + i / 100, seed=i)
    return body


def _client(base: str, i: int, out: dict) -> None:
    try:
        if i % 2:
            out[i] = ("stream",) + events(base, "/v1/completions", {**_body(i), "stream": True},
                                          timeout=60)
        else:
            out[i] = ("plain",) + request(base, "POST", "/v1/completions", _body(i), timeout=60)
    except Exception as e:  # noqa: BLE001 - recorded, the test says which client failed how
        out[i] = ("failed", repr(e), None)


def _well_ended(kind: str, code: int, body) -> bool:
    if kind == "plain":
        return (code == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")) or \
               (code == 503 and is_openai_error(body))
    if kind == "stream" and code == 200:
        if not body or body[-1] != "[DONE]":
            return False
        last = body[-2]
        return is_openai_error(last) or last["choices"][0]["finish_reason"] is not None
    return kind == "stream" and code == 503 and is_openai_error(body[0])


@pytest.mark.parametrize("seed,sig", [(0, signal.SIGTERM), (1, signal.SIGINT), (2, signal.SIGTERM)])
def test_a_signal_at_a_random_moment_drains(seed, sig):
    rng = random.Random(seed)
    with running("--drain-timeout", str(DRAIN)) as server:
        out: dict = {}
        clients = [threading.Thread(target=_client, args=(server.base, i, out))
                   for i in range(12)]
        for c in clients:
            c.start()
        time.sleep(0.3 + rng.uniform(0, 2.0))
        server.proc.send_signal(sig)
        start = time.monotonic()
        # While draining, a new request is refused at once.
        try:
            code, body = request(server.base, "POST", "/v1/completions", _body(0), timeout=5)
            assert code == 503 and is_openai_error(body), body
        except OSError:
            pass  # the listening socket is already closed
        for c in clients:
            c.join(timeout=60)
        assert server.proc.wait(timeout=EXIT_BOUND) == 0, server.output[-3000:]
        took = time.monotonic() - start
    assert took < EXIT_BOUND
    bad = {i: r for i, r in out.items() if not _well_ended(*r)}
    assert len(out) == 12 and not bad, bad
    assert "Traceback" not in server.output and "Error" not in server.output, server.output


def test_after_a_drain_nothing_is_left_running():
    with running("--drain-timeout", str(DRAIN)) as server:
        assert request(server.base, "GET", "/health")[0] == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=EXIT_BOUND) == 0
    assert "stopped" in server.output


LOOP = ("{%- if messages[0]['content'] == 'loop' %}{% for i in range(100000) %}"
        "{% for j in range(100000) %}{% endfor %}{% endfor %}{%- else %}")


def test_requests_still_preparing_or_uploading_get_a_503_at_the_deadline(tmp_path):
    """A chat template still rendering, a body still arriving: at the drain's deadline
    each gets an OpenAI-shaped 503, not uvicorn's plain-text 500."""
    model = tmp_path / "nld-tiny"
    shutil.copytree(Path(ps.__file__).parent / "embedded" / "nld-tiny", model)
    template = model / "chat_template.jinja"
    template.write_text(LOOP + template.read_text() + "{%- endif %}")
    with running("--model", str(model), "--drain-timeout", "1") as server:
        out: dict = {}
        body = {"model": "nld-tiny", "messages": [{"role": "user", "content": "loop"}]}
        rendering = threading.Thread(target=lambda: out.update(
            chat=request(server.base, "POST", "/v1/chat/completions", body, timeout=30)))
        rendering.start()
        host, port = server.base.removeprefix("http://").split(":")
        upload = socket.create_connection((host, int(port)), timeout=30)
        upload.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       b"application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        reply = b""
        while chunk := upload.recv(65536):  # the whole reply, then the server closes
            reply += chunk
        upload.close()
        rendering.join(timeout=30)
        assert server.proc.wait(timeout=EXIT_BOUND) == 0, server.output[-3000:]
    assert time.monotonic() - start < EXIT_BOUND
    code, chat = out["chat"]
    assert code == 503 and is_openai_error(chat), chat
    head, _, rest = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and is_openai_error(json.loads(rest)), reply
    assert "Traceback" not in server.output, server.output


def test_a_request_on_an_idle_keep_alive_connection_while_draining_gets_a_json_503():
    with running("--drain-timeout", str(DRAIN)) as server:
        host, port = server.base.removeprefix("http://").split(":")
        idle = http.client.HTTPConnection(host, int(port), timeout=30)
        idle.request("GET", "/health")
        first = idle.getresponse()
        assert first.status == 200 and first.read()
        # A body still arriving keeps a request in flight until the drain's deadline.
        upload = socket.create_connection((host, int(port)), timeout=30)
        upload.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       b"application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        idle.request("POST", "/v1/completions", body=json.dumps(_body(2)).encode(),
                     headers={"content-type": "application/json"})
        reply = idle.getresponse()
        assert reply.status == 503 and is_openai_error(json.loads(reply.read()))
        idle.close()
        upload.close()
        assert server.proc.wait(timeout=EXIT_BOUND) == 0, server.output[-3000:]
    assert "Traceback" not in server.output, server.output
