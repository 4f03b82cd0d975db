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

from . import batched, engine, requests, sharding


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


def _pinner(model, slots: int):
    """`pin(state)`: on a mesh, the batched state with every leaf constrained to where it
    lives (the cache as sharding.cache_spec, the rest split over "data" by slot), so the
    programs that pass it on to each other agree on it; on one device, the identity."""
    mesh = sharding.mesh_of(model.params)
    if mesh is None:
        return lambda s: s
    NamedSharding = jax.sharding.NamedSharding
    rows = NamedSharding(mesh, sharding.batch_spec(mesh, slots))
    cache = NamedSharding(mesh, sharding.cache_spec(model.config, mesh, slots))

    def pin(s):
        rest = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, rows),
                            s.replace(cache=None))
        return batched.pin_cache(rest.replace(cache=s.cache), cache)

    return pin


def _programs(model, family, batch: engine.Batch, pin):
    loop = family.build(model, batch.program)
    start, step, outcome = loop.init, loop.step, loop.outcome
    step_all = batched.step_batch(step)
    first = batched.start_batch(start)

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
    b = engine.MIN_BUCKET
    while b < n:
        b = b * 3 // 2 if (b & (b - 1)) == 0 else b // 3 * 4  # 2^k -> 1.5 * 2^k -> 2^(k+1)
    return min(b, capacity)


def decode_queue(model, family, batch: engine.Batch, slots: int,
                 every: int = 64) -> tuple[list[engine.DecodeResult], Stats]:
    """Decodes every request of `batch` (any number) with `slots` sequences at a time,
    refilling stopped slots as they stop (handing control to the host at least every
    `every` iterations); returns one DecodeResult per request, in order (each equal to
    that request decoded alone; `wall_s` is the whole queue's, compilation excluded), and
    the timing `Stats`."""
    # Both become int32 on device (slot indices, the iteration bound).
    slots = requests.integer(slots, "slots", 1, requests.INT32_MAX, "slot indices are int32")
    every = requests.integer(every, "every", 1, requests.INT32_MAX,
                             "the loop counts iterations in int32")
    reqs = batch.requests
    # On a mesh (a model loaded with `mesh=`) the slots are split over "data" and every
    # call is tensor-parallel over "model", as in a batched decode (engine.run_batch).
    begin, resume, refill, outcome = _programs(model, family, batch, _pinner(model, slots))
    key = (model.key, batch.program, "queue", slots) + engine.placement(model)
    params = model.params
    compile_s = 0.0

    def program(name, fn, *args, donate=()):
        nonlocal compile_s
        exe, seconds = engine.aot(key + name, fn, *args, donate=donate)
        compile_s += seconds
        return exe

    # Every request's arguments, once, on the host: a refill's are rows of them (building
    # them per refill would cost the host about as much as the refill's first call).
    table = batch.host_args()

    def refill_args(indices):
        """The requests `indices` as refill arguments: padded to a power of two entries
        (padding repeats the first), prompts to the bucket of the longest."""
        rows = np.asarray(indices + indices[:1] * (_size(len(indices), slots) - len(indices)))
        bucket = refill_bucket(int(table[1][rows].max()), batch.program.capacity)
        prompts, n, limits, seeds = table
        return (prompts[rows, :bucket], n[rows], jax.tree.map(lambda a: a[rows], limits),
                seeds[rows])

    head = [reqs[min(i, len(reqs) - 1)] for i in range(slots)]
    head_args = engine.on_mesh(model, engine.Batch(batch.program, tuple(head)).host_args(),
                               slots)
    live = engine.on_mesh(model, np.arange(slots) < len(reqs), slots)
    exe_begin = program(("begin",), begin, params, *head_args, live)
    shape = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding),
                         exe_begin.out_info)
    every_ = engine.on_mesh(model, np.int32(every))
    exe_resume = program(("resume",), resume, params, shape, every_, donate=(1,))
    exe_outcome = program(("outcome",), outcome, shape)
    compile_before = compile_s

    t0 = time.perf_counter()
    s = exe_begin(params, *head_args, live)
    loop_s = refill_s = 0.0
    trips = refills = steps = calls = 0
    forward = int(np.max(engine.to_host(s.nfe)))  # the first batch's first calls
    queue = collections.deque(range(slots, len(reqs)))
    holder = [i if i < len(reqs) else None for i in range(slots)]
    outs: list = [None] * len(reqs)
    while any(h is not None for h in holder):
        t = time.perf_counter()
        s, ran, made = exe_resume(params, s, every_)
        done, ran, made = engine.to_host((s.done, ran, made))
        loop_s += time.perf_counter() - t
        trips += 1
        steps += int(ran)
        forward += int(made)
        finished = [j for j, h in enumerate(holder) if h is not None and done[j]]
        if not finished:
            continue
        new = [queue.popleft() for _ in range(min(len(finished), len(queue)))]
        if new:
            # One call takes the outcomes of the slots it refills and starts the new
            # prompts there; entries past len(new) name no slot (read clipped, unused;
            # write dropped).
            args = refill_args(new)
            where = np.full(len(args[1]), slots, np.int32)
            where[: len(new)] = finished[: len(new)]
            where, args = engine.on_mesh(model, (where, args), len(where))
            exe = program(("refill",) + args[0].shape, refill, params, shape, where, *args,
                          donate=(1,))
            t = time.perf_counter()
            s, taken, made = exe(params, s, where, *args)
            taken, made = engine.to_host((taken, made))
            refill_s += time.perf_counter() - t
            calls += 1
            forward += int(made)
            refills += len(new)
            for j, i in enumerate(new):
                outs[holder[finished[j]]] = {name: x[j] for name, x in taken.items()}
                holder[finished[j]] = i
        if rest := finished[len(new):]:  # the queue ran out: these slots stay stopped
            taken = engine.to_host(exe_outcome(s))
            for j in rest:
                outs[holder[j]] = {name: x[j] for name, x in taken.items()}
                holder[j] = None
    # Refill programs compiled on first use are not part of the decode's time.
    wall = time.perf_counter() - t0 - (compile_s - compile_before)
    results = []
    for r, out in zip(reqs, outs):
        engine.check_finite(out["nonfinite_at"], out["iterations"], out["tokens"])
        results.append(engine.result(model, family, r, out, wall, compile_s))
    return results, Stats(wall, loop_s, refill_s, trips, refills, steps, calls, forward)
