"""`packed-ss serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn).

Endpoints: GET /health, GET /v1/models, POST /v1/completions and /v1/chat/completions,
non-streaming or `stream: true` (server-sent events, ending with `data: [DONE]`).
Responses carry the OpenAI fields (`usage` included) and, under `packed_ss`, the
speculative statistics (NFE, tokens per NFE, iterations) and the generated token ids.

Requests are checked on the event loop (`api.check`: no JAX work), then queue to one
decoder thread, which makes every JAX call (compiling, decoding) and hands chunks back to
the event loop. A streaming client that disconnects cancels its request: the decoder
stops after the launch in flight and takes the next one. A bad request gets a 4xx with an
OpenAI-style error body `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import api
from .requests import InputError

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_STOPS = 4            # OpenAI accepts up to 4 stop sequences


# --- request bodies -----------------------------------------------------------------------------

Number = Union[StrictInt, StrictFloat]


class _Common(BaseModel):
    # Fields other clients send that this server does not use are ignored; the fields it
    # uses are strictly typed (a string where a number belongs is a 400, not a guess).
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: Optional[Number] = Field(default=None, ge=0, le=100)
    top_p: Optional[Number] = Field(default=None, gt=0, le=1)
    seed: Optional[StrictInt] = Field(default=None, ge=0, lt=2**32)
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: StrictBool = False
    n: StrictInt = Field(default=1, ge=1, le=1)


class CompletionBody(_Common):
    prompt: Union[StrictStr, list[StrictInt]]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: Optional[StrictStr] = None


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    chat_template_kwargs: Optional[dict[str, Any]] = None


# --- errors -------------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)


# --- the decoder thread -------------------------------------------------------------------------


class Job:
    """One request on its way through the decoder thread; chunks come back through an
    asyncio queue on the event loop (None ends it, an exception is re-raised there)."""

    def __init__(self, options: dict, loop: asyncio.AbstractEventLoop):
        self.options, self.loop = options, loop
        self.out: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class Decoder:
    """The one thread that makes JAX calls: takes jobs in order, streams their chunks."""

    def __init__(self, model):
        self.model = model
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="packed-ss-decoder", daemon=True)
        self.busy = False
        self.cancelled = 0   # requests whose client left before the decode finished

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():
                self.cancelled += 1
                continue
            self.busy = True
            try:
                for chunk in api.stream(self.model, **job.options):
                    if job.cancelled.is_set():
                        self.cancelled += 1
                        break  # the client is gone: free the decoder for the next request
                    job.put(chunk)
            except Exception as e:  # reported to that request; the server goes on
                job.put(e)
            finally:
                job.put(None)
                self.busy = False


# --- the app ------------------------------------------------------------------------------------


def _options(body: _Common, max_tokens: int | None) -> dict:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOPS:
        raise APIError(400, f"at most {MAX_STOPS} stop sequences, got {len(stop)}", param="stop")
    if any(not s for s in stop):
        raise APIError(400, "stop sequences must not be empty", param="stop")
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    return dict(max_new_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                temperature=temperature, top_p=None if body.top_p is None else float(body.top_p),
                seed=0 if body.seed is None else body.seed, stop_sequences=stop)


def create_app(model, name: str, *, schedule: str = "packed", width: dict | None = None) -> FastAPI:
    """The FastAPI app serving `model` under the model id `name`."""
    decoder = Decoder(model)
    created = int(time.time())
    defaults = dict(schedule=schedule, **(width or {}))

    async def lifespan(app):
        decoder.start()
        yield
        decoder.stop()

    app = FastAPI(title="packed-ss", lifespan=lifespan)
    app.state.decoder = decoder

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return _error_response(APIError(400, f"malformed JSON body: {first.get('msg')}"))
        where = ".".join(loc) or "body"
        return _error_response(APIError(400, f"{where}: {first.get('msg', 'invalid')}",
                                        param=loc[0] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(e.status_code, str(e.detail), kind))

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):
        return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                        "server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "queued": decoder.jobs.qsize(),
                "busy": decoder.busy, "cancelled": decoder.cancelled}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "packed-ss"}]}

    def _check_model(body: _Common):
        if body.model != name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{name!r}", param="model", code="model_not_found")

    def _prepare(options: dict) -> int:
        """Checks the request (no JAX work); returns its prompt length."""
        try:
            request = api.check(model, **defaults, **options)
        except InputError as e:
            param = "messages" if "messages" in options else "prompt"
            if "max_new_tokens" in str(e) or "cache" in str(e):
                param = "max_tokens"
            raise APIError(400, str(e), param=param) from None
        return len(request.prompt)

    async def _run(options: dict, stream_fn, final_fn, streaming: bool, http: Request):
        prompt_len = _prepare(options)
        job = Job({**defaults, **options}, asyncio.get_running_loop())
        decoder.submit(job)
        if not streaming:
            try:
                result = None
                while (item := await job.out.get()) is not None:
                    if isinstance(item, Exception):
                        raise _failure(item)
                    result = item.result or result
            finally:
                job.cancelled.set()
            return final_fn(result, prompt_len)

        async def events():
            sent = ""
            try:
                for event in stream_fn(None, ""):
                    yield _sse(event)
                while (item := await job.out.get()) is not None:
                    if isinstance(item, Exception):
                        e = _failure(item)
                        yield _sse(error_body(e.message, e.type, e.param, e.code))
                        break
                    visible = _visible(sent + (item.text or ""), item.result)
                    piece, sent = visible[len(sent):], visible
                    for event in stream_fn(item, piece, prompt_len):
                        yield _sse(event)
                yield "data: [DONE]\n\n"
            finally:  # the client went away, or we are done: stop decoding for it
                job.cancelled.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    def _ids():
        return uuid.uuid4().hex[:24], int(time.time())

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: Request):
        _check_model(body)
        options = _options(body, body.max_tokens)
        options["prompt"] = body.prompt
        cid, now = _ids()
        head = dict(id=f"cmpl-{cid}", object="text_completion", created=now, model=name)

        def stream_fn(item, piece, prompt_len=0):
            if item is None:
                return []
            choice = {"index": 0, "text": piece, "logprobs": None,
                      "finish_reason": item.result.finish_reason if item.result else None}
            event = {**head, "choices": [choice]}
            if item.result:
                event.update(_extras(item.result, prompt_len))
            return [event]

        def final_fn(result, prompt_len):
            return {**head, "choices": [{"index": 0, "text": _visible(result.text or "", result),
                                         "logprobs": None,
                                         "finish_reason": result.finish_reason}],
                    **_extras(result, prompt_len)}

        return await _run(options, stream_fn, final_fn, body.stream, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: Request):
        _check_model(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        options = _options(body, max_tokens)
        options["messages"] = [m.model_dump(exclude_none=True) for m in body.messages]
        if body.chat_template_kwargs:
            options["chat_template_kwargs"] = body.chat_template_kwargs
        cid, now = _ids()
        head = dict(id=f"chatcmpl-{cid}", object="chat.completion.chunk", created=now, model=name)

        def stream_fn(item, piece, prompt_len=0):
            if item is None:  # the opening chunk names the role
                return [{**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                    "content": ""},
                                              "finish_reason": None}]}]
            event = {**head, "choices": [{"index": 0, "delta": {"content": piece} if piece else {},
                                          "finish_reason": item.result.finish_reason
                                          if item.result else None}]}
            if item.result:
                event.update(_extras(item.result, prompt_len))
            return [event]

        def final_fn(result, prompt_len):
            return {**head, "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant",
                                                         "content": _visible(result.text or "",
                                                                             result)},
                                 "finish_reason": result.finish_reason}],
                    **_extras(result, prompt_len)}

        return await _run(options, stream_fn, final_fn, body.stream, http)

    return app


def _visible(text: str, result) -> str:
    """The text a client sees: without the stop string that ended it (OpenAI semantics)."""
    if result is not None and result.stop_at is not None:
        return result.text[: result.stop_at]
    return text


def _extras(result, prompt_len: int) -> dict:
    n = len(result.tokens)
    return {"usage": {"prompt_tokens": prompt_len, "completion_tokens": n,
                      "total_tokens": prompt_len + n},
            "packed_ss": {"nfe": result.nfe, "tokens_per_nfe": result.tokens_per_nfe,
                          "iterations": result.iterations, "schedule": result.schedule,
                          "token_ids": result.tokens}}


def _failure(e: Exception) -> APIError:
    if isinstance(e, InputError):
        return APIError(400, str(e))
    return APIError(500, f"decoding failed: {type(e).__name__}: {e}", "server_error")


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


def serve(model, *, name: str, host: str = "127.0.0.1", port: int = 8000, **options) -> None:
    """Serves until interrupted (Ctrl-C / SIGTERM: open streams get a few seconds)."""
    import uvicorn

    app = create_app(model, name, **options)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)


def model_name(path: str | None) -> str:
    return Path(path).name if path else "nld-tiny"
