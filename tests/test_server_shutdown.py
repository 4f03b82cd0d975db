"""SIGTERM and SIGINT drain the server: at a random moment, with requests queued, streaming
and compiling, every client gets a 200 or an OpenAI-shaped error (a stream ends with an
error event, then `data: [DONE]`), and the process exits with status 0 within the drain
bound, without a traceback."""

import random
import signal
import threading
import time

import pytest

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
