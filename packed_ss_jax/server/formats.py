"""The completion and chat formats: the request bodies (strictly typed, checked before
anything else sees them), what a body asks the decoder for, and the shapes of a whole
response and of a stream's events (OpenAI's fields, `usage` included, and under
`packed_ss` the speculative statistics and the generated token ids)."""

from __future__ import annotations

import json
import secrets
import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat,
                      StrictInt, StrictStr)

from .. import validate
from ..validate import InputError
from .errors import APIError

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions (chat's: what fits)
MAX_STOPS = 4            # OpenAI accepts up to 4 stop sequences
MAX_N = 16               # choices per request (each holds a slot)
INT32_MAX = 2**31 - 1


# --- request bodies -----------------------------------------------------------------------------

def _unicode(value: str) -> str:
    validate.text(value, "the text")  # a lone surrogate: a "\ud800" escape in the JSON
    return value


Text = Annotated[StrictStr, AfterValidator(_unicode)]
Number = Union[StrictInt, StrictFloat]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


# OpenAI fields this server does not act on, with the values that ask for nothing (a
# client may send those): any other value is a 400 naming the field, never ignored.
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None,), "echo": (None, False),
               "suffix": (None, ""), "best_of": (None, 1), "logit_bias": (None, {}),
               "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "repetition_penalty": (None, 1), "tools": (None, []), "functions": (None, []),
               "tool_choice": (None, "none"), "function_call": (None, "none"),
               "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}),
               "reasoning_effort": (None,), "modalities": (None, ["text"]),
               "prediction": (None,), "audio": (None,), "top_k": (None, -1, 0)}
# Fields that describe the request and change nothing in its output: accepted.
DESCRIPTIVE = ("user", "metadata", "store", "service_tier")


class Body(BaseModel):
    """The fields both endpoints take."""

    # The fields used are strictly typed (a string where a number belongs is a 400, not a
    # guess); any other field is checked by `refuse_unused`.
    model_config = ConfigDict(extra="allow")

    model: Text
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1, le=INT32_MAX)
    temperature: Optional[Number] = Field(default=None, ge=0, le=100)
    top_p: Optional[Number] = Field(default=None, gt=0, le=1)
    seed: Optional[StrictInt] = Field(default=None, ge=0, lt=2**32)
    stop: Union[Text, list[Text], None] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)


class CompletionBody(Body):
    prompt: Union[Text, list[StrictInt]]


class TextPart(BaseModel):
    """One part of a message's content given as a list (text parts only)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Text
    content: Union[Text, list[TextPart], None] = None


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1, le=INT32_MAX)
    chat_template_kwargs: Optional[dict[Text, Any]] = None


# --- what a body asks for -----------------------------------------------------------------------

def refuse_unused(body: Body) -> None:
    """A field this server would not act on is a 400 that names it (OpenAI fields it does
    not implement, unless sent with the value that asks for nothing; unknown fields),
    never silently ignored; DESCRIPTIVE fields are accepted."""
    for name, value in (body.model_extra or {}).items():
        if name in DESCRIPTIVE:
            continue
        if name in UNSUPPORTED:
            if any(_same(value, v) for v in UNSUPPORTED[name]):
                continue
            raise APIError(400, f"{name} is not supported by this server", param=name,
                           code="unsupported_parameter")
        raise APIError(400, f"unknown field {name!r}", param=name, code="unknown_parameter")


def _same(value, neutral) -> bool:
    """JSON equality: 0 and 0.0 alike, but not false and 0."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


def completion_options(body: CompletionBody) -> tuple[dict, str]:
    """(the decode's options with the prompt, the field that sets max_new_tokens)."""
    refuse_unused(body)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    return {**_options(body, max_tokens), "prompt": body.prompt}, "max_tokens"


def chat_options(body: ChatBody) -> tuple[dict, str]:
    """(the decode's options with the messages and template keywords, the field that sets
    max_new_tokens; without one, max_new_tokens is None: what fits, set once the prompt is
    tokenized)."""
    refuse_unused(body)
    field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    options = _options(body, body.max_completion_tokens or body.max_tokens)
    options["messages"] = [_joined(m.model_dump(exclude_none=True)) for m in body.messages]
    for i, m in enumerate(options["messages"]):
        _check_json_strings(m, f"messages[{i}]", "messages")
    if body.chat_template_kwargs:
        _check_json_strings(body.chat_template_kwargs, "chat_template_kwargs",
                            "chat_template_kwargs")
        options["chat_template_kwargs"] = body.chat_template_kwargs
    return options, field


