"""`packed-ss serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn).

Endpoints: GET /health, GET /v1/models, POST /v1/completions and /v1/chat/completions,
non-streaming or `stream: true` (server-sent events, ending with `data: [DONE]`).
Responses carry the OpenAI fields (`usage` included) and, under `packed_ss`, the
speculative statistics (NFE, tokens per NFE, iterations) and the generated token ids.

A request passes the connection and body limits (http_guard.py), is validated on the
event loop, then prepared on a small thread pool (the chat template rendered, the
prompt tokenized once and checked against the model's context: `api.check`, no JAX
work) so that no request can hold the event loop, and queues to one decoder thread,
which makes every JAX call (compiling, decoding) and hands chunks back to the event
loop. A streaming client that disconnects cancels its request: the decoder stops after
the launch in flight and takes the next one. A bad request gets a 4xx with an
OpenAI-style error body `{"error": {"message", "type", "param", "code"}}` whose `param`
names the request field at fault.

SIGTERM or SIGINT drains: the listening socket closes (a request arriving on a connection
already open gets 503), requests in flight get
`Limits.drain_timeout_s` to finish, then a 503 error (a stream: an error event, then
`data: [DONE]`); the process exits a few seconds after that at most, even with a
compile in progress.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Optional, Union

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat,
                      StrictInt, StrictStr)
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import api, chat, requests, stops
from .http_guard import Expired, Guard, Limits, error_body, protocol, shutting_down, within
from .requests import InputError

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_STOPS = 4            # OpenAI accepts up to 4 stop sequences
INT32_MAX = 2**31 - 1
PREPARE_THREADS = 2      # requests rendered and tokenized at once, off the event loop
log = logging.getLogger("packed_ss_jax.server")


# --- request bodies -----------------------------------------------------------------------------

def _unicode(value: str) -> str:
    requests.text(value, "the text")  # a lone surrogate: a "\ud800" escape in the JSON
    return value


Text = Annotated[StrictStr, AfterValidator(_unicode)]
Number = Union[StrictInt, StrictFloat]


class _Common(BaseModel):
    # Fields other clients send that this server does not use are ignored; the fields it
    # uses are strictly typed (a string where a number belongs is a 400, not a guess).
    model_config = ConfigDict(extra="ignore")

    model: Text
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1, le=INT32_MAX)
    temperature: Optional[Number] = Field(default=None, ge=0, le=100)
    top_p: Optional[Number] = Field(default=None, gt=0, le=1)
    seed: Optional[StrictInt] = Field(default=None, ge=0, lt=2**32)
    stop: Union[Text, list[Text], None] = None
    stream: StrictBool = False
    n: StrictInt = Field(default=1, ge=1, le=1)


class CompletionBody(_Common):
    prompt: Union[Text, list[StrictInt]]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Text
    content: Optional[Text] = None


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1, le=INT32_MAX)
    chat_template_kwargs: Optional[dict[Text, Any]] = None


def _check_strings(value, where: str) -> None:
    """Every string inside free-form JSON (a message's extra fields, template keywords)
    is valid Unicode: the template and the tokenizer cannot take a lone surrogate."""
    if isinstance(value, str):
        requests.text(value, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, where)
            _check_strings(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{where}[{i}]")


# --- errors -------------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)


def _shutting_down() -> APIError:
    e = shutting_down()["error"]
    return APIError(503, e["message"], e["type"], code=e["code"])


class Scrubber:
    """Error messages without the server's paths: the model's directory becomes the
    served model's name, the package's and Python's install directories disappear."""

    def __init__(self, model, name: str):
        here = Path(__file__).resolve().parent
        self.paths = [(str(Path(model.source).resolve()), name)] if model.source else []
        self.paths += [(str(here.parent), "."), (str(Path(os.__file__).parent), ".")]
        self.paths.sort(key=lambda pair: -len(pair[0]))

    def __call__(self, text: str) -> str:
        for path, short in self.paths:
            text = text.replace(path, short)
        return text


# --- the decoder thread -------------------------------------------------------------------------


class Job:
    """One request on its way through the decoder thread; chunks come back through an
    asyncio queue on the event loop (None ends it, an exception is re-raised there)."""

    def __init__(self, options: dict, loop: asyncio.AbstractEventLoop):
        self.options, self.loop = options, loop
        self.out: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.finished = False   # the decoder's last item is in `out`

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)

    def abort(self, error: Exception) -> None:
        """Ends the request now with `error` (on the event loop's thread); the decoder
        drops it after its launch in flight."""
        if not self.finished and not self.cancelled.is_set():
            self.cancelled.set()
            self.out.put_nowait(error)
            self.out.put_nowait(None)


