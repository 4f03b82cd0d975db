"""The server against hostile and careless clients (a real `packed-ss serve` process with
small limits): bodies around the size limit, connections that never finish their headers
or body, an API key, no /docs, strings that are not Unicode, integers past every bound,
chat templates that loop or build huge strings (the server stays responsive: /health
answers within 1 s while they run), the right `param` in every 400, and no server path
in any error."""

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import packed_ss_jax as ps
from servers import ROOT, events, is_openai_error, request, running

KEY = "test-key-1234"
AUTH = {"authorization": f"Bearer {KEY}"}
BODY_LIMIT = 65536
HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 2.0
MAX_CONNECTIONS = 64
TEMPLATE_LIMIT = 5.0   # chat templates' default wall-time limit (chat.py)
MODEL = ps.load()

# The embedded model's template, with hostile branches a message can switch on.
HOSTILE = {
    "loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "format": "{{ '{:>1000000000}'.format(1) }}",
    "percent": "{{ '%1000000000d' % 1 }}",
    "tojson": "{{ messages | tojson(indent=300000000) }}",
    "repeat": "{{ 'a' * 1000000000 }}",
    "huge": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
}


def _template(source: str) -> str:
    branches = "".join(f"{{%- {'if' if i == 0 else 'elif'} messages[0]['content'] == "
                       f"'{name}' %}}{body}"
                       for i, (name, body) in enumerate(HOSTILE.items()))
    return branches + "{%- else %}" + source + "{%- endif %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    src = Path(ps.__file__).parent / "embedded" / "nld-tiny"
    dst = tmp_path_factory.mktemp("hostile") / "nld-tiny"
    shutil.copytree(src, dst)
    template = dst / "chat_template.jinja"
    template.write_text(_template(template.read_text()))
    return dst


@pytest.fixture(scope="module")
def server(model_dir):
    with running("--model", str(model_dir), "--max-model-len", "128", "--api-key", KEY,
                 "--max-body-bytes", str(BODY_LIMIT), "--header-timeout", str(HEADER_TIMEOUT),
                 "--body-timeout", str(BODY_TIMEOUT), "--max-connections",
                 str(MAX_CONNECTIONS)) as s:
        yield s


def post(server, path, body, headers=AUTH, timeout=60):
    return request(server.base, "POST", path, body, headers=headers, timeout=timeout)


def completion(**fields):
    return {"model": "nld-tiny", "prompt": "Question: Ava has 3 apples.", "max_tokens": 4,
            "temperature": 0, **fields}


def chat(content, **fields):
    return {"model": "nld-tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0, **fields}


# --- the API key, /docs -------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"},
                                     {"authorization": KEY}, {"authorization": "bearer " + KEY}])
def test_without_the_key_a_401(server, headers):
    code, body = post(server, "/v1/completions", completion(), headers=headers)
    assert code == 401 and is_openai_error(body), body
    assert body["error"]["code"] == "invalid_api_key"
    assert request(server.base, "GET", "/v1/models", headers=headers)[0] == 401


def test_health_needs_no_key_and_the_docs_are_off(server):
    assert request(server.base, "GET", "/health")[0] == 200
    for path in ("/docs", "/openapi.json", "/redoc"):
        code, body = request(server.base, "GET", path, headers=AUTH)
        assert code == 404 and is_openai_error(body), (path, body)


# --- body size and time --------------------------------------------------------------------------


