"""The process-wide store of compiled programs, and the one way every program is compiled.

Each compiled CPU program maps hundreds of memory regions and a process may map 65530,
so a process that meets many shapes (a test run, a notebook) must let old programs go:
every store counts toward one bound, and past it the least recently used program of any
store is dropped (compiled again, or read back from the persistent compilation cache,
when it is asked for again)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import weakref
from typing import Callable, NamedTuple, Sequence

import jax

from . import compile_cache, executables, sharding

DEFAULT_MAX_PROGRAMS = 32

# A warm-up's progress: one line per program it compiles or reads alone from disk
# (`packed-ss serve` shows it).
log = logging.getLogger(__name__)


class Key(NamedTuple):
    """What a compiled program is: its kind ("decode", "prefill", "generate", ...), the
    decode `Program` it runs, the slots of its decode state and the rows of its call."""

    kind: str
    program: object = None
    slots: int = 0
    rows: int = 0


def describe(key: Key) -> str:
    """A program in a progress line: its kind and what it is specialised on."""
    parts = []
    if getattr(key.program, "bucket", 0):
        parts.append(f"prompt bucket {key.program.bucket}")
    parts += [f"{n} {what}{'s' * (n != 1)}"
              for n, what in ((key.slots, "slot"), (key.rows, "row")) if n]
    return f"{key.kind} ({', '.join(parts)})" if parts else key.kind


class Warming:
    """A warm-up in progress (Engine.warm): the threads it runs on, the keys they asked
    for (noted for the next process), and its count of programs made ready against the
    `total` it expects (None: unknown)."""

    def __init__(self, total: int | None = None, ready: int = 0):
        self.threads = {threading.get_ident()}
        self.asked: set = set()
        self.total, self.ready = total, ready

    def ran(self) -> bool:
        return threading.get_ident() in self.threads

    def made_ready(self, key: Key, seconds: float) -> None:
        with _lock:   # its threads count in turn
            self.ready += 1
            of = "" if self.total is None else f" of {self.total}"
            log.info("%s: %.1f s (%d%s ready)", describe(key), seconds, self.ready, of)

    def run(self, tasks: Sequence[Callable[[], None]], workers: int | None = None) -> None:
        """Runs `tasks` side by side, on `workers` threads (default `compile_threads()`),
        each thread part of this warm-up: XLA compiles outside the interpreter's lock, so
        programs asked for by different tasks compile at once (one asked for twice
        compiles once: Programs.compiled). Re-raises the first task's error, once all
        have ended."""
        def joined(task):
            self.threads.add(threading.get_ident())
            task()

        workers = max(1, min(len(tasks), workers or compile_threads()))
        if workers == 1:
            for task in tasks:
                task()
            return
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(joined, t) for t in tasks]
        for f in futures:
            f.result()


def compile_threads() -> int:
    """How many programs a warm-up compiles at once (`PACKED_SS_COMPILE_THREADS`): by
    default one per core on a CPU, and one at a time on an accelerator, whose compiler
    times candidate kernels on the device (autotuning), where compiles side by side would
    time each other's. Always one at a time across several processes: a program that
    spans them must run in the same order in each."""
    if jax.process_count() > 1:
        return 1
    value = os.environ.get("PACKED_SS_COMPILE_THREADS", "")
    if not value:
        return (os.cpu_count() or 1) if jax.default_backend() == "cpu" else 1
    try:
        return max(int(value), 1)
    except ValueError:
        raise ValueError(f"PACKED_SS_COMPILE_THREADS must be a positive integer, "
                         f"got {value!r}") from None


def max_programs() -> int:
    """How many compiled programs all stores of this process hold together
    (`PACKED_SS_MAX_PROGRAMS`, default DEFAULT_MAX_PROGRAMS, and at least what
    `keep_at_least` asked for)."""
    value = os.environ.get("PACKED_SS_MAX_PROGRAMS", "")
    try:
        bound = max(int(value), 1) if value else DEFAULT_MAX_PROGRAMS
    except ValueError:
        raise ValueError(f"PACKED_SS_MAX_PROGRAMS must be a positive integer, "
                         f"got {value!r}") from None
    return max(bound, _floor)


_floor = 0


def keep_at_least(n: int) -> None:
    """Raises the bound on held programs to at least `n`, for a process that compiles a
    known set up front and must never compile again (the server)."""
    global _floor
    _floor = max(_floor, n)


class Programs(dict):
    """Compiled programs by `Key` (a dict that can be held weakly); `identity`: what they
    are compiled for (`identity(model)`), under which they are kept on disk
    (executables.py; None: not kept)."""

    def __init__(self, identity=None):
        super().__init__()
        self.identity = identity
        # the warm-up in progress: the keys its threads ask for are what it notes for the
        # next process; other threads decoding meanwhile are not its programs
        self.recording: Warming | None = None
        self.entries: dict = {}   # key -> the name of its entry on disk (executables.py)
        self._compiling: dict = {}   # key -> the lock of its compile

    def used(self, key):
        """The program of `key` (None if not held), now the most recently used."""
        recording = self.recording   # read once: a warm-up on another thread may end
        if recording is not None and recording.ran():
            recording.asked.add(key)
        with _lock:
            exe = self.get(key)
            if exe is not None:
                _recent[(id(self), key)] = weakref.ref(self)
                _recent.move_to_end((id(self), key))
        return exe

    def hold(self, key, exe) -> None:
        with _lock:
            self[key] = exe
            _recent[(id(self), key)] = weakref.ref(self)
            for k, store in list(_recent.items()):  # entries of stores gone
                if store() is None:
                    del _recent[k]
            while len(_recent) > max_programs():
                (_, old), store = _recent.popitem(last=False)
                if (held := store()) is not None:
                    held.pop(old, None)

    def drop(self, keep: Callable) -> None:
        """Lets go of the programs whose key `keep(key)` refuses (a server's previous
        choice of schedule, so that its programs do not crowd the current one's)."""
        with _lock:
            for key in [k for k in self if not keep(k)]:
                self.pop(key, None)
                _recent.pop((id(self), key), None)

    def preload(self, names=None) -> int:
        """Holds the programs kept on disk for this store's identity (executables.py): the
        entries `names` (None: every one; at most the bound on held programs, the most
        recently used first), read on several threads; returns how many."""
        compile_cache.ensure()
        return executables.preload(self.identity, self._hold_entry, max_programs(), names)

    def _hold_entry(self, key, exe, name: str) -> None:
        self.hold(key, exe)
        self.entries[key] = name

    def compiled(self, key, fn: Callable, *args, donate: tuple[int, ...] = ()):
        """`fn` lowered and compiled for `args` once per `key`: the executable and the
        seconds spent compiling (or loading it from disk) now. `donate`: the arguments whose buffers the program may
        reuse for its outputs (a state updated in place)."""
        exe = self.used(key)
        if exe is not None:
            return exe, 0.0
        t0 = time.perf_counter()
        with self._compile_of(key):   # another thread asking for it waits for this one
            exe = self.get(key)
            if exe is None:
                compile_cache.ensure()
                exe, name = executables.compiled(self.identity, key, fn, args, donate)
                if name is not None:
                    self.entries[key] = name
                self.hold(key, exe)
                recording = self.recording
                if recording is not None and recording.ran():
                    recording.made_ready(key, time.perf_counter() - t0)
        return exe, time.perf_counter() - t0

    @contextlib.contextmanager
    def _compile_of(self, key):
        with _lock:
            lock = self._compiling.setdefault(key, threading.RLock())
        with lock:
            yield


# Every held program, least recently used first: (id of its store, key) -> its store.
_recent: collections.OrderedDict = collections.OrderedDict()
_lock = threading.RLock()   # a server readies programs beside its decoder thread


def clear_programs() -> None:
    """Lets go of every compiled program of this process (to free their memory between
    jobs); a program asked for again is compiled again, or read back from the persistent
    compilation cache."""
    with _lock:
        for key, store in list(_recent.items()):
            if (held := store()) is not None:
                held.pop(key[1], None)
        _recent.clear()


# Stores by (the model's compile identity, the weights' placement), held weakly: alive
# while an engine uses one.
_shared: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def shared(model) -> Programs:
    """The store of every engine of a model with this config on these devices: a program
    takes the weights as an argument, so another checkpoint of the same shape (or new
    weights in a training loop) runs the same programs."""
    where = identity(model)
    store = _shared.get(where)
    if store is None:
        store = _shared[where] = Programs(where)
    return store


def identity(model) -> tuple:
    """What a model's programs are compiled for: its compile identity and where its
    weights lie."""
    return (model.program_key, _placement(model.params))


def _placement(params) -> tuple:
    """Where the weights lie, as far as a compiled program depends on it: nothing on one
    device, else every weight's sharding with its devices."""
    if sharding.mesh_of(params) is None:
        return ()
    return tuple(executables.placed(x.sharding) for x in jax.tree.leaves(params))
