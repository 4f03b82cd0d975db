"""The FastAPI app: its routes, its error replies, its startup and shutdown (the decoder
thread and the preparing pool), all inside http_guard's connection and body limits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..http_guard import Guard, Limits, error_body
from . import errors, formats
from .errors import APIError, Scrubber
from .formats import ChatBody, CompletionBody
from .worker import Decoder, Job, Preparer

log = logging.getLogger(__name__)


def create_app(model, name: str, *, schedule: str = "packed", width: dict | None = None,
               limits: Limits | None = None) -> Guard:
    """The ASGI app serving `model` under the model id `name`: the FastAPI app (its
    `.app`) inside the connection and body limits of `limits`."""
    limits = limits or Limits()
    service = Service(model, name, dict(schedule=schedule, **(width or {})), limits)
    docs = dict(docs_url="/docs", redoc_url=None, openapi_url="/openapi.json") if limits.docs \
        else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="packed-ss", lifespan=service.lifespan,
                  exception_handlers=service.error_handlers(), **docs)
    app.state.decoder, app.state.preparer = service.decoder, service.preparer
    app.add_api_route("/health", service.health, methods=["GET"])
    app.add_api_route("/v1/models", service.models, methods=["GET"])
    app.add_api_route("/v1/completions", service.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", service.chat_completions, methods=["POST"])
    return Guard(app, limits, service.decoder.expired)


class Service:
    """The routes and error handlers of one served model: a request is checked on the
    event loop (its body, its model), prepared off it (`Preparer`: a checked request),
    decoded by the `Decoder` thread, and answered whole or as server-sent events."""

    def __init__(self, model, name: str, defaults: dict, limits: Limits):
        self.name, self.created = name, int(time.time())
        self.decoder = Decoder(model)
        self.preparer = Preparer(model, defaults, limits, self.decoder.expired)
        self.scrub = Scrubber(model, name)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.decoder.start()
        yield
        self.decoder.abort_all()
        self.preparer.shutdown()
        self.decoder.stop(timeout=2.0)

    # --- errors ---------------------------------------------------------------------------------

    def error_handlers(self) -> dict:
        return {APIError: self._api_error, RequestValidationError: self._invalid,
                StarletteHTTPException: self._http, Exception: self._bug}

    def error_json(self, e: APIError) -> dict:
        return error_body(self.scrub(e.message), e.type, e.param, e.code)

    def reply(self, e: APIError) -> JSONResponse:
        return JSONResponse(self.error_json(e), status_code=e.status)

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
        d = self.decoder
        return {"status": "draining" if d.draining else "ok", "model": self.name,
                "queued": d.jobs.qsize(), "busy": d.busy, "cancelled": d.cancelled}

    async def models(self):
        return {"object": "list", "data": [{"id": self.name, "object": "model",
                                            "created": self.created, "owned_by": "packed-ss"}]}

    async def completions(self, body: CompletionBody):
        self._check_model(body)
        options, max_tokens_field = formats.completion_options(body)
        return await self._answer(formats.Completion(self.name), options, max_tokens_field,
                                  body.stream)

    async def chat_completions(self, body: ChatBody):
        self._check_model(body)
        options, max_tokens_field = formats.chat_options(body)
        return await self._answer(formats.Chat(self.name), options, max_tokens_field,
                                  body.stream)

    def _check_model(self, body: formats.Body) -> None:
        if self.decoder.draining:
            raise errors.draining()
        if body.model != self.name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{self.name!r}", param="model", code="model_not_found")

    # --- answering ------------------------------------------------------------------------------

    async def _answer(self, form, options: dict, max_tokens_field: str, streaming: bool):
        request = await self.preparer(options, max_tokens_field)
        job = Job(request, asyncio.get_running_loop())
        self.decoder.submit(job)
        if streaming:
            return StreamingResponse(self._events(job, form), media_type="text/event-stream")
        return await self._whole(job, form)

    async def _whole(self, job: Job, form) -> dict:
        try:
            result = None
            while (item := await job.out.get()) is not None:
                if isinstance(item, Exception):
                    raise errors.failure(item)
                result = item.result or result
        finally:
            self._end(job)
        return form.response(result, job.prompt_len)

    async def _events(self, job: Job, form):
        pieces = formats.Pieces()
        try:
            for event in form.opening():
                yield formats.sse(event)
            while (item := await job.out.get()) is not None:
                if isinstance(item, Exception):
                    yield formats.sse(self.error_json(errors.failure(item)))
                    break
                yield formats.sse(form.event(pieces(item), item.result, job.prompt_len))
            yield formats.DONE
        finally:  # the client went away, or we are done: stop decoding for it
            self._end(job)

    def _end(self, job: Job) -> None:
        job.cancelled.set()
        self.decoder.ended(job)