def _padded(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (spaces pad the JSON)."""
    raw = json.dumps(completion()).encode()
    return raw + b" " * (size - len(raw))


@pytest.mark.parametrize("delta", [-1, 0, 1, 1000, 10 * BODY_LIMIT])
def test_body_sizes_around_the_limit(server, delta):
    code, body = post(server, "/v1/completions", _padded(BODY_LIMIT + delta))
    if delta <= 0:
        assert code == 200, body
    else:
        assert code == 413 and is_openai_error(body), body
        assert str(BODY_LIMIT) in body["error"]["message"]


def test_a_chunked_body_past_the_limit_is_refused_as_it_arrives(server):
    host, port = server.base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        chunks = (b"x" * 4096 for _ in range(4 * BODY_LIMIT // 4096))
        conn.request("POST", "/v1/completions", body=chunks, encode_chunked=True,
                     headers={"content-type": "application/json", **AUTH})
        r = conn.getresponse()
        assert r.status == 413 and is_openai_error(json.loads(r.read()))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed while the rest was still being sent
    finally:
        conn.close()


def _open_files(server) -> int:
    return len(list(Path(f"/proc/{server.proc.pid}/fd").iterdir()))


def test_connections_that_never_finish_their_headers_are_closed(server):
    host, port = server.base.removeprefix("http://").split(":")
    before = _open_files(server)
    socks = []
    for i in range(40):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"GE")
        socks.append(s)
    time.sleep(0.3)
    assert _open_files(server) >= before + 30  # the server holds them, for now
    start = time.monotonic()
    try:
        for s in socks:  # each is closed by the server: recv sees the end of the stream
            assert s.recv(1024) == b""
        assert time.monotonic() - start < HEADER_TIMEOUT + 3
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 5
    while _open_files(server) > before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _open_files(server) <= before + 2
    assert request(server.base, "GET", "/health", timeout=2)[0] == 200


def test_a_connection_past_the_limit_gets_a_json_503_as_it_opens(server):
    host, port = server.base.removeprefix("http://").split(":")
    socks, reply = [], b""
    try:
        for _ in range(MAX_CONNECTIONS + 5):
            s = socket.create_connection((host, int(port)), timeout=5)
            socks.append(s)
            s.setblocking(False)
            time.sleep(0.01)
            try:
                reply = s.recv(65536)
            except BlockingIOError:
                continue
            break
        assert len(socks) > MAX_CONNECTIONS - 5, len(socks)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"application/json" in head, reply
        assert is_openai_error(json.loads(body)), body
    finally:
        for s in socks:
            s.close()
    time.sleep(0.3)
    assert request(server.base, "GET", "/health", timeout=2)[0] == 200


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(server):
    code, reply = post(server, "/v1/completions", completion(prompt="Ava " * 10000))
    assert code == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert "characters" in reply["error"]["message"] and reply["error"]["param"] == "prompt"


def test_a_body_that_never_arrives_gets_408(server):
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=BODY_TIMEOUT + 10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100"
                  b"\r\n\r\n{\"model\":")
        start = time.monotonic()
        reply = s.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert time.monotonic() - start < BODY_TIMEOUT + 2


# --- strings, integers, params -------------------------------------------------------------------

PARAMS = [
    (completion(prompt="x\ud800"), "prompt"),
    (completion(prompt="apples " * 1200), "prompt"),
    (completion(prompt=[1, 2**70]), "prompt"),
    (completion(prompt=[1, -1]), "prompt"),
    (completion(stop="\udfff"), "stop"),
    (completion(stop=["abcdefghijklmnopqrstuvwxyz" * 4]), "stop"),
    (completion(stop=["a", "b", "c", "d", "e"]), "stop"),
    (completion(max_tokens=2**70), "max_tokens"),
    (completion(max_tokens=10**6), "max_tokens"),
    (completion(seed=2**64), "seed"),
    (completion(top_p=0), "top_p"),
    (completion(temperature=-1e-300), "temperature"),
    (completion(model="nld-tiny\ud800"), "model"),
    (chat("x\ud800"), "messages"),
    (chat("x", chat_template_kwargs={"a": ["\ud800"]}), "chat_template_kwargs"),
    (chat("x", chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    (chat("x", max_completion_tokens=5000), "max_completion_tokens"),
    (chat("apples " * 1200), "messages"),
    ({**chat("x"), "messages": [{"role": "user", "content": "x", "name": "\ud800"}]},
     "messages"),
]


@pytest.mark.parametrize("body,param", PARAMS)
def test_each_400_names_the_field_at_fault(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    code, reply = post(server, path, json.dumps(body).encode())
    assert code == 400 and is_openai_error(reply), reply
    assert reply["error"]["param"] == param, reply


def test_a_tiny_top_p_is_greedy(server):
    want = ps.decode(MODEL, "Question: Ava has 3 apples.", max_new_tokens=4)
    for top_p in (5e-324,):  # 0 in float32; the API's tests take the other tiny values
        code, reply = post(server, "/v1/completions", completion(temperature=1.0, top_p=top_p))
        assert code == 200, reply
        assert reply["packed_ss"]["token_ids"] == want.tokens


# --- chat templates: limits, and a server that stays responsive ---------------------------------


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_ends_with_a_clear_error_while_health_answers(server, model_dir,
                                                                          name):
    done = {}

    def ask():
        start = time.monotonic()
        done["reply"] = post(server, "/v1/chat/completions", chat(name), timeout=60)
        done["seconds"] = time.monotonic() - start

    worker = threading.Thread(target=ask)
    worker.start()
    try:
        while worker.is_alive():
            start = time.monotonic()
            assert request(server.base, "GET", "/health", timeout=1)[0] == 200
            assert time.monotonic() - start < 1
            time.sleep(0.2)
    finally:
        worker.join()
    code, reply = done["reply"]
    assert code == 400 and is_openai_error(reply), reply
    message = reply["error"]["message"]
    assert "chat_template.jinja" in message and "nld-tiny" in message, message
    assert str(model_dir) not in message and str(Path(ps.__file__).parent) not in message
    assert done["seconds"] < TEMPLATE_LIMIT + 5
    # and a normal request after it is served
    assert post(server, "/v1/chat/completions", chat("Ava has 3 apples."))[0] == 200


def test_no_error_names_a_server_path(server, model_dir):
    bad = [completion(prompt=[10**9]), chat("x", chat_template_kwargs={"messages": 1}),
           completion(stop=["q" * 200]), chat("format")]
    for body in bad:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        reply = json.dumps(post(server, path, body)[1])
        for secret in (str(model_dir), str(Path(ps.__file__).parent), "site-packages"):
            assert secret not in reply, reply


def test_a_stream_past_a_hostile_template_is_one_error(server):
    code, items = events(server.base, "/v1/chat/completions", {**chat("format"), "stream": True},
                         headers=AUTH)
    assert code == 400 and is_openai_error(items[0]), items


# --- the command line ----------------------------------------------------------------------------


def _serve_lines(*args: str, until: str | None, timeout: float = 120) -> tuple[str, int | None]:
    """`packed-ss serve ARGS` output up to the line holding `until` (then it is stopped)."""
    proc = subprocess.Popen([sys.executable, "-m", "packed_ss_jax", "serve", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ))
    lines = []
    try:
        deadline = time.monotonic() + timeout
        for line in proc.stdout:
            lines.append(line)
            if (until is not None and until in line) or time.monotonic() > deadline:
                break
    finally:
        if proc.poll() is None:
            proc.terminate()
        code = proc.wait(timeout=30)
    return "".join(lines), code


def test_binding_beyond_loopback_without_a_key_warns():
    # The shortest --max-model-len: the server compiles its programs before it listens.
    out, _ = _serve_lines("--host", "0.0.0.0", "--port", "0", "--max-model-len", "32",
                          until="serving")
    assert "warning: serving on 0.0.0.0 without --api-key" in out, out
    out, _ = _serve_lines("--host", "0.0.0.0", "--port", "0", "--api-key", KEY,
                          "--max-model-len", "32", until="serving")
    assert "warning" not in out and "serving nld-tiny on http://0.0.0.0:" in out, out


def test_a_port_in_use_is_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out, code = _serve_lines("--port", str(port), until=None)
    assert code == 2 and out.count("\n") == 1 and out.startswith("packed-ss serve: error:"), out
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in out, out
