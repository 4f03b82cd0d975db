"""`packed-ss serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn).

A request passes the connection and body limits and the API key (http_guard.py), is
validated on the event loop (formats.py), prepared on a small thread pool (worker.py: the
chat template rendered, the prompt tokenized and its length checked, no JAX work), then
submitted to the engine client (packed_ss_jax/client.py), whose one decoder thread runs
every choice in a slot of one batched decode state: no request compiles, and none can
hold the event loop; the client keeps the metrics /metrics renders (serving_metrics.py).
app.py holds the routes, startup and shutdown, errors.py the error bodies, run.py the
socket, serving and the drain on SIGTERM/SIGINT.
What clients see: docs/serving.md; the limits: docs/hostile_input.md.
"""

from .app import create_app
from .run import bind, is_loopback, model_name, serve

__all__ = ["bind", "create_app", "is_loopback", "model_name", "serve"]
