"""The completion and chat formats: the request bodies (strictly typed, checked before
anything else sees them), what a body asks the decoder for, and the shapes of a whole
response and of a stream's events (OpenAI's fields, `usage` included, and under
`packed_ss` the speculative statistics and the generated token ids)."""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat,
                      StrictInt, StrictStr)

from .. import api
from ..api import MAX_TOP, DecodeOptions, InputError
from .errors import APIError

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions (chat's: what fits)
MAX_STOPS = 4            # OpenAI accepts up to 4 stop sequences
MAX_N = 16               # choices per request (each holds a slot)
INT32_MAX = 2**31 - 1


# --- request bodies -----------------------------------------------------------------------------

def _unicode(value: str) -> str:
    api.text(value, "the text")  # a lone surrogate: a "\ud800" escape in the JSON
    return value


Text = Annotated[StrictStr, AfterValidator(_unicode)]
Number = Union[StrictInt, StrictFloat]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


# OpenAI fields this server does not act on, with the values that ask for nothing (a
# client may send those): any other value is a 400 naming the field, never ignored.
UNSUPPORTED = {"suffix": (None, ""), "best_of": (None, 1), "logit_bias": (None, {}),
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


MAX_LOGPROBS = 5          # completions' `logprobs` (OpenAI's limit)


MAX_CHOICES = 64          # prompts x n of one request (each choice holds a slot)


class CompletionBody(Body):
    # A prompt (text or token ids), or a batch of them (one choice, or n, each).
    prompt: Union[Text, list[StrictInt], list[Text], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(default=None, ge=0, le=INT32_MAX)  # 0: echo only
    logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False


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
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_TOP)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1, le=INT32_MAX)
    chat_template_kwargs: Optional[dict[Text, Any]] = None


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: a prompt (with the tokenizer's special tokens unless
    `add_special_tokens` is false, as a completion's prompt has them), or chat messages
    rendered by the chat template. `model` may be left out (clients such as
    lm-evaluation-harness do)."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[Text] = None
    prompt: Optional[Text] = None
    add_special_tokens: StrictBool = True
    messages: Optional[list[Message]] = Field(default=None, min_length=1)
    chat_template_kwargs: Optional[dict[Text, Any]] = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[Text] = None
    tokens: list[StrictInt]


# --- what a body asks for -----------------------------------------------------------------------

def refuse_unused(body: Body) -> None:
    """A field this server would not act on is a 400 that names it (OpenAI fields it does
    not implement, unless sent with the value that asks for nothing; unknown fields;
    `stream_options` without `stream`), never silently ignored; DESCRIPTIVE fields are
    accepted. Several such fields: the 400 names every one."""
    unsupported, unknown = [], []
    for name, value in (body.model_extra or {}).items():
        if name in DESCRIPTIVE:
            continue
        if name in UNSUPPORTED:
            if not any(_same(value, v) for v in UNSUPPORTED[name]):
                unsupported.append(name)
            continue
        unknown.append(name)
    if unsupported:
        raise APIError(400, f"{_listed(unsupported)} {'is' if len(unsupported) == 1 else 'are'}"
                            f" not supported by this server"
                            + (f"; unknown: {_listed(unknown)}" if unknown else ""),
                       param=", ".join(unsupported + unknown), code="unsupported_parameter")
    if unknown:
        raise APIError(400, f"unknown field{'s' * (len(unknown) > 1)} {_listed(unknown)}",
                       param=", ".join(unknown), code="unknown_parameter")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options applies to a streamed response: it needs "
                            "stream: true", param="stream_options")


def _listed(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _same(value, neutral) -> bool:
    """JSON equality: 0 and 0.0 alike, but not false and 0."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


@dataclasses.dataclass(frozen=True)
class Score:
    """What a request asks to be scored (scoring.score): the `top` most likely tokens per
    position, the prompt's tokens too (`echo`), and nothing generated (`only`)."""

    top: int = 0
    echo: bool = False
    only: bool = False


@dataclasses.dataclass
class Asked:
    """What one completion or chat request asks of the decoder, read from its body: its
    options, its choices, its prompt (or prompts, or messages and template keywords),
    what to score, the field that sets max_new_tokens, and the shape of its replies."""

    options: DecodeOptions
    n: int
    form: _Form
    max_tokens_field: str = "max_tokens"
    prompt: Any = None                 # one prompt: text or ids
    prompts: list | None = None        # a batch of prompts
    messages: list | None = None       # chat
    chat_template_kwargs: dict | None = None
    score: Score | None = None


def completion(body: CompletionBody, name: str, decode) -> Asked:
    """What a /v1/completions body asks (`name`: the model id; `decode`: ids -> text)."""
    refuse_unused(body)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens 0 generates nothing: it needs echo (to score the "
                            "prompt)", param="max_tokens")
    score = None
    if body.logprobs is not None or body.echo:
        score = Score(body.logprobs or 0, body.echo, max_tokens == 0)
        if body.echo and body.stream:
            raise APIError(400, "echo is not supported with stream: true on this server "
                                "(ask without streaming)", param="echo")
    asked = Asked(_options(body, max(max_tokens, 1)), body.n,
                  Completion(name, _usage_asked(body), score, decode), score=score)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) * body.n > MAX_CHOICES:
            raise APIError(400, f"{len(prompt)} prompts x n = {body.n} is more than the "
                                f"{MAX_CHOICES} choices one request may have", param="prompt")
        asked.prompts = prompt
    else:
        asked.prompt = prompt
    return asked


def chat(body: ChatBody, name: str, decode) -> Asked:
    """What a /v1/chat/completions body asks. Without a max_completion_tokens or
    max_tokens, the options' max_new_tokens is None: what fits, set once the prompt is
    tokenized."""
    refuse_unused(body)
    field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    options = _options(body, body.max_completion_tokens or body.max_tokens)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    score = Score(body.top_logprobs or 0) if body.logprobs else None
    messages = [_joined(m.model_dump(exclude_none=True)) for m in body.messages]
    for i, m in enumerate(messages):
        _check_json_strings(m, f"messages[{i}]", "messages")
    if body.chat_template_kwargs:
        _check_json_strings(body.chat_template_kwargs, "chat_template_kwargs",
                            "chat_template_kwargs")
    return Asked(options, body.n, Chat(name, _usage_asked(body), score, decode), field,
                 messages=messages, chat_template_kwargs=body.chat_template_kwargs or None,
                 score=score)


def _usage_asked(body: Body) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _joined(message: dict) -> dict:
    """A message whose content is a list of text parts, with the parts' text joined."""
    if isinstance(message.get("content"), list):
        message["content"] = "".join(part["text"] for part in message["content"])
    return message


def _options(body: Body, max_tokens: int | None) -> DecodeOptions:
    """The request's `DecodeOptions` (the server sets the schedule, its width and the
    cache)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOPS:
        raise APIError(400, f"at most {MAX_STOPS} stop sequences, got {len(stop)}", param="stop")
    if any(not s for s in stop):
        raise APIError(400, "stop sequences must not be empty", param="stop")
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    # Without a seed, a fresh one: the same request sampled twice gives two samples.
    seed = secrets.randbelow(2**32) if body.seed is None else body.seed
    return DecodeOptions(max_new_tokens=max_tokens, temperature=temperature,
                         top_p=None if body.top_p is None else float(body.top_p), seed=seed,
                         stop_sequences=tuple(stop))


def _check_json_strings(value, where: str, param: str) -> None:
    try:
        _check_strings(value, where)
    except InputError as e:
        raise APIError(400, str(e), param=param) from None


def _check_strings(value, where: str) -> None:
    """Every string inside free-form JSON (a message's extra fields, template keywords)
    is valid Unicode: the template and the tokenizer cannot take a lone surrogate."""
    if isinstance(value, str):
        api.text(value, where)
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
    statistics; with `stream_options.include_usage`, a last event with the usage).
    `score`: what the request asked to be scored, `decode`: ids -> text."""

    prefix, chunk_object, whole_object = "", "", ""

    def __init__(self, name: str, include_usage: bool = False, score: Score | None = None,
                 decode=None):
        cid, now = _ids()
        self.head = dict(id=f"{self.prefix}-{cid}", object=self.chunk_object, created=now,
                         model=name)
        self.include_usage, self.score, self.decode = include_usage, score, decode

    def opening(self, n: int) -> list[dict]:
        return []

    def event(self, index: int, piece: str, result, scored=None, at: int = 0,
              tokens=(), offset: int = 0) -> dict:
        """A stream's event of choice `index`: its text `piece`; with a score asked for,
        the log-probabilities of the chunk's `tokens`, which start at position `at` of
        `scored` and character `offset` of the choice's text."""
        choice = {"index": index, **self._piece(piece),
                  "finish_reason": result.finish_reason if result else None}
        if self.score is not None:
            choice["logprobs"] = (self._chunk_logprobs(tokens, scored, at, offset)
                                  if tokens else None)
        return {**self.head, "choices": [choice], **_stats(result)}

    def closing(self, results: list, prompt_len: int) -> list[dict]:
        if not self.include_usage:
            return []
        return [{**self.head, "choices": [], "usage": _usage(results, prompt_len)}]

    def response(self, results: list, prompts: list[list[int]], scores: list,
                 prompt_tokens: int) -> dict:
        """Every choice's whole reply (`prompts`: the prompt of each choice)."""
        choices = [{"index": i, **self._whole(r, scored, prompt),
                    "finish_reason": r.finish_reason}
                   for i, (r, scored, prompt) in enumerate(zip(results, scores, prompts))]
        return {**self.head, "object": self.whole_object, "choices": choices,
                "usage": _usage(results, prompt_tokens), **_stats(results[0])}

    def _top(self, ids, logps) -> list[tuple[str, float]]:
        return [(self.decode([int(i)]), float(v)) for i, v in zip(ids, logps)]


class Completion(_Form):
    """The /v1/completions replies of one request."""

    prefix, chunk_object, whole_object = "cmpl", "text_completion", "text_completion"

    def _piece(self, piece: str) -> dict:
        return {"text": piece, "logprobs": None}

    def _whole(self, result, scored, prompt) -> dict:
        text = visible(result)
        if self.score is None:
            return {"text": text, "logprobs": None}
        if self.score.echo:
            text = self.decode(list(prompt)) + text
        return {"text": text, "logprobs": self._logprobs(result, scored, prompt)}

    def _logprobs(self, result, scored, prompt) -> dict:
        """OpenAI's completion logprobs: the tokens (the prompt's too with echo), their
        log-probabilities (None for the first token, which nothing predicts), the most
        likely tokens at each position and each token's offset in the text."""
        start = 0 if self.score.echo else len(prompt)
        return self._chunk_logprobs((list(prompt) + list(result.tokens))[start:], scored, start)

    def _chunk_logprobs(self, ids, scored, at: int, offset: int = 0) -> dict:
        """The completion logprobs of `ids`, which start at position `at` of `scored` and
        character `offset` of the text."""
        tokens = [self.decode([int(i)]) for i in ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        end = at + len(ids)
        logp = [None if math.isnan(v) else float(v) for v in scored.logp[at:end]]
        top = [None if lp is None else dict(self._top(i, v)) for lp, i, v in
               zip(logp, scored.top_ids[at:end], scored.top_logp[at:end])]
        return {"tokens": tokens, "token_logprobs": logp, "top_logprobs": top,
                "text_offset": offsets}


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

    def _whole(self, result, scored, prompt) -> dict:
        out = {"message": {"role": "assistant", "content": visible(result)}}
        if self.score is not None:
            out["logprobs"] = self._chunk_logprobs(result.tokens, scored, len(prompt))
        return out

    def _chunk_logprobs(self, ids, scored, at: int, offset: int = 0) -> dict:
        """The chat logprobs of `ids`, which start at position `at` of `scored`."""
        end = at + len(ids)
        return {"content": [
            {**_entry(self.decode([int(t)]), float(lp)),
             "top_logprobs": [_entry(*x) for x in self._top(top_ids, top_logp)]}
            for t, lp, top_ids, top_logp in zip(ids, scored.logp[at:end],
                                                scored.top_ids[at:end], scored.top_logp[at:end])]}


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


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
