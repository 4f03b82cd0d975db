"""Chat templates rendered in a worker process, under a wall-time and an output-size limit.

A chat template is code that came with a checkpoint. Jinja's sandbox stops it reaching
Python's internals, but not from looping, recursing or building a gigabyte string, so
templates are compiled and rendered in one worker process, started from this file as a
script (`-I`; neither the package nor JAX is imported there) and shared under a lock.
Past `time_limit` the caller kills it (SIGKILL) and the next render starts a new one; its
output is capped at `max_chars`, its address space and CPU time by rlimits. Requests go
to it pickled (the parent is trusted); replies come back as JSON, parsed and checked,
never unpickled. The limits and why: docs/hostile_input.md#chat-templates; chat.py
words the failures.
"""

from __future__ import annotations

import atexit
import io
import json
import math
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from datetime import datetime
from functools import lru_cache

try:
    import resource
except ImportError:  # then the worker runs without memory and CPU caps
    resource = None

TIME_LIMIT = 5.0            # seconds a render may take
MAX_CHARS = 4 * 2**20       # characters a rendering may hold
MAX_MEMORY = 2**28          # bytes of address space for the worker while it renders
BYTES_PER_CHAR = 32         # memory allowed per character of max_chars, when above MAX_MEMORY
ORPHAN_CHECK = 0.5          # seconds between the worker's checks that its parent lives
START_TIMEOUT = 60.0        # seconds for the worker to start (a loaded machine is slow)
MAX_DETAIL = 2000           # characters of a template's own error message kept
_HEADER = struct.Struct("!Q")
_CHUNK = 1 << 20


class RenderFailure(Exception):
    """A render that produced no text: `kind` says why (chat.py turns it into a message).

    Kinds: "timeout", "too_long", "memory", "crashed" (the worker died or broke the
    protocol), "refused" (raise_exception), "syntax" (with `line`), "error" (any other
    exception), "surrogate" (the output is not valid Unicode; `at` is the character),
    "unavailable" (the worker could not start)."""

    def __init__(self, kind: str, detail: str = "", **extra):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind, self.detail, self.extra = kind, detail, extra


def memory_limit(max_chars: int) -> int:
    """The worker's address-space limit for a render allowed `max_chars` characters."""
    return max(MAX_MEMORY, BYTES_PER_CHAR * max_chars)


# --- the Jinja environment (runs in the worker; `render_here` runs it in-process) ---

class Refusal(Exception):
    """What `raise_exception(message)` raises inside a template."""


def _raise_exception(message):
    raise Refusal(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' own filter: Jinja's built-in tojson escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment():
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers): rendered as
        their content, as transformers does when it does not collect masks."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def _compile(source: str):
    return _environment().from_string(source)


class _TooLong(Exception):
    pass


class _Surrogate(Exception):
    def __init__(self, at: int, code: int):
        super().__init__(at, code)
        self.at, self.code = at, code


def _render_text(source: str, context: dict, max_chars: int) -> str:
    # Piece by piece, so a long rendering stops at the limit instead of being built whole.
    pieces, size = [], 0
    for piece in _compile(source).generate(**context):
        size += len(piece)
        if size > max_chars:
            raise _TooLong
        pieces.append(piece)
    text = "".join(pieces)
    try:
        text.encode("utf-8")  # a '\ud800' literal makes a lone surrogate: no tokenizer takes it
    except UnicodeEncodeError as e:
        raise _Surrogate(e.start, ord(text[e.start])) from None
    return text


def _short(text: str) -> str:
    text = text[:MAX_DETAIL]
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _outcome(source: str, context: dict, max_chars: int) -> dict:
    """The render as a reply: {"kind": "ok", "text": ...} or a failure's kind and detail."""
    import jinja2

    try:
        text = _render_text(source, context, max_chars)
    except _TooLong:
        return {"kind": "too_long"}
    except _Surrogate as e:
        return {"kind": "surrogate", "at": e.at, "code": e.code}
    except MemoryError:
        return {"kind": "memory"}
    except Refusal as e:
        return {"kind": "refused", "detail": _short(str(e))}
    except jinja2.TemplateSyntaxError as e:
        return {"kind": "syntax", "detail": _short(str(e.message)), "line": e.lineno}
    except Exception as e:  # jinja2's errors, and what a template's own code raises
        return {"kind": "error", "detail": _short(f"{type(e).__name__}: {e}")}
    return {"kind": "ok", "text": text}


