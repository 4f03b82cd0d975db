"""`packed-ss serve` as a real process on 127.0.0.1, through the official `openai` client:
completions and chat completions, streamed and not, give `decode`'s tokens; 32 concurrent
requests all come back right; bad requests get a 4xx with an OpenAI-style error body; a
client leaving mid-stream frees the decoder; SIGINT (Ctrl-C) stops the server cleanly.
In process: a request is checked, its chat template rendered and its prompt tokenized
once, and the decoder runs that checked request."""

import concurrent.futures
import http.client
import itertools
import json
import signal
import time

import pytest

import packed_ss_jax as ps
from packed_ss_jax import chat, options
from packed_ss_jax.model import Model
from packed_ss_jax.server import create_app
from servers import events, in_process, request, running

openai = pytest.importorskip("openai")

MODEL = ps.load()
MAX_TOKENS = 12


def _http(base: str, method: str, path: str, body=None, timeout: float = 60):
    return request(base, method, path, body, timeout=timeout)


def _health(base: str) -> dict:
    return _http(base, "GET", "/health", timeout=5)[1]


@pytest.fixture(scope="module")
def server():
    with running() as s:
        yield s.proc, s.base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", timeout=120)


def _question(i: int) -> str:
    return f"Question: Ava has {i} apples. She gets {i + 3} more apples. How many?\nAnswer:"


def _decode(**kw):
    return ps.decode(MODEL, max_new_tokens=MAX_TOKENS, **kw)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["nld-tiny"]
    assert _health(server[1])["status"] == "ok"


