"""A decode state of N slots (one sequence each) and the pure functions over it.

A family's `loop.Loop` is written for one sequence; here its first call and step run
vmapped over the slots, each slot with its own cache length, draft, key and stop state,
so slots accept different numbers of tokens per iteration and stop at different times.
`slot_functions` is the contract every path but a one-request decode runs (JetStream's
prefill, insert and generate; the engine compiles it, scheduler.py drives it).

Why not `jax.vmap` of the whole single-sequence loop: vmap turns a per-sequence
predicate into a select over every leaf by `done`, and the KV cache is a leaf, so every
step would copy every cache buffer. Here a stopped slot keeps every leaf but the cache,
and its cache takes the step's write at KV positions from its kept cache length on,
which none of its calls ever reads; the write stays the step's in-place update.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from . import sampling


def _keep_finished(done, old, new):
    """`new`, except that sequences finished before the step keep `old` (every leaf but
    the cache; see the module doc)."""
    def pick(o, n):
        return jnp.where(done.reshape(done.shape + (1,) * (o.ndim - 1)), o, n)

    rest = jax.tree.map(pick, old.replace(cache=None), new.replace(cache=None))
    return rest.replace(cache=new.cache)


def step_batch(step: Callable, batch_step: Callable | None = None) -> Callable:
    """`step(params, s) -> s` over a batch of states, finished sequences unchanged
    (their cache writes land at KV positions they never read). With `batch_step` (a sampled
    program's `Loop.batch_step`), each step is given the plan its live rows' sampling
    values allow (sampling.batch_plan), unbatched: vmapped, a per-row choice would
    compute both sides for every row, a branch on the plan computes one."""
    if batch_step is None:
        many = jax.vmap(step, in_axes=(None, 0))
    else:
        planned = jax.vmap(batch_step, in_axes=(None, 0, None))

        def many(params, s):
            return planned(params, s, sampling.batch_plan(s.sampler, ~s.done))

    def run(params, s):
        return _keep_finished(s.done, s, many(params, s))

    return run


def start_batch(start: Callable, batch_init: Callable | None = None) -> Callable:
    """`start(params, prompt, prompt_len, limits, key)` over a batch: prompts [N, P]
    (padded to one length), prompt_len [N], limits with a leading N axis, keys [N, ...].
    With `batch_init` (a sampled program's `Loop.batch_init`), told unbatched whether any
    row is greedy, so a batch without greedy rows runs the sampled first call alone."""
    if batch_init is None:
        return jax.vmap(start, in_axes=(None, 0, 0, 0, 0))
    many = jax.vmap(batch_init, in_axes=(None, 0, 0, 0, 0, None))

    def run(params, prompts, prompt_len, limits, keys):
        return many(params, prompts, prompt_len, limits, keys,
                    jnp.any(limits["temperature"] == 0))

    return run


def pin_cache(s, cache_sharding):
    """The batched state `s` with its cache constrained to `cache_sharding` (a Sharding of
    a [N, kv_heads, positions, head_dim] buffer; None: left to XLA)."""
    if cache_sharding is None:
        return s
    return s.replace(cache=jax.tree.map(
        lambda b: jax.lax.with_sharding_constraint(b, cache_sharding), s.cache))


class Progress(NamedTuple):
    """Each slot's output so far (leading axis the slots): `final` leading entries of
    `tokens` no later iteration changes; `done`: stopped; `stopped`: by a stop marker
    (EOS among them), else by its length."""

    tokens: Any
    final: Any
    done: Any
    stopped: Any


class SlotFunctions(NamedTuple):
    """The pure functions over a decode state of N slots (`slot_functions`)."""

    empty: Callable      # () -> state, every slot stopped
    prefill: Callable    # (params, prompts [M, P], prompt_len [M], limits [M], seeds [M]) -> [M]
    insert: Callable     # (state, prefix [M], where [M]) -> state; where >= N: dropped
    generate: Callable   # (params, state, k, eager) -> (state, progress, ran, made)
    outcome: Callable    # state -> outcome dict, leading axis N
    halt: Callable       # (state, slot) -> state with that slot stopped


def slot_functions(loop, one: Callable, slots: int, pin: Callable) -> SlotFunctions:
    """The slot contract over `slots` sequences of a family's decode loop (`loop.Loop`);
    `one()` is the shape of one sequence's state (`jax.eval_shape` of `loop.init`: traced
    only when `empty` is), `pin` constrains a batched state of `slots` sequences to where
    it lives on a mesh (the identity on one device); a prefill of `slots` rows is placed
    so too, ready to be the state.

    `generate` runs at most k iterations of every slot and stops early once every slot has
    stopped or, with `eager`, once a slot running at entry has stopped (a queue refills it
    then). It returns the state, the progress (tokens, final counts, done, stopped), the
    iterations it ran and the batched forward calls they made (the most any slot made).
    A stopped slot is left as it is by every step, so a state may hold empty slots."""
    first = start_batch(loop.init, loop.batch_init)
    step_all = step_batch(loop.step, loop.batch_step)

    def empty():
        s = jax.tree.map(lambda x: jnp.zeros((slots,) + x.shape, x.dtype), one())
        return pin(s.replace(done=jnp.ones(slots, bool)))

    def prefill(params, prompts, prompt_len, limits, seeds):
        keys = jax.vmap(jax.random.PRNGKey)(seeds)
        if prompts.shape[0] == 1:
            # One request (a stream's, a server's): its own first call, unbatched. The
            # batch's any-greedy branch would trace and compile both sides for nothing.
            s = loop.init(params, prompts[0], prompt_len[0],
                          jax.tree.map(lambda x: x[0], limits), keys[0])
            return pin(jax.tree.map(lambda x: x[None], s))
        return pin(first(params, prompts, prompt_len, limits, keys))

    def insert(s, prefix, where):
        put = jax.tree.map(lambda b, x: b.at[where].set(x.astype(b.dtype), mode="drop"),
                           s, prefix)
        return pin(put)

    def generate(params, s, k, eager):
        running = ~s.done

        def go(c):
            stopped = eager & jnp.any(running & c[0].done)
            return jnp.any(~c[0].done) & ~stopped & (c[1] < k)

        after, ran = jax.lax.while_loop(
            go, lambda c: (pin(step_all(params, c[0])), c[1] + 1), (s, jnp.int32(0)))
        tokens, final, done = jax.vmap(loop.progress)(after)
        progress = Progress(tokens, final, done, after.stopped)
        return after, progress, ran, jnp.max(after.nfe - s.nfe)

    def halt(s, slot):
        return pin(s.replace(done=s.done.at[slot].set(True)))

    return SlotFunctions(empty, prefill, insert, generate, jax.vmap(loop.outcome), halt)