def render_here(source: str, context: dict, max_chars: int = MAX_CHARS) -> str:
    """Renders in this process, without the time and memory limits: the reference the
    worker's renderings are checked against (tests), never for untrusted templates."""
    reply = _outcome(source, context, max_chars)
    if reply["kind"] != "ok":
        extra = {k: v for k, v in reply.items() if k not in ("kind", "detail")}
        raise RenderFailure(reply["kind"], reply.get("detail", ""), **extra)
    return reply["text"]


# --- the worker process ---

def _limit(time_limit: float, memory: int) -> None:
    """This process's limits for one render."""
    if resource is None:
        return
    for which, soft in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, None)):
        hard = resource.getrlimit(which)[1]
        if soft is None:  # CPU seconds are counted from the start: add to those used
            usage = resource.getrusage(resource.RUSAGE_SELF)
            soft = math.ceil(usage.ru_utime + usage.ru_stime + time_limit) + 1
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):  # macOS refuses RLIMIT_AS: the other limits hold
            pass


def _unlimit_memory() -> None:
    # The reply (up to max_chars characters of JSON) is written outside the render's cap.
    if resource is not None:
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        try:
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        except (ValueError, OSError):
            pass


def _read_frame(stream) -> bytes | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    payload = stream.read(size)
    return payload if len(payload) == size else None


def _write_frame(stream, reply: dict) -> None:
    payload = json.dumps(reply, ensure_ascii=False).encode("utf-8")
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def _exit_with(parent: int) -> None:
    # Idle, the worker ends at the end of its input; mid-render it would run on (to its CPU
    # limit) after a parent killed outright: it checks its parent instead.
    while os.getppid() == parent:
        time.sleep(ORPHAN_CHECK)
    os._exit(0)


def _serve() -> None:
    """The worker: renders each request from stdin, replies on (a private copy of) stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which kills us
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    if resource is not None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print must not corrupt the replies
    requests = sys.stdin.buffer
    first = _read_frame(requests)
    if first is None:
        return
    # The parent's path, so Jinja is found where the parent found it.
    sys.path[:] = _Builtins(io.BytesIO(first)).load()
    try:
        _environment()
    except Exception as e:
        _write_frame(replies, {"kind": "unavailable", "detail": f"{type(e).__name__}: {e}"})
        return
    _write_frame(replies, {"kind": "ready"})
    while (frame := _read_frame(requests)) is not None:
        try:
            source, context, time_limit, max_chars = _Builtins(io.BytesIO(frame)).load()
        except pickle.UnpicklingError as e:
            _write_frame(replies, {"kind": "error", "detail": f"UnpicklingError: {e}"})
            continue
        _limit(time_limit, memory_limit(max_chars))
        reply = _outcome(source, context, max_chars)
        _unlimit_memory()
        _write_frame(replies, reply)


class _Builtins(pickle.Unpickler):
    """Loads plain data only (str, numbers, None, lists, tuples, dicts need no class), so a
    request never imports a module into the worker."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"the template's data holds a {module}.{name}")


# --- the parent side ---

class _Deadline(Exception):
    pass


def _wait(fd: int, event: int, deadline: float) -> None:
    """Until `fd` is ready (or closed at the other end); _Deadline past `deadline`. (poll,
    not select: a server's descriptors can be numbered past select's 1024.)"""
    poller = select.poll()
    poller.register(fd, event)
    while not poller.poll(max(0, math.ceil((deadline - time.monotonic()) * 1000))):
        if time.monotonic() >= deadline:
            raise _Deadline