def test_completions_streamed_and_not(client):
    want = _decode(prompt=_question(2))
    r = client.completions.create(model="nld-tiny", prompt=_question(2), max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert r.choices[0].text == want.text
    assert r.model_extra["packed_ss"]["token_ids"] == want.tokens
    assert r.usage.completion_tokens == len(want.tokens)
    assert r.usage.prompt_tokens == len(MODEL.tokenizer.encode(_question(2)).ids)
    assert r.model_extra["packed_ss"]["nfe"] == want.nfe
    assert r.choices[0].finish_reason == want.finish_reason == "length"
    events = list(client.completions.create(model="nld-tiny", prompt=_question(2),
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert "".join(e.choices[0].text for e in events) == want.text
    assert events[-1].model_extra["packed_ss"]["token_ids"] == want.tokens
    assert events[-1].choices[0].finish_reason == want.finish_reason


def test_chat_streamed_and_not_with_a_stop(client):
    messages = [{"role": "user", "content": "Ava has 3 apples. She gets 4 more. How many?"}]
    want = _decode(messages=messages)
    r = client.chat.completions.create(model="nld-tiny", messages=messages,
                                       max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == want.text
    assert r.model_extra["packed_ss"]["token_ids"] == want.tokens
    events = list(client.chat.completions.create(model="nld-tiny", messages=messages,
                                                 max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True))
    assert "".join(e.choices[0].delta.content or "" for e in events) == want.text
    # A stop string: the text ends before it (OpenAI semantics), finish_reason "stop".
    stop = want.text[len(want.text) // 2: len(want.text) // 2 + 2]
    cut = want.text[: want.text.find(stop)]
    for stream in (False, True):
        r = client.chat.completions.create(model="nld-tiny", messages=messages, stop=[stop],
                                           max_tokens=MAX_TOKENS, temperature=0, stream=stream)
        if stream:
            r = list(r)
            assert "".join(e.choices[0].delta.content or "" for e in r) == cut
            assert r[-1].choices[0].finish_reason == "stop"
        else:
            assert (r.choices[0].message.content, r.choices[0].finish_reason) == (cut, "stop")


def test_32_concurrent_requests(client):
    prompts = [_question(i) for i in range(32)]
    want = {p: _decode(prompt=p).text for p in prompts}

    def ask(i):
        p = prompts[i]
        if i % 2:
            return p, "".join(e.choices[0].text for e in client.completions.create(
                model="nld-tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0, stream=True))
        return p, client.completions.create(model="nld-tiny", prompt=p, max_tokens=MAX_TOKENS,
                                            temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = dict(pool.map(ask, range(32)))
    assert got == want


BAD = [
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/completions", b'{"model": "nld-tiny", "prompt": ', 400, None),
    ("/v1/completions", {"model": "nld-tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": "nld-tiny", "prompt": "x", "max_tokens": 10**12}, 400,
     "max_tokens"),
    ("/v1/completions", {"model": "nld-tiny", "prompt": "apples " * 1200, "max_tokens": 4}, 400,
     None),
    ("/v1/completions", {"model": "nld-tiny", "prompt": "x", "temperature": "hot"}, 400,
     "temperature"),
    ("/v1/completions", {"model": "nld-tiny", "prompt": "x", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"model": "nld-tiny", "prompt": [1, 99999]}, 400, None),
    ("/v1/completions", {"model": "nld-tiny", "prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"model": "nld-tiny"}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "nld-tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "nld-tiny", "messages": [{"content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"model": "nld-tiny", "messages": [{"role": "robot",
                                                                 "content": "x"}]}, 400, None),
    ("/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_requests_get_4xx_with_an_openai_error(server, path, body, status, param):
    code, reply = _http(server[1], "POST", path, body)
    assert code == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


def _cancelled_choices(base: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = _http(base, "GET", "/metrics")[1]
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "packed_ss_requests_total" and s.labels["outcome"] == "cancelled")


def test_a_client_leaving_mid_stream_frees_the_decoder(server, client):
    base = server[1]
    before, choices_before = _health(base)["cancelled"], _cancelled_choices(base)
    body = {"model": "nld-tiny", "prompt": _question(1), "max_tokens": 600, "temperature": 0,
            "stream": True, "n": 3}
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"content-type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        while b'"text": "' not in r.readline():  # leave after the first piece of text
            pass
    finally:
        conn.close()
    deadline = time.monotonic() + 30
    while _health(base)["cancelled"] == before:
        assert time.monotonic() < deadline, "the abandoned request was never cancelled"
        time.sleep(0.05)
    # One request, its three choices each counted by /metrics.
    assert _health(base)["cancelled"] == before + 1
    assert _cancelled_choices(base) == choices_before + 3
    # The decoder is free: the next request is served.
    r = client.completions.create(model="nld-tiny", prompt=_question(2), max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert r.choices[0].text == _decode(prompt=_question(2)).text


class _CountingTokenizer:
    """The model's tokenizer, recording the texts it encodes (every tokenization in the
    package goes through `encode_batch`)."""

    def __init__(self, tokenizer):
        self._tokenizer, self.texts = tokenizer, []

    def encode_batch(self, texts, **kwargs):
        self.texts += list(texts)
        return self._tokenizer.encode_batch(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_a_request_is_checked_rendered_and_tokenized_once(monkeypatch):
    tokenizer = _CountingTokenizer(MODEL.tokenizer)
    model = Model(config=MODEL.config, params=MODEL.stored_params, tokenizer=tokenizer,
                  source=MODEL.source)
    checked, streamed, renders = [], [], []

    def prepare(*args, **kwargs):
        checked.append(prepare.real(*args, **kwargs))
        return checked[-1]

    def prefill(self, requests, *args, **kwargs):
        streamed.extend(requests)
        return prefill.real(self, requests, *args, **kwargs)

    def render(self, *args, **kwargs):
        renders.append(args[0])
        return render.real(self, *args, **kwargs)

    prepare.real, prefill.real, render.real = (
        options.request, ps.Engine.prefill, chat.ChatTemplate.render)
    monkeypatch.setattr(options, "request", prepare)
    monkeypatch.setattr(ps.Engine, "prefill", prefill)
    monkeypatch.setattr(chat.ChatTemplate, "render", render)
    stop = "Question:"
    common = {"model": "nld-tiny", "max_tokens": 4, "temperature": 0, "stop": [stop]}
    asks = {"/v1/completions": {**common, "prompt": _question(5)},
            "/v1/chat/completions": {**common, "messages": [{"role": "user",
                                                             "content": _question(5)}]}}
    app = create_app(model, "nld-tiny", max_model_len=64, slots=2)
    with in_process(app) as base:
        for (path, body), streaming in itertools.product(asks.items(), (False, True)):
            for seen in (checked, streamed, renders, tokenizer.texts):  # not the warm-up's
                seen.clear()
            if streaming:
                code, got = events(base, path, {**body, "stream": True})
                assert got[-1] == "[DONE]" and "error" not in got[-2], got
            else:
                code, got = request(base, "POST", path, body)
            assert code == 200, got
            is_chat = path == "/v1/chat/completions"
            # One check (options.request), and the decoder starts exactly that request,
            # on the slots' sampled program (its temperature 0 is data there).
            assert len(checked) == 1 and len(streamed) == 1
            s, c = streamed[0], checked[0]
            assert s.prompt is c.prompt and s.limits is c.limits and s.seed == c.seed
            assert s.program == options.on_sampled_program(c).program != c.program
            # The template rendered once (chat only); the prompt and the stop string
            # tokenized once each.
            assert len(renders) == (1 if is_chat else 0)
            assert len(tokenizer.texts) == 2 and tokenizer.texts[1] == stop, tokenizer.texts
            if is_chat:  # the rendered conversation
                assert _question(5) in tokenizer.texts[0] != _question(5)
            else:
                assert tokenizer.texts[0] == _question(5)


def test_ctrl_c_stops_the_server(server):
    proc, base = server
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
