"""SIGINT and SIGTERM as exceptions, with sections that a signal cannot split.

While a `SignalGuard` is installed both signals raise `Interrupted`, so a conversion's
`except` cleanup runs (SIGTERM would otherwise end the process on the spot and leave its
hidden directory behind). The one rule: the guard raises only while `armed`, and every
cleanup path starts with `guard.armed = False`, a plain attribute store that CPython never
interrupts with a handler. Signals that arrive while disarmed are kept in `pending`
(`check` raises again for one that library code swallowed), and `blocked()` holds them
at the kernel around the renames. Why a signal mask alone is not enough, and what a user
sees: docs/checkpoints.md#signals.
"""

from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived during a guarded operation."""

    def __init__(self, signum: int, detail: str | None = None):
        self.signum = signum
        message = f"interrupted by {signal.Signals(signum).name}"
        super().__init__(f"{message}: {detail}" if detail else message)

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell convention for "ended by signal N"


class SignalGuard:
    """Installs exception-raising SIGINT/SIGTERM handlers for its `with` block.

    Only signals still at their default disposition are taken over (SIG_DFL, or Python's
    KeyboardInterrupt handler for SIGINT): an ignored signal stays ignored and a handler
    the caller installed stays in charge. Outside the main thread no handler can be
    installed; the guard then does nothing and cleanup relies on ordinary exceptions.
    """

    def __init__(self, signals=SIGNALS):
        self.signals = tuple(signals)
        self.previous: dict[int, object] = {}
        self.armed = False
        self.fired: int | None = None    # the signal that raised, if one did
        self.pending: int | None = None  # a signal that arrived while disarmed

    @property
    def installed(self) -> bool:
        return bool(self.previous)

    def _handle(self, signum, frame):
        if self.armed:
            self.armed = False  # one exception per guard: cleanup runs undisturbed
            self.fired = signum
            raise Interrupted(signum)
        if self.pending is None:
            self.pending = signum

    def __enter__(self) -> "SignalGuard":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                current = signal.getsignal(sig)
                if current in (signal.SIG_DFL, signal.default_int_handler):
                    self.previous[sig] = current
                    signal.signal(sig, self._handle)
        self.armed = True
        return self

    def __exit__(self, *exc):
        self.armed = False
        # Not under `blocked()`: a signal held there would reach the restored handler,
        # which for SIGTERM ends the process; here it reaches ours and is `pending`.
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()
        return False

    @contextlib.contextmanager
    def blocked(self):
        """Holds SIGINT/SIGTERM at the kernel in this thread for the block (disarm first)."""
        if not self.installed or not hasattr(signal, "pthread_sigmask"):
            yield
            return
        old = signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def check(self):
        """Raises again for a signal whose exception library code swallowed.

        An exception raised in a garbage-collection callback or a finalizer is printed
        and dropped ("Exception ignored in ..."); the guard has disarmed itself by then,
        so without these checks the signal would be lost.
        """
        if self.fired is not None:
            raise Interrupted(self.fired)

    def raise_pending(self, detail: str | None = None):
        """Raises `Interrupted` for a signal that arrived while disarmed, or whose
        exception was swallowed."""
        signum = self.pending if self.pending is not None else self.fired
        self.pending = self.fired = None
        if signum is not None:
            raise Interrupted(signum, detail)
