"""Continuous batching: N slots kept busy over a long queue of prompts, on the
`Scheduler` (scheduler.py).

Static batches wait for their longest sequence. Here each launch runs until a running
slot stops (or `every` iterations at most); the host takes the stopped slots' outcomes
and refills them with the next prompts in one prefill, and the loop goes on. Each
sequence's state evolves exactly as when decoded alone, so every result equals that
prompt decoded alone. A refill pads its prompts only to the bucket of its own longest
(`refill_bucket`) and its rows to a power of two (at most the slots), so a queue
compiles a handful of refill programs. `Stats` reports the share of wall time spent
outside the device programs (the host round trips).
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from . import options
from .engine import Engine, to_host
from .options import Batch
from .results import DecodeResult
from .scheduler import Scheduler


@dataclasses.dataclass
class Stats:
    wall_s: float          # the whole queue, first call to last result (compiling excluded)
    loop_s: float          # launch to its results on the host (a refill's prefill and
                           # insert, dispatched before it, run first on the device)
    refill_s: float        # taking the stopped slots out (their outcome read back) and
                           # dispatching the refill (prefill, insert)
    round_trips: int       # times the loop handed control back to the host
    refills: int           # prompts started in a refill (not in the first batch)
    steps: int             # batched loop iterations (each one step of every running slot)
    refill_calls: int      # refill programs run (each starts one or more prompts)
    forward_calls: int     # batched forward calls: first calls (batch, refills) and steps'

    @property
    def host_fraction(self) -> float:
        """Share of wall time outside the device programs: the host round trips."""
        return max(0.0, 1.0 - (self.loop_s + self.refill_s) / self.wall_s)


def _size(k: int, slots: int) -> int:
    """A refill of k prompts runs padded to the next power of two (at most `slots`)."""
    return min(slots, 1 << (k - 1).bit_length())


def refill_bucket(n: int, capacity: int) -> int:
    """The padded prompt length of a refill whose longest prompt has n ids: the next of
    16, 24, 32, 48, 64, 96, ... (powers of two and their halfway points; at most
    `capacity`). A first call's cost grows with its rows, and a refill pays it for every
    prompt it starts; the halfway points cut the padding from up to half the rows to up
    to a third, for twice the programs."""
    b = options.MIN_BUCKET
    while b < n:
        b = b * 3 // 2 if (b & (b - 1)) == 0 else b // 3 * 4  # 2^k -> 1.5 * 2^k -> 2^(k+1)
    return min(b, capacity)


class _Clock:
    """Seconds since `start`, less the seconds the engine spent compiling meanwhile."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.start()

    def start(self) -> None:
        self.t0, self.compiled = time.perf_counter(), self.engine.compile_s

    def seconds(self) -> float:
        compiling = self.engine.compile_s - self.compiled
        return time.perf_counter() - self.t0 - compiling


def _first_calls(prefills) -> int:
    """The batched forward calls the prefills made (one each, or two when a sampled draft
    follows), from their rows' NFE counts. A refill's are read at the end: reading them
    as it is made would hold the next launch until that prefill is done."""
    return sum(int(np.max(nfe)) for nfe in to_host(prefills))


def decode_queue(engine: Engine, batch: Batch, slots: int,
                 every: int = 64) -> tuple[list[DecodeResult], Stats]:
    """Decodes every request of `batch` (any number) with `slots` sequences at a time,
    refilling stopped slots as they stop (handing control to the host at least every
    `every` iterations; both checked by the caller, `api.decode_continuous`); returns one
    DecodeResult per request, in order (each equal to that request decoded alone;
    `wall_s` is the whole queue's, compilation excluded), and the timing `Stats`."""
    members, capacity = batch.members, batch.program.capacity
    compiled, whole = engine.compile_s, _Clock(engine)
    s = Scheduler(engine, batch.program, slots)
    queue = collections.deque(range(len(members)))
    head = [queue.popleft() for _ in range(min(slots, len(queue)))]
    # (the first prefill's state may become the slots' state, donated to the first launch)
    forward = _first_calls([s.admit([members[i] for i in head], head).state.nfe])
    prefills = []   # the refills' NFE counts, read at the end
    outs: list = [None] * len(members)
    loop_s = refill_s = 0.0
    trips = refills = steps = calls = 0
    while s.busy:
        clock = _Clock(engine)
        launch = s.launch(every, eager=True)
        done, ran, made = to_host((launch.progress.done, launch.ran, launch.made))
        loop_s += clock.seconds()
        trips, steps, forward = trips + 1, steps + int(ran), forward + int(made)
        finished = [j for j, seat in enumerate(s.seats) if seat is not None and done[j]]
        clock.start()
        for ended in s.release([(j, True) for j in finished]):
            outs[ended.seat.tag] = ended
        new = [queue.popleft() for _ in range(min(len(finished), len(queue)))]
        if new:
            longest = max(len(members[i].prompt) for i in new)
            prefix = s.admit([members[i] for i in new], new, _size(len(new), slots),
                             refill_bucket(longest, capacity))
            prefills.append(prefix.state.nfe)
            calls, refills = calls + 1, refills + len(new)
            refill_s += clock.seconds()
    compile_s, wall = engine.compile_s - compiled, whole.seconds()
    forward += _first_calls(prefills)
    return ([s.result(x, wall, compile_s) for x in outs],
            Stats(wall, loop_s, refill_s, trips, refills, steps, calls, forward))
