"""Continuous batching: N slots kept busy over a long queue of prompts.

Static batches wait for their longest sequence: slots whose sequence has stopped idle
until the last one ends. Here the batched loop (batched.py) hands control back to the
host as soon as a sequence stops (or after `every` iterations at most); the host takes
the stopped sequences' outcomes and refills their slots with the next prompts of the
queue, all in one call: the new prompts' first calls run batched, into those slots of
the loop state (the state is donated, so the cache is written in place), and the loop
goes on. A slot with no prompt left stays stopped, so its steps change nothing.

Each sequence's state evolves exactly as when decoded alone (it starts from the same
first call with its own seed and is stepped by the same step), so every result equals
that prompt decoded alone. The queue shares one loop program (the cache sized for the
longest request); a refill pads its prompts only to the bucket of its own longest (see
`refill_bucket`), since the first call costs in proportion to its rows, and its size is
rounded up to a power of two (at most `slots`), so a queue compiles a handful of refill
programs.

The host round trip (reading the stop flags, dispatching the refill) leaves the device
idle. Handing control back at every stop makes that one round trip per group of
sequences stopping together, and no slot waits for its refill; `every` bounds how long
the host goes without hearing from the loop. `Stats` reports the share of wall time
spent outside the device programs.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import batched, options
from .engine import Engine, to_host
from .options import Batch
from .results import DecodeResult, check_finite, of_outcome


@dataclasses.dataclass
class Stats:
    wall_s: float          # the whole queue, first call to last result (compiling excluded)
    loop_s: float          # in the batched loop program, launch to its results on the host
    refill_s: float        # in the refill programs (the new prompts' first calls), the same
    round_trips: int       # times the loop handed control back to the host
    refills: int           # prompts started in a refill (not in the first batch)
    steps: int             # batched loop iterations (each one step of every running slot)
    refill_calls: int      # refill programs run (each starts one or more prompts)
    forward_calls: int     # batched forward calls: first calls (batch, refills) and steps'

    @property
    def host_fraction(self) -> float:
        """Share of wall time outside the device programs: the host round trips."""
        return max(0.0, 1.0 - (self.loop_s + self.refill_s) / self.wall_s)


def _programs(engine: Engine, batch: Batch, pin):
    loop = engine.loop(batch.program)
    start, outcome = loop.init, loop.outcome
    step_all = batched.step_batch(loop.step, loop.batch_step)
    first = batched.start_batch(start, loop.batch_init)

    def body(params, s):
        return pin(step_all(params, s))

    def begin(params, prompts, n, limits, seeds, live):
        s = first(params, prompts, n, limits, jax.vmap(jax.random.PRNGKey)(seeds))
        return pin(s.replace(done=s.done | ~live))  # slots without a prompt start stopped

    def resume(params, s, every):
        """At most `every` iterations; stops early once a sequence running at entry
        has stopped. Returns the state, the iterations run and the batched forward calls
        they made (every running slot makes the same calls: the most any slot made)."""
        running = ~s.done

        def go(c):
            return jnp.any(~c[0].done) & ~jnp.any(running & c[0].done) & (c[1] < every)

        after, ran = jax.lax.while_loop(go, lambda c: (body(params, c[0]), c[1] + 1), (s, 0))
        return after, ran, jnp.max(after.nfe - s.nfe)

    def refill(params, s, slots, prompts, n, limits, seeds):
        """The outcomes of `slots` (what they held), the state with the new prompts' first
        calls written into those slots, and the batched forward calls the first calls made
        (one, or two when a sampled draft follows). A slot index past the batch is
        padding: its outcome is garbage and its write is dropped."""
        taken = jax.vmap(outcome)(jax.tree.map(lambda b: b.at[slots].get(mode="clip"), s))
        new = first(params, prompts, n, limits, jax.vmap(jax.random.PRNGKey)(seeds))
        s = jax.tree.map(lambda b, x: b.at[slots].set(x.astype(b.dtype), mode="drop"), s, new)
        return pin(s), taken, jnp.max(new.nfe)

    return begin, resume, refill, jax.vmap(outcome)


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


class _Queue:
    """The host side of one queue: its compiled programs, the requests' arguments, which
    request each slot holds, the outcomes taken so far and the timing counts."""

    def __init__(self, engine: Engine, batch: Batch, slots: int, every: int):
        self.engine, self.batch, self.slots = engine, batch, slots
        # On a mesh (a model loaded with `mesh=`) the slots are split over "data" and every
        # call is tensor-parallel over "model", as in a batched decode (Engine.decode_batch).
        self.begin, self.resume, self.refill, self.outcome = _programs(
            engine, batch, engine.pinned(slots))
        self.params = engine.model.params
        self.compile_s = 0.0
        # Every request's arguments, once, on the host: a refill's are rows of them
        # (building them per refill would cost the host about as much as its first call).
        self.table = batch.host_args()
        self.every = engine.place(np.int32(every))
        n = len(batch.members)
        self.queue = collections.deque(range(slots, n))
        self.holder = [i if i < n else None for i in range(slots)]
        self.outs: list = [None] * n
        self.loop_s = self.refill_s = 0.0
        self.trips = self.refills = self.steps = self.calls = self.forward = 0

    def program(self, name, fn, *args, donate=()):
        exe, seconds = self.engine.compile(("queue", self.batch.program, self.slots) + name,
                                           fn, *args, donate=donate)
        self.compile_s += seconds
        return exe

    def refill_args(self, indices):
        """The requests `indices` as refill arguments: padded to a power of two entries
        (padding repeats the first), prompts to the bucket of the longest."""
        rows = np.asarray(indices + indices[:1] * (_size(len(indices), self.slots)
                                                   - len(indices)))
        prompts, n, limits, seeds = self.table
        bucket = refill_bucket(int(n[rows].max()), self.batch.program.capacity)
        return (prompts[rows, :bucket], n[rows], jax.tree.map(lambda a: a[rows], limits),
                seeds[rows])

    def start(self):
        """The first `slots` requests' first calls (slots past the queue start stopped),
        with the loop and outcome programs compiled for that state."""
        reqs, slots, e = self.batch.members, self.slots, self.engine
        head = [reqs[min(i, len(reqs) - 1)] for i in range(slots)]
        head_args = e.place(Batch(self.batch.program, tuple(head)).host_args(), slots)
        live = e.place(np.arange(slots) < len(reqs), slots)
        exe_begin = self.program(("begin",), self.begin, self.params, *head_args, live)
        self.shape = jax.tree.map(
            lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding),
            exe_begin.out_info)
        self.exe_resume = self.program(("resume",), self.resume, self.params, self.shape,
                                       self.every, donate=(1,))
        self.exe_outcome = self.program(("outcome",), self.outcome, self.shape)
        self.compile_before = self.compile_s
        self.t0 = time.perf_counter()
        s = exe_begin(self.params, *head_args, live)
        self.forward = int(np.max(to_host(s.nfe)))  # the first batch's first calls
        return s

    def trip(self, s):
        """Runs the loop until a running slot stops (at most `every` iterations); the state
        and the slots whose request has finished."""
        t = time.perf_counter()
        s, ran, made = self.exe_resume(self.params, s, self.every)
        done, ran, made = to_host((s.done, ran, made))
        self.loop_s += time.perf_counter() - t
        self.trips += 1
        self.steps += int(ran)
        self.forward += int(made)
        return s, [j for j, h in enumerate(self.holder) if h is not None and done[j]]

    def refill_slots(self, s, finished: list[int], new: list[int]):
        """One call takes the outcomes of the slots it refills and starts the requests
        `new` there; entries past len(new) name no slot (read clipped, unused; write
        dropped)."""
        args = self.refill_args(new)
        where = np.full(len(args[1]), self.slots, np.int32)
        where[: len(new)] = finished[: len(new)]
        where, args = self.engine.place((where, args), len(where))
        exe = self.program(("refill",) + args[0].shape, self.refill, self.params, self.shape,
                           where, *args, donate=(1,))
        t = time.perf_counter()
        s, taken, made = exe(self.params, s, where, *args)
        taken, made = to_host((taken, made))
        self.refill_s += time.perf_counter() - t
        self.calls += 1
        self.forward += int(made)
        self.refills += len(new)
        for j, i in enumerate(new):
            self.take(finished[j], taken, j)
            self.holder[finished[j]] = i
        return s

    def take(self, slot: int, taken: dict, row: int) -> None:
        self.outs[self.holder[slot]] = {name: x[row] for name, x in taken.items()}

    def retire(self, s, rest: list[int]) -> None:
        """The queue ran out: these slots' outcomes are taken and they stay stopped."""
        taken = to_host(self.exe_outcome(s))
        for j in rest:
            self.take(j, taken, j)
            self.holder[j] = None

    def results(self) -> tuple[list[DecodeResult], Stats]:
        # Refill programs compiled on first use are not part of the decode's time.
        wall = time.perf_counter() - self.t0 - (self.compile_s - self.compile_before)
        results = []
        for r, out in zip(self.batch.members, self.outs):
            check_finite(out["nonfinite_at"], out["iterations"], out["tokens"])
            results.append(of_outcome(self.engine.model, self.engine.family, r, out, wall,
                                      self.compile_s))
        return results, Stats(wall, self.loop_s, self.refill_s, self.trips, self.refills,
                              self.steps, self.calls, self.forward)


def decode_queue(engine: Engine, batch: Batch, slots: int,
                 every: int = 64) -> tuple[list[DecodeResult], Stats]:
    """Decodes every request of `batch` (any number) with `slots` sequences at a time,
    refilling stopped slots as they stop (handing control to the host at least every
    `every` iterations; both checked by the caller, `api.decode_continuous`); returns one
    DecodeResult per request, in order (each equal to that request decoded alone;
    `wall_s` is the whole queue's, compilation excluded), and the timing `Stats`."""
    q = _Queue(engine, batch, slots, every)
    s = q.start()
    while any(h is not None for h in q.holder):
        s, finished = q.trip(s)
        new = [q.queue.popleft() for _ in range(min(len(finished), len(q.queue)))]
        if new:
            s = q.refill_slots(s, finished, new)
        if rest := finished[len(new):]:
            q.retire(s, rest)
    return q.results()
