"""Quiet failed reads of orbax params: one error line instead of orbax's and tensorstore's
tracebacks and log records around it (see `OrbaxNoise`)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

# Where orbax's own log records come from (orbax is imported only when first used).
_ORBAX_PART = f"{os.sep}orbax{os.sep}"
_CLOSED_LOOP = "Event loop is closed"
# After a failed read: how long no late callback must have come before the filter goes,
# and the longest wait for that (they came within milliseconds here).
_SETTLE_S, _SETTLE_MAX_S = 0.2, 2.0


class OrbaxNoise:
    """While params/ is read, drops what orbax and tensorstore print around a failed read,
    so that the failure is the one-line CheckpointError alone: tensorstore's completion
    callbacks for the reads still in flight land on the event loop orbax has already
    closed, each an unraisable RuntimeError traceback printed from tensorstore's threads
    (up to milliseconds after the failure), and orbax logs warnings through absl.
    Anything else reaches the previous hook or handlers unchanged. Re-entrant and shared
    between threads: the hook is installed by the first user and removed by the last."""

    _lock = threading.Lock()
    _users = 0
    _previous = None
    _installed = None  # the bound method set as the hook (each access makes a new one)
    _last = 0.0

    def __enter__(self):
        cls = type(self)
        with cls._lock:
            if cls._users == 0:
                cls._previous = sys.unraisablehook
                sys.unraisablehook = cls._installed = cls._hook
                logging.getLogger("absl").addFilter(cls._log_filter)
            cls._users += 1
        return self

    def __exit__(self, kind, value, tb):
        cls = type(self)
        if kind is not None:
            cls._settle(time.monotonic())
        with cls._lock:
            cls._users -= 1
            if cls._users == 0:
                if sys.unraisablehook is cls._installed:  # unless replaced since
                    sys.unraisablehook = cls._previous
                logging.getLogger("absl").removeFilter(cls._log_filter)

    @classmethod
    def _hook(cls, unraisable):
        if isinstance(unraisable.exc_value, RuntimeError) and \
                str(unraisable.exc_value) == _CLOSED_LOOP:
            cls._last = time.monotonic()
            return
        cls._previous(unraisable)

    @staticmethod
    def _log_filter(record: logging.LogRecord) -> bool:
        return _ORBAX_PART not in record.pathname

    @classmethod
    def _settle(cls, failed_at: float):
        """Waits until the reads a failure left in flight have had their callbacks."""
        deadline = failed_at + _SETTLE_MAX_S
        while (now := time.monotonic()) < deadline:
            quiet_since = max(failed_at, cls._last)
            if now - quiet_since >= _SETTLE_S:
                return
            time.sleep(min(_SETTLE_S, deadline - now))
