"""The server's preparing of requests off the event loop: the `Preparer` turns a request's
fields into checked `Request`s (one per choice) on a small thread pool (the chat template
rendered, the prompt tokenized, the request's `DecodeOptions` checked once, through the
engine client; no JAX work); the engine client's thread decodes them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading

from .. import api, chat
from ..api import InputError, Request
from .errors import APIError, draining
from .formats import Asked
from .http_guard import Expired, Limits, within

PREPARE_THREADS = 2      # requests rendered and tokenized at once, off the event loop


# --- preparing requests -------------------------------------------------------------------------

# The library's argument names (`InputError.param`) as the API's request fields; an error
# about any other argument is the prompt's (or the messages').
_FIELDS = {"stop_sequences": "stop", "temperature": "temperature", "top_p": "top_p",
           "seed": "seed", "chat_template_kwargs": "chat_template_kwargs"}


def _param(e: InputError, prompt_field: str, max_tokens_field: str) -> str:
    """The request field a library error is about."""
    if e.param == "max_new_tokens":
        return max_tokens_field
    return _FIELDS.get(e.param, prompt_field)


class Preparer:
    """Turns a request's fields into the decoder's checked requests, off the event loop:
    the chat template rendered and the prompt tokenized once, the length checked against
    the server's capacity (`--max-model-len`) and the options checked once (the engine
    client's `check`, on the server's schedule and width; no JAX work)."""

    def __init__(self, client, limits: Limits, expired: asyncio.Event):
        self.client, self.limits, self.expired = client, limits, expired
        self.model, self.context = client.model, client.capacity
        # No token covers more characters than its vocabulary entry spells, so a text
        # longer than this cannot fit the context: refused before the tokenizer sees it.
        longest = _longest_token(self.model.tokenizer)
        self.max_chars = self.context * longest
        self.max_stop_chars = api.MAX_STOP_LEN * longest  # likewise, a stop's tokens
        self.pool = concurrent.futures.ThreadPoolExecutor(PREPARE_THREADS,
                                                          thread_name_prefix="packed-ss-prepare")
        self._lock, self._active = threading.Lock(), 0

    async def __call__(self, asked: Asked) -> list[Request]:
        """The checked request of each of `asked`'s choices."""
        return await self._off_loop(self._prepare, asked)

    async def _off_loop(self, fn, *args):
        """`fn(*args)` on the pool, under the prepare time limit and the drain."""
        work = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        try:
            return await within(work, self.limits.prepare_timeout_s, self.expired)
        except Expired:
            raise draining() from None
        except TimeoutError:
            raise APIError(503, f"preparing the request (chat template, tokenizer) took longer "
                                f"than {self.limits.prepare_timeout_s:g} s", "server_error",
                           code="timeout") from None

    @property
    def busy(self) -> bool:
        return self._active > 0

    def shutdown(self) -> None:
        """Takes no more requests; those waiting for a thread are dropped."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _prepare(self, asked: Asked) -> list[Request]:
        with self._lock:
            self._active += 1
        try:
            return self._checked(asked)
        finally:
            with self._lock:
                self._active -= 1

    def _checked(self, asked: Asked) -> list[Request]:
        """The request of each of the `n` choices: one check, then choice i with the
        request's seed + i (mod 2**32). A batch of prompts: each prompt's choices, in
        order."""
        if asked.prompts is not None:
            return [r for prompt in asked.prompts
                    for r in self._checked(dataclasses.replace(asked, prompts=None,
                                                               prompt=prompt))]
        field = "messages" if asked.messages is not None else "prompt"
        options, max_tokens_field = asked.options, asked.max_tokens_field
        try:
            ids = self._prompt_ids(field, asked.messages if field == "messages" else
                                   asked.prompt, asked.chat_template_kwargs)
            for stop in options.stop_sequences:
                if len(stop) > self.max_stop_chars:  # before the tokenizer sees it
                    raise APIError(400, f"a stop string of {len(stop)} characters is longer "
                                        f"than the {api.MAX_STOP_LEN} tokens a stop may "
                                        "have", param="stop")
            if options.max_new_tokens is None:  # what fits (chat's default)
                options = dataclasses.replace(options,
                                              max_new_tokens=max(self.context - len(ids), 1))
            self._fits(len(ids), options.max_new_tokens, field, max_tokens_field)
            first = self.client.check(ids, options)
        except InputError as e:   # a chat.TemplateError among them
            raise APIError(400, str(e), param=_param(e, field, max_tokens_field)) from None
        return [first] + [dataclasses.replace(first, seed=(first.seed + i) % api.SEED_LIMIT)
                          for i in range(1, asked.n)]

    def _prompt_ids(self, field: str, value, chat_template_kwargs=None,
                    special: bool = True) -> list[int]:
        """The ids of a prompt (`field` "prompt") or of messages (`field` "messages"): the
        chat template rendered once, the text tokenized once (`special`: with the
        tokenizer's special tokens, as a completion's prompt)."""
        if field == "messages":
            return api.chat_prompt(self.model, value, chat_template_kwargs,
                                   max_chars=min(self.max_chars, chat.MAX_CHARS))
        if isinstance(value, str) and len(value) > self.max_chars:
            raise APIError(400, f"the prompt has {len(value)} characters: more than this "
                                f"server's limit of {self.context} tokens (--max-model-len) can "
                                "hold", param="prompt", code="context_length_exceeded")
        return api.prompt_ids(self.model, value, add_special_tokens=special)

    async def tokenize(self, body) -> list[int]:
        """The ids of a /tokenize body (a prompt, or messages through the chat template),
        off the event loop, under the prepare time limit."""
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give a prompt or messages (one of them)", param="prompt")
        if body.prompt is not None:
            field, value = "prompt", body.prompt
        else:
            field, value = "messages", [m.model_dump(exclude_none=True) for m in body.messages]

        def ids():
            try:
                return self._prompt_ids(field, value, body.chat_template_kwargs,
                                        body.add_special_tokens)
            except InputError as e:
                raise APIError(400, str(e), param=field) from None

        return await self._off_loop(ids)

    def _fits(self, prompt_len: int, max_tokens: int, field: str, max_tokens_field: str):
        """The request fits the server's cache (--max-model-len)."""
        if max_tokens >= self.context:
            raise APIError(400, f"{max_tokens_field} {max_tokens} is larger than this server's "
                                f"limit of {self.context} tokens (--max-model-len)",
                           param=max_tokens_field)
        if prompt_len + max_tokens > self.context:
            raise APIError(400, f"this server's limit is {self.context} tokens (--max-model-len);"
                                f" the {field} ({prompt_len} tokens) + {max_tokens_field} "
                                f"({max_tokens}) = {prompt_len + max_tokens}: shorten the "
                                f"{field} or lower {max_tokens_field}", param=field,
                           code="context_length_exceeded")


def _longest_token(tokenizer) -> int:
    """The most characters one token's text can hold (its vocabulary entry's length: byte-
    level entries spell a byte per character, text has at most a character per byte)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True) if tokenizer is not None else {}
    return max(map(len, vocab), default=1)
