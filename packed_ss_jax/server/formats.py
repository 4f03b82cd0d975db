"""The completion and chat formats: the request bodies (strictly typed, checked before
anything else sees them), what a body asks the decoder for, and the shapes of a whole
response and of a stream's events (OpenAI's fields, `usage` included, and under
`packed_ss` the speculative statistics and the generated token ids)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat,
                      StrictInt, StrictStr)

from .. import validate
from ..validate import InputError
from .errors import APIError

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_STOPS = 4            # OpenAI accepts up to 4 stop sequences
INT32_MAX = 2**31 - 1


# --- request bodies -----------------------------------------------------------------------------

def _unicode(value: str) -> str:
    validate.text(value, "the text")  # a lone surrogate: a "\ud800" escape in the JSON
    return value


Text = Annotated[StrictStr, AfterValidator(_unicode)]
Number = Union[StrictInt, StrictFloat]


class Body(BaseModel):
    """The fields both endpoints take."""

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


class CompletionBody(Body):
    prompt: Union[Text, list[StrictInt]]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Text
    content: Optional[Text] = None


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1, le=INT32_MAX)
    chat_template_kwargs: Optional[dict[Text, Any]] = None


# --- what a body asks for -----------------------------------------------------------------------

def completion_options(body: CompletionBody) -> tuple[dict, str]:
    """(the decode's options with the prompt, the field that sets max_new_tokens)."""
    return {**_options(body, body.max_tokens), "prompt": body.prompt}, "max_tokens"


def chat_options(body: ChatBody) -> tuple[dict, str]:
    """(the decode's options with the messages and template keywords, the field that sets
    max_new_tokens)."""
    field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    options = _options(body, body.max_completion_tokens or body.max_tokens)
    options["messages"] = [m.model_dump(exclude_none=True) for m in body.messages]
    for i, m in enumerate(options["messages"]):
        _check_json_strings(m, f"messages[{i}]", "messages")
    if body.chat_template_kwargs:
        _check_json_strings(body.chat_template_kwargs, "chat_template_kwargs",
                            "chat_template_kwargs")
        options["chat_template_kwargs"] = body.chat_template_kwargs
    return options, field


def _options(body: Body, max_tokens: int | None) -> dict:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOPS:
        raise APIError(400, f"at most {MAX_STOPS} stop sequences, got {len(stop)}", param="stop")
    if any(not s for s in stop):
        raise APIError(400, "stop sequences must not be empty", param="stop")
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    return dict(max_new_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                temperature=temperature, top_p=None if body.top_p is None else float(body.top_p),
                seed=0 if body.seed is None else body.seed, stop_sequences=stop)


def _check_json_strings(value, where: str, param: str) -> None:
    try:
        _check_strings(value, where)
    except InputError as e:
        raise APIError(400, str(e), param=param) from None


def _check_strings(value, where: str) -> None:
    """Every string inside free-form JSON (a message's extra fields, template keywords)
    is valid Unicode: the template and the tokenizer cannot take a lone surrogate."""
    if isinstance(value, str):
        validate.text(value, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, where)
            _check_strings(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{where}[{i}]")


# --- responses and stream events ----------------------------------------------------------------

class Completion:
    """The /v1/completions replies of one request."""

    def __init__(self, name: str):
        cid, now = _ids()
        self.head = dict(id=f"cmpl-{cid}", object="text_completion", created=now, model=name)

    def opening(self) -> list[dict]:
        return []

    def event(self, piece: str, result, prompt_len: int) -> dict:
        choice = {"index": 0, "text": piece, "logprobs": None,
                  "finish_reason": result.finish_reason if result else None}
        return {**self.head, "choices": [choice], **_extras(result, prompt_len)}

    def response(self, result, prompt_len: int) -> dict:
        return {**self.head, "choices": [{"index": 0, "text": visible(result), "logprobs": None,
                                          "finish_reason": result.finish_reason}],
                **_extras(result, prompt_len)}


class Chat:
    """The /v1/chat/completions replies of one request."""

    def __init__(self, name: str):
        cid, now = _ids()
        self.head = dict(id=f"chatcmpl-{cid}", object="chat.completion.chunk", created=now,
                         model=name)

    def opening(self) -> list[dict]:
        """The stream's first event names the role."""
        return [{**self.head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                 "content": ""},
                                           "finish_reason": None}]}]

    def event(self, piece: str, result, prompt_len: int) -> dict:
        choice = {"index": 0, "delta": {"content": piece} if piece else {},
                  "finish_reason": result.finish_reason if result else None}
        return {**self.head, "choices": [choice], **_extras(result, prompt_len)}

    def response(self, result, prompt_len: int) -> dict:
        message = {"role": "assistant", "content": visible(result)}
        return {**self.head, "object": "chat.completion",
                "choices": [{"index": 0, "message": message,
                             "finish_reason": result.finish_reason}],
                **_extras(result, prompt_len)}


def visible(result) -> str:
    """A whole decode's text as the client sees it: without the stop string that ended it
    (OpenAI semantics; the result's text keeps it, `stop_at` is where it starts)."""
    text = result.text or ""
    return text if result.stop_at is None else text[: result.stop_at]


class Pieces:
    """A stream's text as the client sees it: each chunk's text, and the last one's cut
    where the stop string that ended the decode starts (the result's `stop_at`)."""

    def __init__(self):
        self.sent = 0   # characters handed out

    def __call__(self, chunk) -> str:
        piece = chunk.text or ""
        if chunk.result is not None and chunk.result.stop_at is not None:
            piece = piece[: max(0, chunk.result.stop_at - self.sent)]
        self.sent += len(piece)
        return piece


def _extras(result, prompt_len: int) -> dict:
    if result is None:
        return {}
    n = len(result.tokens)
    return {"usage": {"prompt_tokens": prompt_len, "completion_tokens": n,
                      "total_tokens": prompt_len + n},
            "packed_ss": {"nfe": result.nfe, "tokens_per_nfe": result.tokens_per_nfe,
                          "iterations": result.iterations, "schedule": result.schedule,
                          "token_ids": result.tokens}}


def _ids() -> tuple[str, int]:
    return uuid.uuid4().hex[:24], int(time.time())


def sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


DONE = "data: [DONE]\n\n"
