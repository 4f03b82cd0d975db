"""The server's continuous batching (client.py: the engine client and its scheduler), through the official `openai`
client against an app served in this process: requests joining and leaving while others
run each get the tokens `decode` gives them alone (greedy, sampled and top-p, streamed
and not, advancing in the same calls; SetDLM too); nothing compiles after startup, whatever the requests ask for; `n` choices are
the decodes of consecutive seeds; a request without a seed gets a fresh one; chat's
default length is what fits; `stream_options.include_usage` ends a stream with the
usage; a request past --max-model-len is refused with the limit; a field the server
would not act on is refused; past --max-queue a 503; a client that leaves frees its
slot; /metrics parses; the API key is needed, and a CORS preflight passes without it;
logprobs, streamed or not, are the AR model's."""

import concurrent.futures
import http.client
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax.server.http_guard import Limits
from packed_ss_jax.server import create_app
from servers import events, in_process, request as plain_request

openai = pytest.importorskip("openai")

MODEL = ps.load()
MAX_MODEL_LEN = 96
SLOTS = 3   # fewer than the requests sent at once: some wait for a slot to free
KEY, ORIGIN = "secret", "http://localhost:3000"
AUTH = {"Authorization": f"Bearer {KEY}"}


def request(base, method, path, body=None, headers=None):
    return plain_request(base, method, path, body, {**AUTH, **(headers or {})})


def _question(i: int) -> str:
    return f"Question: Ava has {i} apples. She gets {i + 3} more apples. How many?\nAnswer:"


# (sampling, max_tokens) per request: greedy, sampled and top-p, lengths that make
# requests end at different launches, so that others join mid-flight.
def _asked(i: int) -> dict:
    kind = [dict(temperature=0), dict(temperature=1.0, seed=100 + i),
            dict(temperature=0.7, top_p=0.8, seed=200 + i)][i % 3]
    return dict(kind, max_tokens=6 + 5 * (i % 4))


@pytest.fixture(scope="module")
def app():
    return create_app(MODEL, "nld-tiny", max_model_len=MAX_MODEL_LEN, slots=SLOTS, steps=2,
                      limits=Limits(api_key=KEY, allowed_origins=(ORIGIN,)))


@pytest.fixture(scope="module")
def base(app):
    with in_process(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=120)


def _alone(prompt, asked: dict, seed=None) -> ps.DecodeResult:
    kw = {k: v for k, v in asked.items() if k not in ("max_tokens", "seed")}
    seed = asked.get("seed", 0) if seed is None else seed
    return ps.decode(MODEL, prompt, max_new_tokens=asked["max_tokens"], seed=seed, **kw)


def _ask(client, i: int, streamed: bool) -> list[int]:
    asked = _asked(i)
    if streamed:
        got = list(client.completions.create(model="nld-tiny", prompt=_question(i),
                                             stream=True, **asked))
        return got[-1].model_extra["packed_ss"]["token_ids"], "".join(
            e.choices[0].text for e in got)
    r = client.completions.create(model="nld-tiny", prompt=_question(i), **asked)
    return r.model_extra["packed_ss"]["token_ids"], r.choices[0].text


class _Compiles:
    """Counts XLA compiles (and persistent-cache reads) while it is on."""

    def __init__(self):
        self.on, self.events = False, []
        jax.monitoring.register_event_duration_secs_listener(self._seen)

    def _seen(self, name, secs, **kw):
        if self.on and name in ("/jax/core/compile/backend_compile_duration",
                                "/jax/compilation_cache/cache_retrieval_time_sec"):
            self.events.append(name)


COMPILES = _Compiles()


def _kind(request) -> str:
    t, p = (float(request.limits[k]) for k in ("temperature", "top_p"))
    return "greedy" if t == 0 else "top-p" if p < 1 else "sampled"