class Decoder:
    """The one thread that makes JAX calls: takes jobs in order, streams their chunks."""

    def __init__(self, model):
        self.model = model
        self.jobs: queue.Queue = queue.Queue()
        self.live: set[Job] = set()   # submitted and not yet ended
        self.thread = threading.Thread(target=self._work, name="packed-ss-decoder", daemon=True)
        self.busy = False
        self.draining = False
        self.expired = asyncio.Event()   # set at the drain's deadline (on the event loop)
        self.cancelled = 0   # requests whose client left before the decode finished

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float) -> None:
        """Ends the thread; a compile in progress cannot be interrupted, so this waits for
        at most `timeout` (the thread is a daemon: the process exits without it)."""
        self.jobs.put(None)
        self.thread.join(timeout=timeout)

    def submit(self, job: Job) -> None:
        if self.draining:
            raise _shutting_down()
        self.live.add(job)
        self.jobs.put(job)

    def ended(self, job: Job) -> None:
        self.live.discard(job)

    def abort_all(self) -> None:
        """The drain's deadline: every request still waiting ends with a 503."""
        self.expired.set()
        for job in list(self.live):
            job.abort(_shutting_down())

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
                job.finished = True
                job.put(None)
                self.busy = False


# --- requests to decode options -----------------------------------------------------------------

# The library's argument names, as the API's request fields.
_PARAMS = (("stop", "stop"), ("max_new_tokens", "max_tokens"), ("temperature", "temperature"),
           ("top_p", "top_p"), ("seed", "seed"), ("chat_template_kwargs", "chat_template_kwargs"))


def _param(message: str, prompt_field: str, max_tokens_field: str) -> str:
    """The request field a library error is about: the first argument name it mentions."""
    found = [(message.find(name), field) for name, field in _PARAMS if name in message]
    if found:
        field = min(found)[1]
        return max_tokens_field if field == "max_tokens" else field
    return prompt_field


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


class Preparer:
    """Turns a request's options into the decoder's, off the event loop: the chat
    template rendered and the prompt tokenized once (the decoder gets token ids), the
    context and every other argument checked (`api.check`, no JAX work)."""

    def __init__(self, model, defaults: dict, limits: Limits, expired: asyncio.Event):
        self.model, self.defaults, self.limits, self.expired = model, defaults, limits, expired
        self.context = model.config.max_position_embeddings
        # No token covers more characters than its vocabulary entry spells, so a text
        # longer than this cannot fit the context: refused before the tokenizer sees it.
        longest = _longest_token(model.tokenizer)
        self.max_chars = self.context * longest
        self.max_stop_chars = stops.MAX_STOP_LEN * longest  # likewise, a stop's tokens
        self.pool = concurrent.futures.ThreadPoolExecutor(PREPARE_THREADS,
                                                          thread_name_prefix="packed-ss-prepare")
        self._lock, self._active = threading.Lock(), 0

    async def __call__(self, options: dict, max_tokens_field: str) -> tuple[dict, int]:
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self.pool, self._prepare, options, max_tokens_field)
        try:
            return await within(work, self.limits.prepare_timeout_s, self.expired)
        except Expired:
            raise _shutting_down() from None
        except TimeoutError:
            raise APIError(503, f"preparing the request (chat template, tokenizer) took longer "
                                f"than {self.limits.prepare_timeout_s:g} s", "server_error",
                           code="timeout") from None

    @property
    def busy(self) -> bool:
        return self._active > 0

    def _prepare(self, options: dict, max_tokens_field: str) -> tuple[dict, int]:
        with self._lock:
            self._active += 1
        try:
            return self._prepared(options, max_tokens_field)
        finally:
            with self._lock:
                self._active -= 1

    def _prepared(self, options: dict, max_tokens_field: str) -> tuple[dict, int]:
        """(the decoder's options, the prompt's length in tokens)."""
        field = "messages" if "messages" in options else "prompt"
        try:
            if field == "messages":
                ids = api.chat_prompt(self.model, options.pop("messages"),
                                      options.pop("chat_template_kwargs", None),
                                      max_chars=min(self.max_chars, chat.MAX_CHARS))
            else:
                prompt = options.pop("prompt")
                if isinstance(prompt, str) and len(prompt) > self.max_chars:
                    raise APIError(400, f"the prompt has {len(prompt)} characters: more than "
                                        f"this model's context of {self.context} tokens can "
                                        "hold", param="prompt",
                                   code="context_length_exceeded")
                ids = requests.prompt_ids(self.model, prompt)
            ids = [int(i) for i in ids]
            for stop in options["stop_sequences"]:
                if len(stop) > self.max_stop_chars:  # before the tokenizer sees it
                    raise APIError(400, f"a stop string of {len(stop)} characters is longer "
                                        f"than the {stops.MAX_STOP_LEN} tokens a stop may "
                                        "have", param="stop")
            self._fits(len(ids), options["max_new_tokens"], field, max_tokens_field)
            api.check(self.model, ids, **self.defaults, **options)
        except chat.TemplateError as e:  # the template's own words may name any field
            param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
            raise APIError(400, str(e), param=param) from None
        except InputError as e:
            raise APIError(400, str(e), param=_param(str(e), field, max_tokens_field)) from None
        return {**self.defaults, **options, "prompt": ids}, len(ids)

    def _fits(self, prompt_len: int, max_tokens: int, field: str, max_tokens_field: str):
        if max_tokens >= self.context:
            raise APIError(400, f"{max_tokens_field} {max_tokens} is larger than this model's "
                                f"context of {self.context} tokens", param=max_tokens_field)
        if prompt_len + max_tokens > self.context:
            raise APIError(400, f"this model's context is {self.context} tokens; the {field} "
                                f"({prompt_len} tokens) + {max_tokens_field} ({max_tokens}) "
                                f"= {prompt_len + max_tokens}: shorten the {field} or lower "
                                f"{max_tokens_field}", param=field,
                           code="context_length_exceeded")


