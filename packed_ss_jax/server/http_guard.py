"""What stands between the network and the server's handlers: size and time limits on
every connection and request, and the API key.

- A request body larger than `max_body_bytes` gets 413 without being read in full: a
  Content-Length is checked before any byte of the body, a chunked body is counted as it
  arrives. A body that does not arrive within `body_timeout_s` gets 408.
- A connection must deliver a request's headers within `header_timeout_s` of opening, or
  of its previous response, or it is closed: a client that sends half a request line and
  waits holds a socket and a file descriptor for no more than that. uvicorn closes idle
  keep-alive connections itself (`keep_alive_s`), but re-arms nothing once a byte arrives.
- A connection opened past `max_connections` gets a 503 (JSON, as every refusal here)
  and is closed at once: connections held open by slow clients cost a file descriptor
  each for no longer than the header deadline, and no more than this many at a time.
- With `api_key`, every endpoint but /health needs `Authorization: Bearer <key>`
  (compared in constant time).

Every refusal here is an OpenAI-shaped JSON error body, like the handlers' own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
from typing import Callable

from uvicorn.protocols.http.h11_impl import H11Protocol


# One line per request: client, method, path, status, seconds (`packed-ss serve` prints it).
access = logging.getLogger("packed_ss.access")


@dataclasses.dataclass(frozen=True)
class Limits:
    """The server's limits; `packed-ss serve --help` states each flag and default."""

    # A 32k-token prompt is about 150 kB of JSON text or 250 kB as token ids.
    max_body_bytes: int = 4 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: int = 5
    max_connections: int = 256
    # Rendering a chat template and tokenizing run off the event loop; past this the
    # request is refused (the template renderer stops itself at its own limit).
    prepare_timeout_s: float = 30.0
    # SIGTERM/SIGINT: requests in flight get this long to finish, then an error.
    drain_timeout_s: float = 10.0
    api_key: str | None = None
    docs: bool = False
    # Web pages of these origins may call the server from a browser (CORS); "*": any.
    allowed_origins: tuple[str, ...] = ()


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def _reply(send, status: int, body: dict, headers=()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *headers]})
    await send({"type": "http.response.body", "body": data})


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class Guard:
    """ASGI middleware: the API key, then the body read in full under the size and time
    limits, then the app (which sees the body as if it came from the client)."""

    OPEN = frozenset({"/health"})

    def __init__(self, app, limits: Limits, expired: asyncio.Event | None = None):
        self.app, self.limits, self.expired = app, limits, expired

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), []

        async def sending(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            return await self._guarded(scope, receive, sending)
        finally:  # one line per request, when its response has ended
            client = scope.get("client") or ("-", 0)
            access.info("%s %s %s %s %.3fs", client[0], scope["method"], scope["path"],
                        status[0] if status else "-", time.perf_counter() - t0)

    async def _guarded(self, scope, receive, send):
        if self.limits.api_key is not None and scope["path"] not in self.OPEN \
                and not self._preflight(scope) and not self._authorized(scope):
            return await _reply(send, 401, error_body(
                "a valid API key is needed: send 'Authorization: Bearer <key>'",
                "invalid_request_error", code="invalid_api_key"),
                [(b"www-authenticate", b"Bearer")])
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        refusal = self._length_refusal(_header(scope, b"content-length"))
        if refusal is not None:
            return await _reply(send, *refusal)
        try:
            body = await within(self._read(receive), self.limits.body_timeout_s, self.expired)
        except Expired:
            return await _reply(send, 503, shutting_down())
        except _TooLarge:
            return await _reply(send, *self._too_large())
        except _Disconnected:
            return None
        except TimeoutError:
            return await _reply(send, 408, error_body(
                f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                "invalid_request_error", code="request_timeout"))
        return await self.app(scope, _replay(body, receive), send)

    def _preflight(self, scope) -> bool:
        """A browser's CORS preflight (it never carries credentials), when CORS is on: the
        app's CORS middleware answers it."""
        return (bool(self.limits.allowed_origins) and scope["method"] == "OPTIONS"
                and _header(scope, b"access-control-request-method") is not None)

    def _authorized(self, scope) -> bool:
        given = _header(scope, b"authorization") or b""
        want = b"Bearer " + self.limits.api_key.encode()
        return hmac.compare_digest(given, want)

    def _length_refusal(self, value: bytes | None):
        if value is None:
            return None
        if not value.isdigit():
            return 400, error_body("malformed Content-Length header", "invalid_request_error")
        if int(value) > self.limits.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self):
        return 413, error_body(f"the request body is larger than {self.limits.max_body_bytes} "
                               "bytes (packed-ss serve --max-body-bytes)",
                               "invalid_request_error", code="request_too_large")

    async def _read(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class Expired(Exception):
    """The server's drain has run out: what is still waiting gets 503."""


async def within(work, timeout: float, expired: asyncio.Event | None):
    """`work`'s result; TimeoutError past `timeout` seconds; `Expired` once `expired` is
    set (the drain's deadline: uvicorn cancels what is still running soon after, which
    would give the client a plain-text 500)."""
    task = asyncio.ensure_future(work)
    waits = {task}
    if expired is not None:
        waits.add(asyncio.ensure_future(expired.wait()))
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits - {task}:
            w.cancel()
    if task in done:
        return task.result()
    task.cancel()
    if expired is not None and expired.is_set():
        raise Expired
    raise TimeoutError


def shutting_down() -> dict:
    return error_body("the server is shutting down; retry with another server",
                      "server_error", code="server_shutting_down")


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


def _replay(body: bytes, receive) -> Callable:
    """A receive() that hands out the body already read, then the client's own messages
    (a disconnect, which cancels a streamed request)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _too_many(limit: int) -> bytes:
    """The whole reply to a connection past the limit, sent as it opens."""
    body = json.dumps(error_body(f"the server has {limit} connections open, its limit "
                                 "(packed-ss serve --max-connections); retry later",
                                 "server_error", code="too_many_connections")).encode()
    head = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n")
    return head % len(body) + body


def protocol(limits: Limits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for each request's headers."""

    class HeaderDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport):
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.write(_too_many(limits.max_connections))
                transport.close()
                return
            self._arm()

        def handle_events(self):
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers arrived
                self._disarm()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's headers get the same time

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self):
            self._disarm()
            self._deadline = self.loop.call_later(limits.header_timeout_s, self._expire)

        def _disarm(self):
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self):
            self._deadline = None
            if (self.cycle is None or self.cycle.response_complete) \
                    and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