def test_requests_joining_mid_flight_get_their_own_decode(client, app):
    n = 4 * SLOTS
    want = {i: _alone(_question(i), _asked(i)) for i in range(n)}  # compiled before the watch
    decoder, launches = app.app.state.decoder, []
    launch = decoder._launch

    def watched():   # the kinds of sampling of the slots each launch advances together
        launches.append({_kind(s.request) for s in decoder.scheduler.seats if s is not None})
        launch()

    decoder._launch, COMPILES.on = watched, True
    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            got = dict(zip(range(n), pool.map(lambda i: _ask(client, i, i % 2 == 1), range(n))))
    finally:
        COMPILES.on = False
        del decoder._launch
    for i in range(n):
        assert got[i] == (want[i].tokens, want[i].text), (i, _asked(i))
    # Requests of every kind and length, and nothing compiled while serving them.
    assert COMPILES.events == []
    # Greedy, sampled and top-p requests advanced in the same calls.
    assert {"greedy", "sampled", "top-p"} in launches, launches


def test_nothing_compiles_whatever_a_request_asks(client, base):
    COMPILES.on = True
    try:
        for i, (temperature, top_p) in enumerate([(0.3, None), (1.7, 0.35), (0.0, 0.9),
                                                  (0.95, 1.0), (1e-3, 0.01)]):
            client.completions.create(model="nld-tiny", prompt=_question(i), n=2,
                                      temperature=temperature, top_p=top_p, seed=i,
                                      max_tokens=1 + 7 * i, stop=["\n", str(i)])
        client.chat.completions.create(model="nld-tiny", messages=[
            {"role": "user", "content": "Maya has 12 apples. How many?"}], temperature=0.5,
            logprobs=True, top_logprobs=2)
        client.completions.create(model="nld-tiny", prompt=_question(1), max_tokens=0,
                                  echo=True, logprobs=1)
        client.completions.create(model="nld-tiny", prompt=[1] * (MAX_MODEL_LEN - 9),
                                  max_tokens=9, logprobs=5)
        longest = [1] * (MAX_MODEL_LEN - 4)  # the largest prompt bucket
        code, body = request(base, "POST", "/v1/completions",
                             {"model": "nld-tiny", "prompt": longest, "max_tokens": 4})
        assert code == 200, body
    finally:
        COMPILES.on = False
    assert COMPILES.events == []


def test_n_choices_are_the_decodes_of_consecutive_seeds(client):
    asked = dict(temperature=1.0, max_tokens=10, seed=7)
    r = client.completions.create(model="nld-tiny", prompt=_question(3), n=3, **asked)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert c.text == _alone(_question(3), asked, seed=7 + c.index).text
    assert r.usage.completion_tokens == sum(
        len(_alone(_question(3), asked, seed=7 + i).tokens) for i in range(3))


def test_without_a_seed_each_request_is_a_fresh_sample(client):
    texts = {client.completions.create(model="nld-tiny", prompt="Question:", temperature=1.0,
                                       max_tokens=12).choices[0].text for _ in range(3)}
    assert len(texts) > 1


def test_chat_answers_in_full_by_default(client):
    messages = [{"role": "user", "content": "Maya shares 12 apples equally among 3 friends. "
                                            "How many apples does each friend get?"}]
    r = client.chat.completions.create(model="nld-tiny", messages=messages, temperature=0)
    want = ps.decode(MODEL, messages=messages, max_new_tokens=MAX_MODEL_LEN - r.usage.prompt_tokens)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == "stop"   # EOS, not a default length


def test_usage_ends_a_stream_only_when_asked(base):
    body = {"model": "nld-tiny", "prompt": _question(1), "max_tokens": 5, "temperature": 0,
            "stream": True}
    code, got = events(base, "/v1/completions", body, AUTH)
    assert code == 200 and got[-1] == "[DONE]"
    assert all("usage" not in e for e in got[:-1])
    code, got = events(base, "/v1/completions",
                       {**body, "stream_options": {"include_usage": True}}, AUTH)
    assert code == 200 and got[-1] == "[DONE]"
    last = got[-2]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert all("usage" not in e for e in got[:-2])


