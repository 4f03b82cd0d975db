"""`packed-ss serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn).

Endpoints: GET /health, GET /v1/models, POST /v1/completions and /v1/chat/completions,
non-streaming or `stream: true` (server-sent events, ending with `data: [DONE]`).
Responses carry the OpenAI fields (`usage` included) and, under `packed_ss`, the
speculative statistics (NFE, tokens per NFE, iterations) and the generated token ids.

A request passes the connection and body limits (http_guard.py), is validated on the
event loop (formats.py), then prepared on a small thread pool into a checked request (the
chat template rendered, the prompt tokenized once and checked against the model's
context: `api.check`, no JAX work) so that no request can hold the event loop, and
queues to one decoder thread, which runs that request as it is (`api.stream_request`:
every compile and decode) and hands chunks back to the event loop (worker.py). A
streaming client that disconnects cancels its request: the decoder stops after the launch
in flight and takes the next one. A bad request gets a 4xx with an OpenAI-style error
body `{"error": {"message", "type", "param", "code"}}` whose `param` names the request
field at fault (errors.py).

SIGTERM or SIGINT drains (run.py): the listening socket closes (a request arriving on a
connection already open gets 503), requests in flight get `Limits.drain_timeout_s` to
finish, then a 503 error (a stream: an error event, then `data: [DONE]`); the process
exits a few seconds after that at most, even with a compile in progress.

Modules: app.py (the routes, error replies, startup and shutdown), formats.py (request
bodies, responses, stream events), worker.py (the Preparer and the Decoder thread),
errors.py (error bodies), run.py (binding, serving, draining).
"""

from .app import create_app
from .run import bind, is_loopback, model_name, serve

__all__ = ["bind", "create_app", "is_loopback", "model_name", "serve"]