def _joined(message: dict) -> dict:
    """A message whose content is a list of text parts, with the parts' text joined."""
    if isinstance(message.get("content"), list):
        message["content"] = "".join(part["text"] for part in message["content"])
    return message


def _options(body: Body, max_tokens: int | None) -> dict:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOPS:
        raise APIError(400, f"at most {MAX_STOPS} stop sequences, got {len(stop)}", param="stop")
    if any(not s for s in stop):
        raise APIError(400, "stop sequences must not be empty", param="stop")
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    # Without a seed, a fresh one: the same request sampled twice gives two samples.
    seed = secrets.randbelow(2**32) if body.seed is None else body.seed
    return dict(max_new_tokens=max_tokens, temperature=temperature,
                top_p=None if body.top_p is None else float(body.top_p), seed=seed,
                stop_sequences=stop, n=body.n)


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

class _Form:
    """The replies of one request: a whole response of every choice's result, or a
    stream's events (each choice's pieces, its last event with its finish reason and
    statistics; with `stream_options.include_usage`, a last event with the usage)."""

    prefix, chunk_object, whole_object = "", "", ""

    def __init__(self, name: str, include_usage: bool = False):
        cid, now = _ids()
        self.head = dict(id=f"{self.prefix}-{cid}", object=self.chunk_object, created=now,
                         model=name)
        self.include_usage = include_usage

    def opening(self, n: int) -> list[dict]:
        return []

    def event(self, index: int, piece: str, result) -> dict:
        choice = {"index": index, **self._piece(piece),
                  "finish_reason": result.finish_reason if result else None}
        return {**self.head, "choices": [choice], **_stats(result)}

    def closing(self, results: list, prompt_len: int) -> list[dict]:
        if not self.include_usage:
            return []
        return [{**self.head, "choices": [], "usage": _usage(results, prompt_len)}]

    def response(self, results: list, prompt_len: int) -> dict:
        choices = [{"index": i, **self._whole(r), "finish_reason": r.finish_reason}
                   for i, r in enumerate(results)]
        return {**self.head, "object": self.whole_object, "choices": choices,
                "usage": _usage(results, prompt_len), **_stats(results[0])}


class Completion(_Form):
    """The /v1/completions replies of one request."""

    prefix, chunk_object, whole_object = "cmpl", "text_completion", "text_completion"

    def _piece(self, piece: str) -> dict:
        return {"text": piece, "logprobs": None}

    def _whole(self, result) -> dict:
        return {"text": visible(result), "logprobs": None}


class Chat(_Form):
    """The /v1/chat/completions replies of one request."""

    prefix, chunk_object, whole_object = "chatcmpl", "chat.completion.chunk", "chat.completion"

    def opening(self, n: int) -> list[dict]:
        """The stream's first event of each choice names the role."""
        return [{**self.head, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                 "content": ""},
                                           "finish_reason": None}]} for i in range(n)]

    def _piece(self, piece: str) -> dict:
        return {"delta": {"content": piece} if piece else {}}

    def _whole(self, result) -> dict:
        return {"message": {"role": "assistant", "content": visible(result)}}


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


def _usage(results: list, prompt_len: int) -> dict:
    n = sum(len(r.tokens) for r in results)
    return {"prompt_tokens": prompt_len, "completion_tokens": n,
            "total_tokens": prompt_len + n}


def _stats(result) -> dict:
    """The speculative statistics of a finished choice, under `packed_ss`."""
    if result is None:
        return {}
    return {"packed_ss": {"nfe": result.nfe, "tokens_per_nfe": result.tokens_per_nfe,
                          "iterations": result.iterations, "schedule": result.schedule,
                          "token_ids": result.tokens}}


def _ids() -> tuple[str, int]:
    return uuid.uuid4().hex[:24], int(time.time())


def sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


DONE = "data: [DONE]\n\n"
