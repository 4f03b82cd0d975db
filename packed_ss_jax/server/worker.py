"""The server's work off the event loop: the `Preparer` turns a request's options into a
checked `Request` on a small thread pool (the chat template rendered, the prompt
tokenized, every argument checked: once, and no JAX work), and the `Decoder`, the one
thread that makes JAX calls, runs those requests in order and hands their chunks back to
the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading

from .. import api, chat, stops, validate
from ..options import Request
from ..http_guard import Expired, Limits, within
from ..validate import InputError
from .errors import APIError, draining

PREPARE_THREADS = 2      # requests rendered and tokenized at once, off the event loop


# --- the decoder thread -------------------------------------------------------------------------


class Job:
    """One checked request on its way through the decoder thread; chunks come back through
    an asyncio queue on the event loop (None ends it, an exception is re-raised there)."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request, self.loop = request, loop
        self.out: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.finished = False   # the decoder's last item is in `out`

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

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
            raise draining()
        self.live.add(job)
        self.jobs.put(job)

    def ended(self, job: Job) -> None:
        self.live.discard(job)

    def abort_all(self) -> None:
        """The drain's deadline: every request still waiting ends with a 503."""
        self.expired.set()
        for job in list(self.live):
            job.abort(draining())

    def stream(self, request: Request):
        """The server's one call into the engine: the chunks of a checked request."""
        return api.stream_request(self.model, request)

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():
                self.cancelled += 1
                continue
            self.busy = True
            try:
                self._decode(job)
            except Exception as e:  # reported to that request; the server goes on
                job.put(e)
            finally:
                job.finished = True
                job.put(None)
                self.busy = False

    def _decode(self, job: Job) -> None:
        for chunk in self.stream(job.request):
            if job.cancelled.is_set():
                self.cancelled += 1
                return  # the client is gone: free the decoder for the next request
            job.put(chunk)


# --- preparing requests -------------------------------------------------------------------------

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


class Preparer:
    """Turns a request's options into the decoder's checked request, off the event loop:
    the chat template rendered and the prompt tokenized once, the context and every other
    argument checked (`api.check`, no JAX work)."""

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

    async def __call__(self, options: dict, max_tokens_field: str) -> Request:
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self.pool, self._prepare, options, max_tokens_field)
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

    def _prepare(self, options: dict, max_tokens_field: str) -> Request:
        with self._lock:
            self._active += 1
        try:
            return self._checked(dict(options), max_tokens_field)
        finally:
            with self._lock:
                self._active -= 1

    def _checked(self, options: dict, max_tokens_field: str) -> Request:
        field = "messages" if "messages" in options else "prompt"
        try:
            ids = self._prompt_ids(options, field)
            for stop in options["stop_sequences"]:
                if len(stop) > self.max_stop_chars:  # before the tokenizer sees it
                    raise APIError(400, f"a stop string of {len(stop)} characters is longer "
                                        f"than the {stops.MAX_STOP_LEN} tokens a stop may "
                                        "have", param="stop")
            self._fits(len(ids), options["max_new_tokens"], field, max_tokens_field)
            return api.check(self.model, ids, **self.defaults, **options)
        except chat.TemplateError as e:  # the template's own words may name any field
            param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
            raise APIError(400, str(e), param=param) from None
        except InputError as e:
            raise APIError(400, str(e), param=_param(str(e), field, max_tokens_field)) from None

    def _prompt_ids(self, options: dict, field: str) -> list[int]:
        """The prompt's token ids (taking the prompt, or the messages and template keywords,
        out of `options`): the chat template rendered once, the text tokenized once."""
        if field == "messages":
            ids = api.chat_prompt(self.model, options.pop("messages"),
                                  options.pop("chat_template_kwargs", None),
                                  max_chars=min(self.max_chars, chat.MAX_CHARS))
        else:
            prompt = options.pop("prompt")
            if isinstance(prompt, str) and len(prompt) > self.max_chars:
                raise APIError(400, f"the prompt has {len(prompt)} characters: more than this "
                                    f"model's context of {self.context} tokens can hold",
                               param="prompt", code="context_length_exceeded")
            ids = validate.prompt_ids(self.model, prompt)
        return [int(i) for i in ids]

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
