"""Running the app: the listening socket, and uvicorn's server with the drain on
SIGTERM/SIGINT (see the package's docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import socket
import threading
from pathlib import Path

import uvicorn

from .http_guard import Limits, access, protocol


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
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def model_name(path: str | None) -> str:
    """The model id a checkpoint is served under by default: its folder's name."""
    return Path(path).name if path else "nld-tiny"


def serve(app, sock: socket.socket, limits: Limits) -> bool:
    """Serves `app` on the bound `sock` until SIGTERM/SIGINT (or until its programs fail
    to be made ready), then drains (see the package docstring) and returns whether its
    threads have ended. A decoder inside a compile, or
    a tokenizer inside a long text, cannot be stopped, and the interpreter must not wait
    for them or be torn down under them (`os._exit`, once the output is flushed)."""
    # The connection limit is the protocol's (a JSON 503 as a connection opens), not
    # uvicorn's limit_concurrency (plain text, once a request has been read).
    config = uvicorn.Config(app, http=protocol(limits), lifespan="on", log_level="warning",
                            timeout_keep_alive=limits.keep_alive_s,
                            # after our own drain has ended every request
                            timeout_graceful_shutdown=int(limits.drain_timeout_s) + 3)
    state = app.app.state
    _log_access()
    server = _Draining(config, state.decoder, state.deadline, limits)
    threading.Thread(target=_stop_if_not_ready, args=(state.decoder, server), daemon=True,
                     name="packed-ss-start-watch").start()
    server.run(sockets=[sock])
    return not state.decoder.running and not state.preparer.busy


def _stop_if_not_ready(decoder, server: uvicorn.Server) -> None:
    """Stops a server whose programs could not be made ready (a warm-up on the decoder
    thread that failed): it would never decode."""
    decoder.settled.wait()
    if decoder.failed is not None:
        server.should_exit = True


def _log_access() -> None:
    """The access log (http_guard.access) on stderr, a line per request."""
    if not access.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        access.addHandler(handler)
        access.setLevel(logging.INFO)
        access.propagate = False


class _Draining(uvicorn.Server):
    """uvicorn's server whose first exit signal drains: the listening socket closes, a
    request on a connection already open gets a JSON 503 at once, the ones in flight are
    ended with 503 at the drain deadline; uvicorn's own shutdown (which closes the idle
    connections) starts once none is left in flight. A second signal starts it now."""

    def __init__(self, config, decoder, deadline, limits: Limits):
        super().__init__(config)
        self.decoder, self.deadline, self.limits = decoder, deadline, limits

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
        if self.decoder.draining:
            super().handle_exit(sig, frame)
            return
        self.decoder.draining = True
        # A signal handler runs between two steps of the event loop, on its thread.
        asyncio.get_running_loop().call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        for server in getattr(self, "servers", ()):   # none yet before uvicorn's startup
            server.close()   # no new connection; the open ones stay until the drain ends
        asyncio.get_running_loop().call_later(self.limits.drain_timeout_s, self._deadline)

    def _deadline(self) -> None:
        self.deadline()
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.decoder.draining and not self.server_state.tasks:
            self.should_exit = True   # nothing in flight: the drain has ended
        return await super().on_tick(counter)
