"""A server that listens before its programs are ready (`create_app(warm=False)`, what
`packed-ss serve` does): `/health` answers 503 "starting" until they are, requests sent
meanwhile wait and get `decode`'s tokens; a warm-up that fails makes `/health` say
"failed" with the error, answers waiting and new requests with 503, and stops the
server."""

import concurrent.futures
import functools
import re
import threading
import time

import pytest

import packed_ss_jax as ps
from packed_ss_jax.client import EngineClient
from packed_ss_jax.server import bind, create_app, serve
from packed_ss_jax.server.http_guard import Limits
from servers import in_process, request

MODEL = ps.load()
PROMPT = "Question: Ava has 3 apples. She gets 4 more. How many?\nAnswer:"


def _app(**kw):
    return create_app(MODEL, "nld-tiny", max_model_len=64, slots=2, warm=False, **kw)


def test_health_is_starting_until_ready_and_requests_wait(monkeypatch):
    release = threading.Event()
    tasks = EngineClient._tasks

    def after_release(task):
        assert release.wait(120)
        task()

    def held(self, *args):
        return [functools.partial(after_release, t) for t in tasks(self, *args)]

    monkeypatch.setattr(EngineClient, "_tasks", held)
    told = []
    with in_process(_app(on_ready=told.append)) as base:
        code, body = request(base, "GET", "/health")
        assert code == 503 and body["status"] == "starting", body
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            asked = pool.submit(request, base, "POST", "/v1/completions",
                                {"model": "nld-tiny", "prompt": PROMPT, "max_tokens": 8,
                                 "temperature": 0}, timeout=300)
            _until_queued(base, 1)
            release.set()
            code, body = asked.result(timeout=300)
        assert code == 200, body
        want = ps.decode(MODEL, PROMPT, max_new_tokens=8)
        assert body["packed_ss"]["token_ids"] == want.tokens
        code, health = request(base, "GET", "/health")
        assert code == 200 and health["status"] == "ok"
    assert told == [None]


def _until_queued(base: str, n: int) -> None:
    for _ in range(600):
        if request(base, "GET", "/health")[1]["queued"] == n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{n} requests never queued")


def _failing(monkeypatch, hold: threading.Event | None = None):
    def fail():
        assert hold is None or hold.wait(120)
        raise RuntimeError("no room for the programs")

    monkeypatch.setattr(EngineClient, "_tasks", lambda self, *args: [fail])


def test_a_failed_warm_up_is_reported_and_refuses_requests(monkeypatch):
    _failing(monkeypatch)
    told = []
    settled = threading.Event()
    with in_process(_app(on_ready=lambda e: (told.append(e), settled.set()))) as base:
        assert settled.wait(120)
        code, body = request(base, "GET", "/health")
        assert code == 503 and body["status"] == "failed", body
        assert "no room for the programs" in body["error"]
        code, body = request(base, "POST", "/v1/completions",
                             {"model": "nld-tiny", "prompt": PROMPT, "max_tokens": 4})
        assert code == 503, body
    assert len(told) == 1 and isinstance(told[0], RuntimeError)


def test_a_request_waiting_when_the_warm_up_fails_gets_503(monkeypatch):
    release = threading.Event()
    _failing(monkeypatch, release)
    with in_process(_app()) as base:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            asked = pool.submit(request, base, "POST", "/v1/completions",
                                {"model": "nld-tiny", "prompt": PROMPT, "max_tokens": 4},
                                timeout=120)
            _until_queued(base, 1)
            release.set()
            code, body = asked.result(timeout=120)
    assert code == 503 and "the server failed to start" in body["error"]["message"], body


def test_serve_stops_when_the_warm_up_fails(monkeypatch):
    _failing(monkeypatch)
    sock = bind("127.0.0.1", 0)
    try:
        app = _app()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            ended = pool.submit(serve, app, sock, Limits(drain_timeout_s=1))
            assert ended.result(timeout=120) is True   # stopped by itself, threads ended
        assert app.app.state.decoder.failed is not None
    finally:
        sock.close()


def test_a_state_that_cannot_fit_is_refused_before_listening():
    with pytest.raises(ps.InputError, match="max-model-len|max-num-seqs"):
        create_app(MODEL, "nld-tiny", max_model_len=MODEL.config.max_position_embeddings,
                   slots=10**6, warm=False)


def test_warmup_only_makes_the_programs_ready_and_exits(tmp_path, monkeypatch, capsys,
                                                        run_compile_cache):
    """`packed-ss serve --warmup-only`: a deployment's build step fills the cache, and
    a second run reads every program from it; neither listens."""
    from packed_ss_jax import cli, compile_cache, programs

    monkeypatch.setenv(compile_cache.EXECUTABLES_ENV, "on")
    argv = ["serve", "--warmup-only", "--max-model-len", "32", "--compile-cache",
            str(tmp_path / "cache")]
    try:
        for read in (False, True):
            programs.clear_programs()
            assert cli.main(argv) == 0
            err = capsys.readouterr().err
            assert "ready in" in err and "serving" not in err, err
            assert ("read from disk" in err) == read, err
            # a cold warm-up tells each program it compiled, counted against the whole
            compiled = [line for line in err.splitlines() if line.endswith(" ready)")]
            assert bool(compiled) != read, err
            if not read:
                total = int(re.search(r"ready in [\d.]+ s: (\d+) programs", err)[1])
                assert any(c.endswith(f"({total} of {total} ready)") for c in compiled), err
    finally:
        programs.clear_programs()
        compile_cache.set_compile_cache(run_compile_cache)
