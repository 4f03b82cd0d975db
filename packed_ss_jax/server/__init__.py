"""`packed-ss serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn).

Endpoints: GET /health, GET /metrics, GET /v1/models (and /v1/models/{id}), POST
/v1/completions and /v1/chat/completions, non-streaming or `stream: true` (server-sent
events, ending with `data: [DONE]`). Responses carry the OpenAI fields (`usage` included)
and, under `packed_ss`, the speculative statistics (NFE, tokens per NFE, iterations) and
the generated token ids.

A request passes the connection and body limits and the API key (http_guard.py, which
also writes the access log), is validated on the event loop (formats.py: a field the
server would not act on is refused), then prepared on a small thread pool into checked
requests, one per choice (worker.py: the chat template rendered, the prompt tokenized
once and checked against --max-model-len, no JAX work), so that no request can hold the
event loop. The decoder thread (batcher.py) decodes them by continuous batching: each
takes a slot of a batched decode state, beside the requests running, and its tokens go
back to the event loop after every launch. Every program is compiled at startup, so no
request compiles. A client that disconnects, streaming or not, frees its slot at the
next launch. A bad request gets a 4xx with an OpenAI-style error body `{"error":
{"message", "type", "param", "code"}}` whose `param` names the request field at fault
(errors.py); /metrics is in Prometheus' text format (metrics.py).

SIGTERM or SIGINT drains (run.py): the listening socket closes (a request arriving on a
connection already open gets 503), requests in flight get `Limits.drain_timeout_s` to
finish, then a 503 error (a stream: an error event, then `data: [DONE]`); the process
exits a few seconds after that at most, even with a compile in progress.

Modules: app.py (the routes, error replies, startup and shutdown), formats.py (request
bodies, responses, stream events), worker.py (the Preparer), batcher.py (the decoder
thread), metrics.py (/metrics), errors.py (error bodies), run.py (binding, serving,
draining).
"""

from .app import create_app
from .run import bind, is_loopback, model_name, serve

__all__ = ["bind", "create_app", "is_loopback", "model_name", "serve"]