def _longest_token(tokenizer) -> int:
    """The most characters one token's text can hold (its vocabulary entry's length: byte-
    level entries spell a byte per character, text has at most a character per byte)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True) if tokenizer is not None else {}
    return max(map(len, vocab), default=1)


# --- the app ------------------------------------------------------------------------------------


def create_app(model, name: str, *, schedule: str = "packed", width: dict | None = None,
               limits: Limits | None = None) -> Guard:
    """The ASGI app serving `model` under the model id `name`: the FastAPI app (its
    `.app`) inside the connection and body limits of `limits`."""
    limits = limits or Limits()
    decoder = Decoder(model)
    created = int(time.time())
    defaults = dict(schedule=schedule, **(width or {}))
    prepare = Preparer(model, defaults, limits, decoder.expired)
    scrub = Scrubber(model, name)

    async def lifespan(app):
        decoder.start()
        yield
        decoder.abort_all()
        prepare.pool.shutdown(wait=False, cancel_futures=True)
        decoder.stop(timeout=2.0)

    docs = dict(docs_url="/docs", redoc_url=None, openapi_url="/openapi.json") if limits.docs \
        else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="packed-ss", lifespan=lifespan, **docs)
    app.state.decoder, app.state.preparer = decoder, prepare

    def _response(e: APIError) -> JSONResponse:
        return JSONResponse(error_body(scrub(e.message), e.type, e.param, e.code),
                            status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errors = e.errors()
        # A union (a stop string or a list of them) fails once per member: the error our
        # own checks raised says more than "should be a valid string".
        first = next((x for x in errors if x.get("type") == "value_error"),
                     errors[0] if errors else {})
        if first.get("type") == "json_invalid":
            return _response(APIError(400, f"malformed JSON body: {first.get('msg')}"))
        loc = _field_path(first.get("loc", ()))
        message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        return _response(APIError(400, f"{'.'.join(loc) or 'body'}: {message}",
                                  param=loc[0].split("[")[0] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _response(APIError(e.status_code, str(e.detail), kind))

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):
        log.error("internal error on %s", request.url.path, exc_info=e)
        return _response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                  "server_error"))

    @app.get("/health")
    async def health():
        return {"status": "draining" if decoder.draining else "ok", "model": name,
                "queued": decoder.jobs.qsize(), "busy": decoder.busy,
                "cancelled": decoder.cancelled}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "packed-ss"}]}

    def _check_model(body: _Common):
        if decoder.draining:
            raise _shutting_down()
        if body.model != name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{name!r}", param="model", code="model_not_found")

    def _failure(e: Exception) -> APIError:
        if isinstance(e, APIError):
            return e
        if isinstance(e, InputError):
            return APIError(400, str(e))
        return APIError(500, f"decoding failed: {type(e).__name__}: {e}", "server_error")

    async def _run(options: dict, max_tokens_field: str, stream_fn, final_fn, streaming: bool):
        options, prompt_len = await prepare(options, max_tokens_field)
        job = Job(options, asyncio.get_running_loop())
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
                decoder.ended(job)
            return final_fn(result, prompt_len)

        async def events():
            sent = ""
            try:
                for event in stream_fn(None, ""):
                    yield _sse(event)
                while (item := await job.out.get()) is not None:
                    if isinstance(item, Exception):
                        e = _failure(item)
                        yield _sse(error_body(scrub(e.message), e.type, e.param, e.code))
                        break
                    visible = _visible(sent + (item.text or ""), item.result)
                    piece, sent = visible[len(sent):], visible
                    for event in stream_fn(item, piece, prompt_len):
                        yield _sse(event)
                yield "data: [DONE]\n\n"
            finally:  # the client went away, or we are done: stop decoding for it
                job.cancelled.set()
                decoder.ended(job)

        return StreamingResponse(events(), media_type="text/event-stream")

    def _ids():
        return uuid.uuid4().hex[:24], int(time.time())

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
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

        return await _run(options, "max_tokens", stream_fn, final_fn, body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        _check_model(body)
        max_tokens_field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        options = _options(body, body.max_completion_tokens or body.max_tokens)
        options["messages"] = [m.model_dump(exclude_none=True) for m in body.messages]
        for i, m in enumerate(options["messages"]):
            _check_json_strings(m, f"messages[{i}]", "messages")
        if body.chat_template_kwargs:
            _check_json_strings(body.chat_template_kwargs, "chat_template_kwargs",
                                "chat_template_kwargs")
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

        return await _run(options, max_tokens_field, stream_fn, final_fn, body.stream)

    return Guard(app, limits, decoder.expired)


def _field_path(loc) -> list[str]:
    """A validation error's place as the request's field names and list indices, without
    pydantic's own steps (union members such as 'str' or 'function-after[...]')."""
    path = []
    for x in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(x, int) and path:
            path[-1] += f"[{x}]"
        elif isinstance(x, str) and x.isidentifier() and x not in _TYPE_NAMES:
            path.append(x)
    return path


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict"})