def test_the_model_card_and_the_length_limit(base):
    code, card = request(base, "GET", "/v1/models/nld-tiny")
    assert code == 200 and card["id"] == "nld-tiny" and card["max_model_len"] == MAX_MODEL_LEN
    assert request(base, "GET", "/v1/models/other")[0] == 404
    code, body = request(base, "POST", "/v1/completions",
                         {"model": "nld-tiny", "prompt": _question(1), "max_tokens": 90})
    assert code == 400 and str(MAX_MODEL_LEN) in body["error"]["message"]
    assert "--max-model-len" in body["error"]["message"]


@pytest.mark.parametrize("field, value", [
    ("logprobs", 9), ("top_logprobs", 3), ("tools", [{"type": "function"}]), ("best_of", 3),
    ("presence_penalty", 0.5), ("logit_bias", {"5": 10}), ("suffix", "x"),
    ("response_format", {"type": "json_object"}), ("frequency", 1)])
def test_a_field_the_server_would_not_act_on_is_a_400_naming_it(base, field, value):
    body = {"model": "nld-tiny", "prompt": "Question:", "max_tokens": 2, field: value}
    code, got = request(base, "POST", "/v1/completions", body)
    assert code == 400 and got["error"]["param"] == field, got


def test_every_field_the_server_would_not_act_on_is_named(base):
    body = {"model": "nld-tiny", "prompt": "Question:", "max_tokens": 2, "colour": 1,
            "frequency": 2}
    code, got = request(base, "POST", "/v1/completions", body)
    assert code == 400 and got["error"]["param"] == "colour, frequency", got
    assert "'colour'" in got["error"]["message"] and "'frequency'" in got["error"]["message"]
    code, got = request(base, "POST", "/v1/completions", {**body, "best_of": 3})
    assert code == 400 and got["error"]["param"] == "best_of, colour, frequency", got
    assert got["error"]["code"] == "unsupported_parameter"


@pytest.mark.parametrize("path, field", [("/v1/completions", "prompt"),
                                         ("/v1/chat/completions", "messages")])
def test_stream_options_without_stream_is_a_400(base, path, field):
    body = {"model": "nld-tiny", "max_tokens": 2, "stream_options": {"include_usage": True},
            field: "Question:" if field == "prompt" else [{"role": "user", "content": "Hi"}]}
    code, got = request(base, "POST", path, body)
    assert code == 400 and got["error"]["param"] == "stream_options", got
    assert "stream: true" in got["error"]["message"]
    code, got = request(base, "POST", path, {**body, "stream_options": None})
    assert code == 200, got


def test_neutral_values_and_text_parts_are_accepted(client):
    r = client.chat.completions.create(
        model="nld-tiny", max_tokens=6, temperature=0, presence_penalty=0, logprobs=False,
        user="someone", messages=[{"role": "user", "content": [
            {"type": "text", "text": "Maya has 12 apples. "}, {"type": "text", "text": "How many?"}]}])
    want = ps.decode(MODEL, messages=[{"role": "user",
                                       "content": "Maya has 12 apples. How many?"}],
                     max_new_tokens=6)
    assert r.choices[0].message.content == want.text


def test_a_full_queue_gets_a_503_with_retry_after_and_a_client_leaving_frees_its_slot():
    app = create_app(MODEL, "nld-tiny", max_model_len=MAX_MODEL_LEN, slots=1, steps=1,
                     max_queue=1)
    decoder = app.app.state.decoder
    long = {"model": "nld-tiny", "prompt": [1, 5, 7], "max_tokens": 80, "temperature": 0}
    with in_process(app) as url:
        # One request decodes, one waits, the next is refused.
        host, port = url.removeprefix("http://").split(":")
        first = http.client.HTTPConnection(host, int(port), timeout=60)
        first.request("POST", "/v1/completions", body=json.dumps(long).encode(),
                      headers={"content-type": "application/json"})
        _until(lambda: decoder.busy_slots == 1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(plain_request, url, "POST", "/v1/completions",
                                  {**long, "max_tokens": 2})
            _until(lambda: decoder.queued == 1)
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps(long).encode(),
                         headers={"content-type": "application/json"})
            refused = conn.getresponse()
            assert refused.status == 503 and refused.getheader("Retry-After") == "1"
            assert json.loads(refused.read())["error"]["code"] == "queue_full"
            conn.close()
            # The first client leaves without reading its answer: its slot is freed and
            # the waiting request is served.
            first.close()
            assert waiting.result(timeout=60)[0] == 200
        assert decoder.cancelled == 1


