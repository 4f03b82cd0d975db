"""A fuzz run of the server's endpoints: hypothesis draws request bodies over the API's
schema (each field valid, absent, of the wrong type, at or past its bounds; strings with
lone surrogates; raw bytes that are not JSON) and every answer must be a 200 with tokens
inside the vocabulary or an OpenAI-shaped 4xx error, within the time limit: no 500, no
hang. The run is bounded (examples, and derandomized so that CI sees the same ones)."""

import json
import math

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import packed_ss_jax as ps
from servers import events, is_openai_error, request, running

VOCAB = ps.load().vocab_size
TIMEOUT = 60
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

# Any code point, lone surrogates included (what a "\ud800" escape in JSON decodes to).
ANY_TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF,
                                 exclude_categories=()), max_size=40)
INTS = st.one_of(st.integers(-3, 10), st.integers(-2**80, 2**80),
                 st.sampled_from([2**31 - 1, 2**31, 2**32, 2**63, 2**64]))
JUNK = st.one_of(st.none(), st.booleans(), ANY_TEXT, st.floats(), st.lists(st.integers(),
                                                                            max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
# Decoding settings that reach the model: few enough that compiles stay bounded.
TEMPERATURE = st.one_of(st.sampled_from([0, 0.0, 0.7]), st.floats(allow_nan=True).filter(
    lambda v: not 0 <= v <= 100 or math.isnan(v)), JUNK)
TOP_P = st.one_of(st.sampled_from([1.0, 1e-45, 5e-324]), st.floats().filter(
    lambda v: not 0 < v <= 1), JUNK)
PROMPT = st.one_of(st.sampled_from(["Question: Ava has 3 apples.", "x", " "]), ANY_TEXT,
                   st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
                   st.lists(INTS, max_size=5), JUNK)
STOP = st.one_of(ANY_TEXT, st.lists(ANY_TEXT, max_size=6), JUNK)


def _fields(**required):
    optional = {"max_tokens": st.one_of(st.integers(1, 6), INTS, JUNK), "temperature": TEMPERATURE,
                "top_p": TOP_P, "seed": st.one_of(INTS, JUNK), "stop": STOP,
                "n": st.one_of(st.just(1), INTS, JUNK), "stream": st.one_of(st.booleans(), JUNK),
                "logprobs": JUNK, "user": ANY_TEXT}
    return st.fixed_dictionaries(required, optional=optional)


MODEL_NAME = st.one_of(st.just("nld-tiny"), ANY_TEXT, JUNK)
MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system",
                                                                    "assistant"]), ANY_TEXT,
                                                   JUNK),
                                 "content": st.one_of(ANY_TEXT, JUNK)},
                                optional={"name": ANY_TEXT})
# Bodies that pass validation and decode, with values at their edges.
TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
SETTINGS = dict(model=st.just("nld-tiny"), max_tokens=st.integers(1, 6),
                temperature=st.sampled_from([0, 0.7]), top_p=st.sampled_from([1.0, 1e-45]),
                seed=st.integers(0, 2**32 - 1), stop=st.lists(TEXT, max_size=4),
                stream=st.booleans())
DECODING = st.fixed_dictionaries({"prompt": st.one_of(TEXT, st.lists(
    st.integers(0, VOCAB - 1), min_size=1, max_size=8)), **SETTINGS})
CHATTING = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": TEXT}), min_size=1,
    max_size=3), **SETTINGS})
COMPLETION = st.one_of(_fields(model=MODEL_NAME, prompt=PROMPT), DECODING)
CHAT = st.one_of(_fields(model=MODEL_NAME, messages=st.one_of(st.lists(MESSAGE, max_size=3),
                                                              JUNK),
                         chat_template_kwargs=st.one_of(st.none(), st.dictionaries(
                             ANY_TEXT, JUNK, max_size=3))), CHATTING)


@pytest.fixture(scope="module")
def server():
    with running("--max-model-len", "128") as s:
        yield s


def _check(server, path: str, body) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    streamed = isinstance(body, dict) and body.get("stream") is True
    if streamed:
        code, items = events(server.base, path, body, timeout=TIMEOUT)
    else:
        code, reply = request(server.base, "POST", path, raw, timeout=TIMEOUT)
        items = [reply]
    event(f"status {code}")
    assert code in (200, 400, 404, 413), (code, items)
    if code != 200:
        assert is_openai_error(items[0]), items
        return
    if streamed:
        assert items[-1] == "[DONE]", items
        last = items[-2]
        assert "error" in last or last["choices"][0]["finish_reason"] is not None, items
        final = last
    else:
        final = items[0]
    ids = final.get("packed_ss", {}).get("token_ids", [])
    assert all(0 <= t < VOCAB for t in ids), ids


@FUZZ
@given(body=COMPLETION)
@example(body={"model": "nld-tiny", "prompt": "x", "top_p": 1e-45, "temperature": 0.7})
@example(body={"model": "nld-tiny", "prompt": [2**70]})
def test_completions_fuzz(server, body):
    _check(server, "/v1/completions", body)


@FUZZ
@given(body=CHAT)
@example(body={"model": "nld-tiny", "messages": [{"role": "user", "content": "\ud800"}]})
@example(body={"model": "nld-tiny", "messages": [{"role": "user", "content": "x"}],
               "chat_template_kwargs": {"messages": "x", "add_generation_prompt": []}})
def test_chat_fuzz(server, body):
    _check(server, "/v1/chat/completions", body)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.binary(max_size=200), st.integers(1, 5000).map(
    lambda n: b"[" * n + b"]" * n), st.integers(1, 5000).map(
    lambda n: b'{"model": "nld-tiny", "prompt": ' + b"[" * n + b"]" * n + b"}")))
@example(raw=b"\xff\xfe{}")
@example(raw=b'{"model": "nld-tiny", "prompt": "\\ud800"}')
@example(raw=b'{"model": "nld-tiny", "prompt": "x", "max_tokens": NaN}')
def test_raw_bodies_fuzz(server, raw):
    _check(server, "/v1/completions", raw)


def test_the_server_is_well_after_the_fuzz(server):
    code, body = request(server.base, "GET", "/health", timeout=2)
    assert code == 200 and body["status"] == "ok"
    assert "Traceback" not in server.output, server.output[-3000:]
