"""The host side of the slot contract: one `Scheduler` that a batch, a stream, a queue
(continuous.py) and the server (client.py) all drive.

A scheduler holds one decode state of N slots of one program and which request sits in
each slot (a `Seat`). Its drivers differ only in when they admit and how far they let
the state run: a batch admits every request and runs until all stop; a stream runs k
iterations per launch on one slot, one launch kept in flight; a queue runs until a slot
stops and refills it; the server admits as slots free and hands out what each launch
made final. Each slot evolves as its request decoded alone would (the same first call,
then the same step), so every path gives `decode`'s tokens.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator, NamedTuple

import jax
import numpy as np

from . import validate
from .engine import Engine, Launch, Prefix, to_host
from .options import Batch, Program, Request
from .results import DecodeResult, of_outcome

DEFAULT_CHUNK = 16   # loop iterations per launch when streaming


@dataclasses.dataclass
class Seat:
    """One request in a slot: the driver's `tag` for it and how much of it was read."""

    request: Request
    tag: Any
    started: float
    count: int = 0      # leading output ids read out so far


class Update(NamedTuple):
    """One seated slot after a launch: the ids that became final and whether it stopped."""

    slot: int
    seat: Seat
    new: list[int]
    done: bool
    stopped: bool        # a stop marker (EOS among them) ended it in the loop
    output: np.ndarray   # the slot's output buffer (its first `seat.count` ids are final)


class Ended(NamedTuple):
    """A slot's request taken out: its seat, its outcome row and, when it ended on the
    host before its loop stopped, the count of final ids it keeps."""

    seat: Seat
    outcome: dict
    final: int | None


class Scheduler:
    """One decode state of `slots` slots of `program` (any prompt bucket) and its seats."""

    def __init__(self, engine: Engine, program: Program, slots: int):
        self.engine, self.program, self.slots = engine, program, slots
        self.reset()

    def reset(self) -> None:
        """Every slot empty (after a failed launch, which may have consumed the state).
        The state is made by the first admit (`Engine.adopt`) when that fills every slot,
        else here on first use."""
        self._state = None
        self.seats: list[Seat | None] = [None] * self.slots

    @property
    def state(self):
        if self._state is None:
            self._state = self.engine.slots(self.program, self.slots)
        return self._state

    @state.setter
    def state(self, value) -> None:
        self._state = value

    @property
    def free(self) -> list[int]:
        return [i for i, s in enumerate(self.seats) if s is None]

    @property
    def busy(self) -> int:
        return sum(s is not None for s in self.seats)

    def admit(self, requests, tags, rows: int | None = None,
              bucket: int | None = None) -> Prefix:
        """The first calls of `requests` (at most as many as free slots), in one prefill
        (`rows`, `bucket`: Engine.prefill's), written into the lowest free slots."""
        where = self.free[: len(requests)]
        if len(where) < len(requests):
            raise ValueError(f"{len(requests)} requests for {len(where)} free slots")
        prefix = self.engine.prefill(requests, rows, bucket)
        fresh = None
        if self._state is None and len(requests) == self.slots:
            fresh = self.engine.adopt(prefix)
        self.state = fresh if fresh is not None else self.engine.insert(self.state, prefix,
                                                                         where)
        now = time.perf_counter()
        for slot, request, tag in zip(where, requests, tags):
            self.seats[slot] = Seat(request, tag, now)
        return prefix

    def launch(self, k: int, eager: bool = False) -> Launch:
        """Dispatches at most k iterations (see Engine.generate); the state moves on."""
        launch = self.engine.generate(self.state, k, self.program, eager)
        self.state = launch.state
        return launch

    def updates(self, launch: Launch) -> list[Update]:
        """Each seated slot's newly final ids after `launch` (read back from the device)."""
        tokens, final, done, stopped = to_host(launch.progress)
        out = []
        for slot, seat in enumerate(self.seats):
            if seat is not None:
                count = int(final[slot])
                new = np.asarray(tokens[slot][seat.count: count]).tolist()
                seat.count = count
                out.append(Update(slot, seat, new, bool(done[slot]), bool(stopped[slot]),
                                  tokens[slot]))
        return out

    def release(self, ending, halt: bool = True) -> list[Ended]:
        """Takes the requests of `ending` ((slot, stopped in the loop) pairs) out of their
        slots: one stopped on the host is halted first (unless `halt` is False: the state
        is not run again) and keeps only its final ids."""
        if not ending:   # nothing to read back
            return []
        for slot, done in ending:
            if not done and halt:
                self.state = self.engine.halt(self.state, slot, self.program)
        outcome = self.engine.outcome(self.state, self.program)
        ended = []
        for slot, done in ending:
            seat, self.seats[slot] = self.seats[slot], None
            row = {name: x[slot] for name, x in outcome.items()}
            ended.append(Ended(seat, row, None if done else seat.count))
        return ended

    def result(self, ended: Ended, wall_s: float, compile_s: float = 0.0) -> DecodeResult:
        e = self.engine
        return of_outcome(e.model, e.family, ended.seat.request, ended.outcome, wall_s,
                          compile_s, ended.final)