def _check_json_strings(value, where: str, param: str) -> None:
    try:
        _check_strings(value, where)
    except InputError as e:
        raise APIError(400, str(e), param=param) from None


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


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


# --- running it ---------------------------------------------------------------------------------


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (port 0: a free port, read back with getsockname)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is this machine only."""
    import ipaddress

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def serve(app, sock: socket.socket, limits: Limits) -> bool:
    """Serves `app` on the bound `sock` until SIGTERM/SIGINT, then drains (see the module
    docstring) and returns whether its threads have ended. A decoder inside a compile, or
    a tokenizer inside a long text, cannot be stopped, and the interpreter must not wait
    for them or be torn down under them (`os._exit`, once the output is flushed)."""
    # The connection limit is the protocol's (a JSON 503 as a connection opens), not
    # uvicorn's limit_concurrency (plain text, once a request has been read).
    config = uvicorn.Config(app, http=protocol(limits), lifespan="on", log_level="warning",
                            timeout_keep_alive=limits.keep_alive_s,
                            # after our own drain has ended every request
                            timeout_graceful_shutdown=int(limits.drain_timeout_s) + 3)
    state = app.app.state
    _Draining(config, state.decoder, limits).run(sockets=[sock])
    return not state.decoder.thread.is_alive() and not state.preparer.busy


class _Draining(uvicorn.Server):
    """uvicorn's server whose first exit signal starts the decoder's drain: new requests
    get 503 at once, the ones in flight are ended with 503 at the drain deadline."""

    def __init__(self, config, decoder: Decoder, limits: Limits):
        super().__init__(config)
        self.decoder, self.limits = decoder, limits

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's own re-raises the signal once it has shut down, which would end a
        # drained server with "killed by SIGTERM" (or a KeyboardInterrupt); a drained
        # server exits with status 0.
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only: its owner stops this server
            return
        handlers = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if not self.decoder.draining:
            self.decoder.draining = True
            # A signal handler runs between two steps of the event loop, on its thread.
            loop = asyncio.get_running_loop()
            loop.call_soon_threadsafe(loop.call_later, self.limits.drain_timeout_s,
                                      self.decoder.abort_all)
        super().handle_exit(sig, frame)


def model_name(path: str | None) -> str:
    return Path(path).name if path else "nld-tiny"