class _Worker:
    """One worker process and its pipes."""

    def __init__(self):
        if not sys.executable:
            raise RenderFailure("unavailable", "no Python executable to start a worker with")
        self.proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.owner = os.getpid()
        os.set_blocking(self.proc.stdin.fileno(), False)
        try:
            self.exchange(pickle.dumps(list(sys.path)), time.monotonic() + START_TIMEOUT, 4096,
                          expect="ready")
        except BaseException:
            self.kill()
            raise

    def exchange(self, payload: bytes, deadline: float, max_reply: int,
                 expect: str | None = None) -> dict:
        self._send(_HEADER.pack(len(payload)) + payload, deadline)
        (size,) = _HEADER.unpack(self._receive(_HEADER.size, deadline))
        if size > max_reply:
            raise RenderFailure("crashed", f"a reply of {size} bytes")
        try:
            reply = json.loads(self._receive(size, deadline))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise RenderFailure("crashed", "a reply that is not JSON") from None
        if not isinstance(reply, dict):
            raise RenderFailure("crashed", "a reply that is not a JSON object")
        if expect and reply.get("kind") != expect:
            raise RenderFailure("unavailable", str(reply.get("detail", reply))[:MAX_DETAIL])
        return reply

    def _send(self, data: bytes, deadline: float) -> None:
        fd, view = self.proc.stdin.fileno(), memoryview(data)
        while view:
            _wait(fd, select.POLLOUT, deadline)
            try:
                view = view[os.write(fd, view[:_CHUNK]):]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                raise RenderFailure("crashed", self._exit()) from None

    def _receive(self, size: int, deadline: float) -> bytes:
        fd, chunks, got = self.proc.stdout.fileno(), [], 0
        while got < size:
            _wait(fd, select.POLLIN, deadline)
            chunk = os.read(fd, min(size - got, _CHUNK))
            if not chunk:
                raise RenderFailure("crashed", self._exit())
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _exit(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "the worker stopped answering"
        if code < 0 and -code == getattr(signal, "SIGXCPU", None):
            raise _Deadline
        return f"the worker exited with status {code}"

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def kill(self) -> None:
        """Kills and reaps the worker (nothing is left behind, not even a zombie)."""
        if self.owner == os.getpid():
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        self.forget()

    def forget(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


_lock = threading.Lock()
_worker: _Worker | None = None


def render(source: str, context: dict, *, time_limit: float = TIME_LIMIT,
           max_chars: int = MAX_CHARS) -> str:
    """`source` rendered with `context` (plain data: str, numbers, None, lists, dicts) in the
    worker; raises RenderFailure when it fails or passes a limit."""
    payload = pickle.dumps((source, context, time_limit, max_chars), pickle.HIGHEST_PROTOCOL)
    # A reply is JSON text: at most 6 bytes a character (a \\u escape), plus its envelope.
    max_reply = 6 * max_chars + 4 * MAX_DETAIL + 4096
    with _lock:
        worker = _running()
        try:
            reply = worker.exchange(payload, time.monotonic() + time_limit, max_reply)
        except _Deadline:
            _discard()
            raise RenderFailure("timeout") from None
        except BaseException:  # a crash, or an interrupt that leaves a reply unread
            _discard()
            raise
        return _checked(reply, max_chars)


def _running() -> _Worker:
    global _worker
    if _worker is not None and not _worker.alive():
        _discard()
    if _worker is None:
        try:
            _worker = _Worker()
        except _Deadline:
            raise RenderFailure("unavailable", f"the worker did not start within "
                                f"{START_TIMEOUT:g} s") from None
        except (OSError, RenderFailure) as e:
            detail = e.detail if isinstance(e, RenderFailure) else f"{type(e).__name__}: {e}"
            raise RenderFailure("unavailable", detail) from None
    return _worker


def _discard() -> None:
    global _worker
    if _worker is not None:
        worker, _worker = _worker, None
        worker.kill()


def _checked(reply: dict, max_chars: int) -> str:
    """The text of a well-formed reply; a RenderFailure for the others."""
    kind = reply.get("kind")
    if kind == "ok":
        text = reply.get("text")
        if not isinstance(text, str) or len(text) > max_chars:
            _discard()
            raise RenderFailure("crashed", "a malformed reply")
        try:
            text.encode("utf-8")  # a JSON \\ud800 escape would bring a surrogate back
        except UnicodeEncodeError as e:
            raise RenderFailure("surrogate", at=e.start, code=ord(text[e.start])) from None
        return text
    if kind in ("too_long", "refused", "error", "syntax", "surrogate"):
        extra = {k: v for k, v in reply.items() if k in ("line", "at", "code")
                 and isinstance(v, int) and not isinstance(v, bool)}
        return _fail(kind, reply.get("detail"), extra)
    _discard()  # after a MemoryError, or a reply it should not give, start afresh
    if kind == "memory":
        raise RenderFailure("memory")
    raise RenderFailure("crashed", "a malformed reply")


def _fail(kind: str, detail, extra: dict):
    detail = detail[:MAX_DETAIL] if isinstance(detail, str) else ""
    raise RenderFailure(kind, detail.encode("utf-8", "backslashreplace").decode("utf-8"),
                        **extra)


def worker_pid() -> int | None:
    """The running worker's process id (None when none is running)."""
    worker = _worker
    return worker.proc.pid if worker is not None and worker.alive() else None


def shutdown() -> None:
    """Kills the worker (at interpreter exit; the next render starts a new one)."""
    # A render stuck in another thread ends within its time limit; at exit, wait no longer.
    acquired = _lock.acquire(timeout=1.0)
    try:
        _discard()
    finally:
        if acquired:
            _lock.release()


def _after_fork_in_child() -> None:
    # The parent's worker is not ours: drop its pipes (so it still sees its parent leave),
    # leave the process alone.
    global _lock, _worker
    _lock = threading.Lock()
    if _worker is not None:
        worker, _worker = _worker, None
        worker.forget()


if __name__ == "__main__":
    _serve()
else:
    atexit.register(shutdown)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
