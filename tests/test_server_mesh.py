"""`packed-ss serve --mesh`: a server whose model spans a mesh of devices (here 4
simulated CPU devices, data=2 x model=2) answers completions and chats, streamed and
not, with the tokens one device decodes."""

import packed_ss_jax as ps
from packed_ss_jax import api

from servers import events, request, running

EMBEDDED = "packed_ss_jax/embedded/nld-tiny"
DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
PROMPT = "Question: What is the capital of France?\nAnswer:"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _streamed_text(payloads, key):
    assert payloads[-1] == "[DONE]" and not any("error" in p for p in payloads[:-1])
    return "".join(key(p["choices"][0]) or "" for p in payloads[:-1] if p["choices"])


def test_serve_on_a_mesh_answers_completions_and_chats_streamed_and_not():
    model = ps.load(EMBEDDED)
    want = ps.decode(model, PROMPT, max_new_tokens=12, eos_id=-1).text
    assert want
    chat_want = ps.decode(model, api.chat_prompt(model, MESSAGES), max_new_tokens=12).text
    with running("--model", EMBEDDED, "--mesh", "data=2,model=2", "--max-model-len", "64",
                 env=DEVICES) as server:
        base = server.base
        body = {"model": "nld-tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        status, out = request(base, "POST", "/v1/completions", body)
        assert status == 200, out
        assert out["choices"][0]["text"] == want
        status, payloads = events(base, "/v1/completions", {**body, "stream": True})
        assert status == 200 and _streamed_text(payloads, lambda c: c.get("text")) == want
        chat = {"model": "nld-tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
        status, out = request(base, "POST", "/v1/chat/completions", chat)
        assert status == 200, out
        assert out["choices"][0]["message"]["content"] == chat_want
        status, payloads = events(base, "/v1/chat/completions", {**chat, "stream": True})
        assert status == 200
        assert _streamed_text(payloads, lambda c: c["delta"].get("content")) == chat_want
