"""The process-wide store of compiled programs, and the one way every program is compiled.

Each compiled CPU program maps hundreds of memory regions and a process may map 65530,
so a process that meets many shapes (a test run, a notebook) must let old programs go:
every store counts toward one bound, and past it the least recently used program of any
store is dropped (compiled again, or read back from the persistent compilation cache,
when it is asked for again)."""

from __future__ import annotations

import collections
import os
import threading
import time
import weakref
from typing import Callable, NamedTuple

import jax

from . import compile_cache, executables, sharding

DEFAULT_MAX_PROGRAMS = 32


class Key(NamedTuple):
    """What a compiled program is: its kind ("decode", "prefill", "generate", ...), the
    decode `Program` it runs, the slots of its decode state and the rows of its call."""

    kind: str
    program: object = None
    slots: int = 0
    rows: int = 0


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
        # (the thread of a warm-up, the keys it asked for): what it notes for the next
        # process; other threads decoding meanwhile are not its programs
        self.recording: tuple[int, set] | None = None
        self.entries: dict = {}   # key -> the name of its entry on disk (executables.py)

    def used(self, key):
        """The program of `key` (None if not held), now the most recently used."""
        recording = self.recording   # read once: a warm-up on another thread may end
        if recording is not None and recording[0] == threading.get_ident():
            recording[1].add(key)
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
        compile_cache.ensure()
        t0 = time.perf_counter()
        exe, name = executables.compiled(self.identity, key, fn, args, donate)
        if name is not None:
            self.entries[key] = name
        self.hold(key, exe)
        return exe, time.perf_counter() - t0


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
