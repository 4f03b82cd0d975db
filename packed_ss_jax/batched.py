"""Batched decoding with ragged acceptance: one loop over a batch of sequences.

A family's program is a `loop.Loop` of pure pieces (`init`, `step`, `outcome`, see
schedules.build / setdlm.program.build), written for one sequence. Here they run over a
batch: `start` and `outcome` vmapped, and one `lax.while_loop` whose body is the step
vmapped over the batch, going on while any sequence is unfinished. Every sequence keeps
its own cache length, accepted count, draft, PRNG key and stop state, so sequences
accept different numbers of tokens per iteration and stop at different times.

Why not `jax.vmap` of the whole single-sequence loop: vmap turns a loop whose predicate
differs per sequence into a loop over `any` whose body selects, for every leaf of the
state, the new value or the old one by the sequence's `done`. The KV cache is a leaf, so
that select writes a new copy of every cache buffer in every step, and the cache is no
longer updated in place.

Here a finished sequence's step is made a no-op without touching the cache: every leaf
except the cache is kept as it was (a select over the small bookkeeping arrays), and
the cache takes the step's write. That write goes to the finished sequence's slots
from its (kept) cache length on, which no call of that sequence reads (every call sees
only the committed slots `< cache_len`, SetDLM also only the slots it marks visible), so
it changes nothing the sequence will ever read; the write itself is the step's
in-place update (vmapped, a scatter into the loop's buffer), as in the single loop.
"""

from __future__ import annotations

from typing import Callable

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
    (their cache writes land in slots they never read). With `batch_step` (a sampled
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
    """`start(params, prompt, n, limits, key)` over a batch: prompts [N, P] (padded to one
    length), n [N], limits with a leading N axis, keys [N, ...]. With `batch_init` (a
    sampled program's `Loop.batch_init`), told unbatched whether any row is greedy, so a
    batch without greedy rows runs the sampled first call alone."""
    if batch_init is None:
        return jax.vmap(start, in_axes=(None, 0, 0, 0, 0))
    many = jax.vmap(batch_init, in_axes=(None, 0, 0, 0, 0, None))

    def run(params, prompts, n, limits, keys):
        return many(params, prompts, n, limits, keys, jnp.any(limits["temperature"] == 0))

    return run


def pin_cache(s, cache_sharding):
    """The batched state `s` with its cache constrained to `cache_sharding` (a Sharding of
    a [N, kv_heads, slots, head_dim] buffer; None: left to XLA)."""
    if cache_sharding is None:
        return s
    return s.replace(cache=jax.tree.map(
        lambda b: jax.lax.with_sharding_constraint(b, cache_sharding), s.cache))


def build(loop, cache_sharding=None) -> Callable:
    """The batched decode function of a family's decode loop (`loop.Loop`):

        run(params, prompts [N, P], n [N], limits (leading N axis), keys [N]) -> outcome

    every outcome leaf with a leading N axis; row i is what the single-sequence program
    returns for prompt i, its limits and its key. `cache_sharding` (a Sharding of a
    [N, kv_heads, slots, head_dim] buffer, see sharding.cache_spec) pins where the cache
    lives on a mesh, in the loop as at its start.
    """
    start, outcome = loop.init, loop.outcome
    first, body = start_batch(start, loop.batch_init), step_batch(loop.step, loop.batch_step)

    def pin(s):
        return pin_cache(s, cache_sharding)

    def run(params, prompts, n, limits, keys):
        s = pin(first(params, prompts, n, limits, keys))
        s = jax.lax.while_loop(lambda s: jnp.any(~s.done), lambda s: pin(body(params, s)), s)
        return jax.vmap(outcome)(s)

    return run