def _until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_metrics_parse_and_count_what_was_served(base, client):
    from prometheus_client.parser import text_string_to_metric_families

    def read() -> dict:
        code, text = request(base, "GET", "/metrics")
        assert code == 200
        return {s.name: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if not s.labels or s.labels.get("outcome") == "length"}

    before = read()
    r = client.completions.create(model="nld-tiny", prompt=[1, 5, 7], max_tokens=9,
                                  temperature=0)
    after = read()
    assert after["packed_ss_generated_tokens_total"] - before["packed_ss_generated_tokens_total"] == 9
    nfe = r.model_extra["packed_ss"]["nfe"]
    assert after["packed_ss_forward_calls_total"] - before["packed_ss_forward_calls_total"] == nfe
    assert after["packed_ss_requests_total"] - before.get("packed_ss_requests_total", 0) == 1
    assert after["packed_ss_time_to_first_token_seconds_count"] > before.get(
        "packed_ss_time_to_first_token_seconds_count", 0)
    assert after["packed_ss_slots"] == SLOTS
    assert after["packed_ss_queue_length"] == 0 and after["packed_ss_slots_busy"] == 0


def test_the_key_is_needed_but_a_cors_preflight_passes(base):
    assert plain_request(base, "GET", "/v1/models")[0] == 401
    assert plain_request(base, "GET", "/metrics")[0] == 401
    assert plain_request(base, "GET", "/health")[0] == 200
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("OPTIONS", "/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        r = conn.getresponse()
        r.read()
        assert r.status == 200
        assert r.getheader("access-control-allow-origin") == ORIGIN
        assert "POST" in r.getheader("access-control-allow-methods")
    finally:
        conn.close()
    code, body = request(base, "GET", "/v1/models", headers={"Origin": ORIGIN})
    assert code == 200


def _ar_logp(ids: list[int]) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1, from one causal forward (`ps.logits`)."""
    T = len(ids)
    logits = ps.logits(MODEL, ids, np.arange(T), np.tril(np.ones((T, T), bool)))
    logp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    return np.asarray([logp[i - 1, ids[i]] for i in range(1, T)])


def test_logprobs_and_echo_are_the_ar_models(client):
    prompt = _question(4)
    ids = MODEL.tokenizer.encode(prompt).ids
    for temperature, seed in ((0, None), (1.0, 3)):
        r = client.completions.create(model="nld-tiny", prompt=prompt, max_tokens=8,
                                      temperature=temperature, seed=seed, logprobs=2)
        got = r.model_extra["packed_ss"]["token_ids"]
        lp = r.choices[0].logprobs
        want = _ar_logp(ids + got)[len(ids) - 1:]
        np.testing.assert_allclose(lp.token_logprobs, want, atol=1e-4)
        assert len(lp.top_logprobs) == len(got) and all(len(t) == 2 for t in lp.top_logprobs)
        if temperature == 0:  # greedy: each token is the most likely one
            assert all(max(t.values()) == pytest.approx(v, abs=1e-6)
                       for t, v in zip(lp.top_logprobs, lp.token_logprobs))
        # Streamed, the same tokens, logprobs and offsets, chunk by chunk.
        events = list(client.completions.create(model="nld-tiny", prompt=prompt, max_tokens=8,
                                                temperature=temperature, seed=seed, logprobs=2,
                                                stream=True))
        parts = [e.choices[0].logprobs for e in events if e.choices[0].logprobs]
        assert [t for p in parts for t in p.tokens] == lp.tokens
        assert [o for p in parts for o in p.text_offset] == lp.text_offset
        np.testing.assert_allclose([v for p in parts for v in p.token_logprobs],
                                   lp.token_logprobs, atol=1e-5)
    # echo with max_tokens 0: the prompt scored, nothing generated (lm-eval's loglikelihood)
    r = client.completions.create(model="nld-tiny", prompt=prompt, max_tokens=0, echo=True,
                                  logprobs=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == MODEL.tokenizer.decode(ids) and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids)
    np.testing.assert_allclose(lp.token_logprobs[1:], _ar_logp(ids), atol=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(r.choices[0].text) - len(lp.tokens[-1])


def test_chat_logprobs_and_what_is_refused_with_a_stream(client, base):
    messages = [{"role": "user", "content": "Maya has 12 apples. How many?"}]
    asked = dict(model="nld-tiny", messages=messages, max_tokens=12, temperature=0,
                 logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**asked)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [MODEL.tokenizer.decode([i]) for i in
                                          r.model_extra["packed_ss"]["token_ids"]]
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(
        c.logprob, abs=1e-6) for c in content)
    # Streamed: each chunk carries its tokens' logprobs; together, the same as above.
    events = list(client.chat.completions.create(stream=True, **asked))
    streamed = [c for e in events if e.choices and e.choices[0].logprobs
                for c in e.choices[0].logprobs.content]
    assert sum(1 for e in events if e.choices and e.choices[0].logprobs) > 1
    assert [c.token for c in streamed] == [c.token for c in content]
    np.testing.assert_allclose([c.logprob for c in streamed], [c.logprob for c in content],
                               atol=1e-5)
    code, got = request(base, "POST", "/v1/completions", {
        "model": "nld-tiny", "prompt": "x", "stream": True, "echo": True})
    assert code == 400 and got["error"]["param"] == "echo"
    code, got = request(base, "POST", "/v1/completions",
                        {"model": "nld-tiny", "prompt": "x", "max_tokens": 0})
    assert code == 400 and got["error"]["param"] == "max_tokens"


def test_a_batch_of_prompts_gives_each_its_choices(client):
    prompts = [_question(5), _question(6)]
    r = client.completions.create(model="nld-tiny", prompt=prompts, n=2, temperature=1.0,
                                  seed=11, max_tokens=6)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    asked = dict(temperature=1.0, max_tokens=6)
    want = [_alone(p, asked, seed=11 + i).text for p in prompts for i in range(2)]
    assert [c.text for c in r.choices] == want
    ids = [MODEL.tokenizer.encode(p).ids for p in prompts]
    assert r.usage.prompt_tokens == sum(map(len, ids))
    r = client.completions.create(model="nld-tiny", prompt=ids, temperature=0, max_tokens=6)
    assert [c.text for c in r.choices] == [_alone(p, dict(temperature=0, max_tokens=6)).text
                                           for p in prompts]


def test_tokenize_and_detokenize(base):
    code, got = request(base, "POST", "/tokenize", {"model": "nld-tiny", "prompt": _question(2)})
    ids = MODEL.tokenizer.encode(_question(2)).ids
    assert code == 200 and got == {"count": len(ids), "max_model_len": MAX_MODEL_LEN,
                                   "tokens": ids}
    code, got = request(base, "POST", "/tokenize", {"model": "nld-tiny", "messages": [
        {"role": "user", "content": "Hi"}]})
    assert code == 200 and got["count"] == len(got["tokens"]) > 1
    code, got = request(base, "POST", "/detokenize", {"model": "nld-tiny", "tokens": ids})
    assert code == 200 and got == {"prompt": MODEL.tokenizer.decode(ids)}
    code, got = request(base, "POST", "/detokenize", {"model": "nld-tiny", "tokens": [10**9]})
    assert code == 400 and got["error"]["param"] == "tokens"
    assert request(base, "POST", "/tokenize", {"model": "nld-tiny"})[0] == 400


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_memory_stays_flat_over_hundreds_of_varied_requests(client):
    def ask(i):
        kw = dict(temperature=[0, 0.4, 1.3][i % 3], seed=i, max_tokens=1 + i % 12,
                  stop=["\n"] if i % 5 == 0 else None, n=1 + i % 2)
        if i % 3 == 2:
            kw["top_p"] = 0.5 + (i % 7) / 20
        if i % 4 == 1:
            kw["logprobs"] = i % 6
        return client.completions.create(model="nld-tiny", prompt=_question(i), **kw)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(ask, range(60)))   # everything warmed: buffers, threads, pools
    maps, rss = _maps(), _rss_mb()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(ask, range(60, 360)))
    # 300 requests of varied options: no program compiled, nothing kept per request.
    assert _maps() - maps < 30 and _rss_mb() - rss < 40, (_maps() - maps, _rss_mb() - rss)


@pytest.mark.parametrize("name,schedule,shape", [("setdlm-tiny", "packed", None),
                                                  ("setdlm-tiny", "native", None),
                                                  ("nld-tiny", "branched", {"branches": 3}),
                                                  ("setdlm-tiny", "branched", {"branches": 2})])
def test_other_schedules_serve_greedy_and_sampled_requests_in_one_state(name, schedule, shape):
    """SetDLM's slots, and Branched-SS's, run the sampled program (greedy requests at
    temperature 0); SetDLM's native decoder decodes greedily only, so there the slots run
    the greedy program and a sampled request is a 400 naming the temperature."""
    model = ps.load(name)
    app = create_app(model, name, schedule=schedule, width=shape, max_model_len=48, slots=2)
    asks = [dict(temperature=0), dict(temperature=1.0, seed=5),
            dict(temperature=0.8, top_p=0.7, seed=6)]
    prompt = "Question: Ava has 4 apples. She gets 3 more. How many?\nAnswer:"
    with in_process(app) as url:
        assert app.app.state.decoder.sampled == (schedule != "native")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda a: _answer(client, name, prompt, a), asks))
    for asked, (code, ids) in zip(asks, got):
        if schedule == "native" and asked["temperature"] > 0:
            assert code == 400 and "temperature" in ids, ids
            continue
        want = ps.decode(model, prompt, schedule=schedule, max_new_tokens=8,
                         seed=asked.get("seed", 0), **(shape or {}),
                         **{k: v for k, v in asked.items() if k != "seed"})
        assert (code, ids) == (200, want.tokens), asked


def _answer(client, name: str, prompt: str, asked: dict):
    try:
        r = client.completions.create(model=name, prompt=prompt, max_tokens=8, **asked)
    except openai.BadRequestError as e:
        return 400, e.message
    return 200, r.model_extra["packed_ss"]["token_ids"]


def test_a_request_that_fails_to_start_hears_of_it_and_the_others_go_on(client, app, base):
    """A request whose prefill fails (here: made to raise) gets an error answer once; the
    requests beside it and after it are served, and no slot is lost."""
    decoder = app.app.state.decoder
    admit = decoder.scheduler.admit

    def failing(requests, tags, *args, **kw):
        if list(requests[0].prompt[:3]) == [1, 5, 7]:
            raise RuntimeError("out of device memory (made up)")
        return admit(requests, tags, *args, **kw)

    decoder.scheduler.admit = failing
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            bad = pool.submit(request, base, "POST", "/v1/completions",
                              {"model": "nld-tiny", "prompt": [1, 5, 7], "max_tokens": 4})
            good = [pool.submit(_ask, client, i, False) for i in range(2)]
            status, body = bad.result(timeout=60)[:2]
            assert status == 500 and "out of device memory" in json.dumps(body)
            for i, g in enumerate(good):
                want = _alone(_question(i), _asked(i))
                assert g.result(timeout=60) == (want.tokens, want.text)
    finally:
        del decoder.scheduler.admit
    _until(lambda: decoder.busy_slots == 0 and decoder.queued == 0)
    assert _ask(client, 0, False)[0] == _alone(_question(0), _asked(0)).tokens
