"""Continuous batching: N slots kept busy over a long queue of prompts.

Static batches wait for their longest sequence: slots whose sequence has stopped idle
until the last one ends. Here the batched loop (batched.py) hands control back to the
host every `every` iterations (or as soon as every slot has stopped); the host reads
which slots stopped, takes their results, and refills each with the next prompt of the
queue: the prompt's first call runs into that slot of the batched state (the state is
donated, so the cache is written in place), and the loop goes on. A slot with
no prompt left stays stopped, so its steps change nothing.

Each sequence's state evolves exactly as when decoded alone (it starts from the same
first call with its own seed and is stepped by the same step), so every result equals
that prompt decoded alone. The queue shares one program: prompts are padded to the
bucket of the longest, the cache sized for the longest request.

The host round trip (reading the stop flags and finished outcomes, dispatching the
refills) leaves the device idle; `every` trades it against the iterations a stopped slot
waits for its refill. `Stats` reports the share of wall time spent outside the device
programs.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import batched, engine


@dataclasses.dataclass
class Stats:
    wall_s: float          # the whole queue, first call to last result
    loop_s: float          # in the batched loop program (synchronised)
    refill_s: float        # in the refill programs (the new prompts' first calls)
    round_trips: int       # times the loop handed control back to the host
    refills: int

    @property
    def host_fraction(self) -> float:
        """Share of wall time outside the device programs: the host round trips."""
        return max(0.0, 1.0 - (self.loop_s + self.refill_s) / self.wall_s)


def _programs(model, family, batch: engine.Batch, slots: int):
    loop = family.build(model, batch.program)
    start, step, outcome = loop.init, loop.step, loop.outcome
    body = batched.step_batch(step)
    first = batched.start_batch(start)

    def begin(params, prompts, n, limits, seeds, live):
        s = first(params, prompts, n, limits, jax.vmap(jax.random.PRNGKey)(seeds))
        return s.replace(done=s.done | ~live)  # slots without a prompt start stopped

    def resume(params, s, every):
        def go(c):
            return jnp.any(~c[0].done) & (c[1] < every)

        s, _ = jax.lax.while_loop(go, lambda c: (body(params, c[0]), c[1] + 1), (s, 0))
        return s

    def refill(params, s, slot, prompt, n, limits, seed):
        # The new prompt's first call, written into its slot of the (donated) state.
        new = start(params, prompt, n, limits, jax.random.PRNGKey(seed))
        return jax.tree.map(
            lambda b, x: jax.lax.dynamic_update_index_in_dim(b, x.astype(b.dtype), slot, 0),
            s, new)

    return begin, resume, refill, jax.vmap(outcome)


def decode_queue(model, family, batch: engine.Batch, slots: int,
                 every: int = 8) -> tuple[list[engine.DecodeResult], Stats]:
    """Decodes every request of `batch` (any number) with `slots` sequences at a time,
    refilling stopped slots every `every` iterations; returns one DecodeResult per
    request, in order (each equal to that request decoded alone; `wall_s` is the whole
    queue's), and the timing `Stats`."""
    if slots < 1 or every < 1:
        raise engine.InputError(f"slots and every must be >= 1, got {slots}, {every}")
    reqs = batch.requests
    begin, resume, refill, outcome = _programs(model, family, batch, slots)
    key = (model.key, batch.program, "queue", slots)
    first = [reqs[min(i, len(reqs) - 1)] for i in range(slots)]
    head = engine.Batch(batch.program, tuple(first))
    live = jnp.asarray(np.arange(slots) < len(reqs))
    params = model.params
    t_compile = time.perf_counter()
    exe_begin, _ = engine.aot(key + ("begin",), begin, params, *head.args(), live)
    s = exe_begin(params, *head.args(), live)
    exe_resume, _ = engine.aot(key + ("resume",), resume, params, s, jnp.int32(every),
                               donate=(1,))
    exe_refill, _ = engine.aot(key + ("refill",), refill, params, s, jnp.int32(0),
                               *reqs[0].args(), donate=(1,))
    exe_out, _ = engine.aot(key + ("outcome",), outcome, s)
    compile_s = time.perf_counter() - t_compile

    t0 = time.perf_counter()
    s = jax.block_until_ready(exe_begin(params, *head.args(), live))
    loop_s = refill_s = 0.0
    trips = refills = 0
    queue = collections.deque(range(slots, len(reqs)))
    holder = [i if i < len(reqs) else None for i in range(slots)]
    outs: list = [None] * len(reqs)
    k = jnp.int32(every)
    while any(h is not None for h in holder):
        t = time.perf_counter()
        s = jax.block_until_ready(exe_resume(params, s, k))
        loop_s += time.perf_counter() - t
        trips += 1
        done = np.asarray(s.done)
        finished = [j for j, h in enumerate(holder) if h is not None and done[j]]
        if not finished:
            continue
        rows = jax.device_get(exe_out(s))
        for j in finished:
            outs[holder[j]] = jax.tree.map(lambda x: x[j], rows)
            holder[j] = None
            if queue:
                i = queue.popleft()
                t = time.perf_counter()
                s = jax.block_until_ready(exe_refill(params, s, jnp.int32(j), *reqs[i].args()))
                refill_s += time.perf_counter() - t
                holder[j] = i
                refills += 1
    wall = time.perf_counter() - t0
    results = []
    for r, out in zip(reqs, outs):
        engine.check_finite(out["nonfinite_at"], out["iterations"], out["tokens"])
        results.append(engine.result(model, family, r, out, wall, compile_s))
    return results, Stats(wall, loop_s, refill_s, trips, refills)