def decode_batch(engine: Engine, batch: Batch) -> list[DecodeResult]:
    """Decodes a batch: one DecodeResult per prompt, each what that prompt decoded alone
    gives with its seed (`wall_s` is the batch's, compiling excluded). On a mesh the
    slots are split over "data"."""
    compiled, t0 = engine.compile_s, time.perf_counter()
    n = len(batch.members)
    s = Scheduler(engine, batch.program, n)
    s.admit(batch.members, range(n))
    jax.block_until_ready(s.launch(validate.INT32_MAX).state)
    # The decode's time, as one request's: its calls, not reading the outcomes back.
    wall = time.perf_counter() - t0 - (engine.compile_s - compiled)
    ended = s.release([(i, True) for i in range(n)])
    compile_s = engine.compile_s - compiled
    return [s.result(x, wall, compile_s) for x in ended]


class Streaming:
    """One request decoded `k` loop iterations per launch on a one-slot scheduler:

        decoding = Streaming(engine, request, k)
        for new_ids in decoding: ...     # the ids that became final in each launch
        decoding.result()                # the DecodeResult, `decode`'s (stats included)

    One launch is kept in flight: the next is dispatched (on the donated state) before
    this one's ids are read back, so the host's wait overlaps decoding. Stopping early (a
    client gone, a stop string seen on the host) is just not iterating further;
    `result()` then describes the output so far."""

    def __init__(self, engine: Engine, request: Request, k: int = DEFAULT_CHUNK):
        self.engine, self.request = engine, request
        self.k = validate.integer(k, "chunk", 1, validate.INT32_MAX,
                                  "the loop counts iterations in int32")
        self.scheduler: Scheduler | None = None
        self._pending: Launch | None = None
        self.done = self.stopped = False
        self.wall_s = self.compile_s = 0.0
        self._result: DecodeResult | None = None

    def launch(self) -> list[int]:
        """The ids that became final in the next launch (at most k iterations)."""
        if self.done:
            return []
        t0, compiled = time.perf_counter(), self.engine.compile_s
        if self.scheduler is None:   # the first call, and its progress (no iteration)
            self.scheduler = Scheduler(self.engine, self.request.program, 1)
            self.scheduler.admit([self.request], [0])
            self._pending = self.scheduler.launch(0)
        pending, self._pending = self._pending, self.scheduler.launch(self.k)
        (update,) = self.scheduler.updates(pending)
        self.done, self.stopped = update.done, update.stopped
        if self.done:  # the launch in flight runs no iteration; its end is the decode's
            jax.block_until_ready(self.scheduler.state)
        compiling = self.engine.compile_s - compiled
        self.compile_s += compiling
        self.wall_s += time.perf_counter() - t0 - compiling
        return update.new

    def __iter__(self) -> Iterator[list[int]]:
        while not self.done:
            yield self.launch()

    def result(self) -> DecodeResult:
        """The DecodeResult of the launches so far (NonFiniteError as `decode` raises it)."""
        if self._result is None:
            if self.scheduler is None:
                self.launch()
            (ended,) = self.scheduler.release([(0, self.done)], halt=False)
            self._result = self.scheduler.result(ended, self.wall_s, self.compile_s)
            self.done = True   # taken out of its slot: nothing more to launch
        return self._result
