"""The FastAPI app: its routes, its error replies, its startup and shutdown (the decoder
thread and the preparing pool), all inside http_guard's connection and body limits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import api, chat
from ..client import Draining, EngineClient, Job
from . import errors, formats
from .errors import APIError, Scrubber
from .formats import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody
from .http_guard import Guard, Limits, error_body
from .worker import Preparer

log = logging.getLogger(__name__)


def create_app(model, name: str, *, schedule: str = "packed", width: dict | None = None,
               limits: Limits | None = None, max_model_len: int | None = None,
               slots: int = 8, steps: int = 4, max_queue: int = 256, warm: bool = True,
               on_ready: Callable[[BaseException | None], None] | None = None) -> Guard:
    """The ASGI app serving `model` under the model id `name`: the FastAPI app (its
    `.app`) inside the connection and body limits of `limits`. Requests are decoded
    `slots` at a time (client.py), `steps` loop iterations per launch, each fitting
    `max_model_len` tokens (default: the model's context, at most DEFAULT_MAX_MODEL_LEN);
    past `max_queue` requests waiting for a slot, a new one gets 503. `width`: the
    schedule's shape ({"width": W}, the family's B or W, and "branches" for Branched-SS).
    Every program is compiled (or read from disk) here, before the app is returned; with
    `warm` False, when the app starts, on the decoder thread: until then `/health` answers
    503 with status "starting" (or "failed", when that fails; `on_ready` is told, on that
    thread, with the error or None) and requests wait in the queue. A state that cannot
    fit in memory is refused here either way."""
    limits = limits or Limits()
    if max_model_len is None:
        max_model_len = min(model.config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    defaults = dict(schedule=schedule, **(width or {}), cache_size=max_model_len)
    service = Service(model, name, defaults, limits, slots, steps, max_queue, warm, on_ready)
    docs = dict(docs_url="/docs", redoc_url=None, openapi_url="/openapi.json") if limits.docs \
        else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="packed-ss", lifespan=service.lifespan,
                  exception_handlers=service.error_handlers(), **docs)
    if limits.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(limits.allowed_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.state.decoder, app.state.preparer = service.decoder, service.preparer
    app.state.deadline = service.deadline
    app.state.auto = None if service.decoder.auto is None else service.decoder.auto.summary
    app.add_api_route("/health", service.health, methods=["GET"])
    app.add_api_route("/metrics", service.metrics, methods=["GET"])
    app.add_api_route("/v1/models", service.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", service.model, methods=["GET"])
    app.add_api_route("/v1/completions", service.completions, methods=["POST"])
    app.add_api_route("/tokenize", service.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", service.detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", service.tokenizer_info, methods=["GET"])
    app.add_api_route("/v1/chat/completions", service.chat_completions, methods=["POST"])
    return Guard(app, limits, service.expired)


DEFAULT_MAX_MODEL_LEN = 4096
RETRY_AFTER_S = 1   # what a 503 for a full queue tells the client to wait


class Service:
    """The routes and error handlers of one served model: a request is checked on the
    event loop (its body, its model), prepared off it (`Preparer`: a checked request),
    decoded by the engine client's thread, and answered whole or as server-sent events."""

    def __init__(self, model, name: str, defaults: dict, limits: Limits, slots: int,
                 steps: int, max_queue: int, warm: bool = True, on_ready=None):
        self.name, self.created, self.max_queue = name, int(time.time()), max_queue
        self.decoder = EngineClient(model, defaults, slots, steps)
        self.decoder.plan()
        if warm:
            self.decoder.warm()
        self.on_ready = on_ready
        self.decoder.on_ready = self._ready
        self.expired = asyncio.Event()   # set at the drain's deadline (on the event loop)
        self.preparer = Preparer(self.decoder, limits, self.expired)
        self.scrub = Scrubber(model, name)
        tokenizer = getattr(model, "tokenizer", None)
        self.decode = tokenizer.decode if tokenizer is not None else (
            lambda ids: " ".join(map(str, ids)))   # a model without a tokenizer: the ids
        self.tokenizer_card = _tokenizer_card(model, defaults["cache_size"])

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.decoder.start()
        yield
        self.deadline()
        self.preparer.shutdown()
        self.decoder.stop(timeout=2.0)

    def _ready(self, error: BaseException | None) -> None:
        """A warm-up on the decoder thread has ended: with an error, no request will be
        decoded (the server stops taking them; those waiting get 503)."""
        if error is not None:
            self.decoder.draining = True
            self.decoder.abort_all_soon(APIError(
                503, self.scrub(f"the server failed to start: {type(error).__name__}: "
                                f"{error}"), "server_error"))
        if self.on_ready is not None:
            self.on_ready(error)

    def deadline(self) -> None:
        """The drain's deadline: every request still running or waiting ends with a 503."""
        self.expired.set()
        self.decoder.abort_all(errors.draining())

    # --- errors ---------------------------------------------------------------------------------

    def error_handlers(self) -> dict:
        return {APIError: self._api_error, RequestValidationError: self._invalid,
                StarletteHTTPException: self._http, Exception: self._bug}

    def error_json(self, e: APIError) -> dict:
        return error_body(self.scrub(e.message), e.type, e.param, e.code)

    def reply(self, e: APIError) -> JSONResponse:
        return JSONResponse(self.error_json(e), status_code=e.status, headers=e.headers)

    async def _api_error(self, request, e: APIError):
        return self.reply(e)

    async def _invalid(self, request, e: RequestValidationError):
        return self.reply(errors.invalid(e))

    async def _http(self, request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return self.reply(APIError(e.status_code, str(e.detail), kind))

    async def _bug(self, request, e: Exception):
        log.error("internal error on %s", request.url.path, exc_info=e)
        return self.reply(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                   "server_error"))

    # --- routes ---------------------------------------------------------------------------------

    async def health(self):
        """503 while the programs are made ready ("starting") and after that failed
        ("failed"); else 200 ("ok", or "draining" after SIGTERM)."""
        d = self.decoder
        status = ("failed" if d.failed is not None else "starting" if not d.ready.is_set()
                  else "draining" if d.draining else "ok")
        body = {"status": status, "model": self.name, "queued": d.queued,
                "busy": d.busy_slots > 0, "slots_busy": d.busy_slots, "slots": d.slots,
                "cancelled": d.cancelled}
        if d.failed is not None:
            body["error"] = self.scrub(f"{type(d.failed).__name__}: {d.failed}")
        return JSONResponse(body, status_code=503) if status in ("starting", "failed") else body

    async def metrics(self):
        m = self.decoder.metrics
        return Response(m.render(), media_type=m.content_type)

    async def tokenizer_info(self):
        """vLLM's /tokenizer_info: the special tokens and the chat template, so that a
        client tokenizes as the server does (lm-evaluation-harness's remote tokenizer)."""
        return self.tokenizer_card

    async def tokenize(self, body: TokenizeBody):
        """vLLM's shape: the ids, their count and the server's --max-model-len."""
        self._check_model(body)
        ids = await self.preparer.tokenize(body)
        return {"count": len(ids), "max_model_len": self.decoder.capacity, "tokens": ids}

    async def detokenize(self, body: DetokenizeBody):
        self._check_model(body)
        try:
            ids = api.prompt_ids(self.decoder.model, body.tokens)
        except api.InputError as e:
            raise APIError(400, str(e), param="tokens") from None
        return {"prompt": self.decode(ids)}

    def _card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created,
                "owned_by": "packed-ss", "max_model_len": self.decoder.capacity}

    async def models(self):
        return {"object": "list", "data": [self._card()]}

    async def model(self, model_id: str):
        if model_id != self.name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves "
                                f"{self.name!r}", param="model", code="model_not_found")
        return self._card()

    async def completions(self, body: CompletionBody, http: Request):
        self._check_model(body)
        return await self._answer(formats.completion(body, self.name, self.decode),
                                  body.stream, http)

    async def chat_completions(self, body: ChatBody, http: Request):
        self._check_model(body)
        return await self._answer(formats.chat(body, self.name, self.decode), body.stream,
                                  http)

    def _check_queue(self) -> None:
        """Past --max-queue requests waiting for a slot, a 503 telling the client when to
        try again."""
        if self.decoder.queued >= self.max_queue:
            raise APIError(503, f"the server is busy: {self.decoder.queued} requests are "
                                "waiting for a slot; try again shortly", "server_error",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})

    def _check_model(self, body) -> None:
        if self.decoder.draining:
            raise errors.draining()
        if body.model is not None and body.model != self.name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{self.name!r}", param="model", code="model_not_found")

    # --- answering ------------------------------------------------------------------------------

    async def _answer(self, asked: formats.Asked, streaming: bool, http: Request):
        self._check_queue()
        choices = await self.preparer(asked)
        try:
            job = self.decoder.submit(choices, asked.score, streaming)
        except Draining:
            raise errors.draining() from None
        form = asked.form
        if streaming:  # a client leaving ends the response's iteration (`_events`)
            return StreamingResponse(self._events(job, form), media_type="text/event-stream")
        watch = asyncio.create_task(_watch_disconnect(http, job))
        try:
            return await self._whole(job, form)
        finally:
            watch.cancel()

    async def _whole(self, job: Job, form) -> dict:
        results, scores = [None] * len(job.choices), [None] * len(job.choices)
        try:
            while (item := await job.out.get()) is not None:
                if isinstance(item, Exception):
                    raise errors.failure(item)
                index, chunk, scored = item
                if chunk.result is not None:   # a choice's last item: its result and scores
                    results[index], scores[index] = chunk.result, scored
        finally:
            self._end(job)
        if job.cancelled.is_set() and None in results:  # the client left: no one to answer
            raise APIError(499, "the client closed the connection", code="client_closed")
        return form.response(results, [c.prompt.tolist() for c in job.choices], scores,
                             job.prompt_tokens)

    async def _events(self, job: Job, form):
        pieces = [formats.Pieces() for _ in job.choices]
        results = [None] * len(job.choices)
        sent = [0] * len(job.choices)   # each choice's tokens streamed so far
        chars = [0] * len(job.choices)  # and their strings' length (logprobs' text_offset)
        try:
            for event in form.opening(len(job.choices)):
                yield formats.sse(event)
            while (item := await job.out.get()) is not None:
                if isinstance(item, Exception):
                    yield formats.sse(self.error_json(errors.failure(item)))
                    break
                index, chunk, scored = item   # scores: prompt and output so far
                results[index] = chunk.result or results[index]
                event = form.event(index, pieces[index](chunk), chunk.result, scored,
                                   len(job.choices[index].prompt) + sent[index], chunk.tokens,
                                   chars[index])
                sent[index] += len(chunk.tokens)
                if scored is not None:
                    chars[index] += sum(len(self.decode([int(t)])) for t in chunk.tokens)
                yield formats.sse(event)
            else:
                for event in form.closing(results, job.prompt_tokens):
                    yield formats.sse(event)
            yield formats.DONE
        finally:  # the client went away, or we are done: stop decoding for it
            self._end(job)

    def _end(self, job: Job) -> None:
        job.cancelled.set()
        self.decoder.ended(job)


async def _watch_disconnect(http: Request, job: Job) -> None:
    """Cancels a non-streaming request whose client goes away (its body is read, so the
    next message is the disconnect): the decoder frees its slots at its next launch."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    job.cancelled.set()
    job.out.put_nowait(None)   # ends the wait for results


def _tokenizer_card(model, max_model_len: int) -> dict:
    """/tokenizer_info's body: the special tokens' texts, the chat template's source."""
    tokenizer, c = getattr(model, "tokenizer", None), model.config

    def text(i):
        return None if i is None or tokenizer is None else tokenizer.id_to_token(int(i))

    try:
        template = chat.of(model).source
    except chat.TemplateError:
        template = None
    return {"eos_token": text(c.eos_token_id), "bos_token": text(c.bos_token_id),
            "pad_token": None, "chat_template": template, "model_max_length": max_model_len}
