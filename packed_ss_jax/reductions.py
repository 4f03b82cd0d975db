"""Index reductions written as plain max/min reductions.

`jnp.argmax` and a cumulative product lower to a two-operand reduce and a
reduce-window, which XLA's CPU backend runs element by element; one max plus one
min over an iota vectorise. This is decoder work outside the model, paid every step
(docs/performance.md has the timings).
"""

from __future__ import annotations

import jax.numpy as jnp


def first_argmax(x):
    """argmax over the last axis, the lowest index on ties (as `jnp.argmax`), int32.

    NaN counts as -inf, so the result is always an index in [0, n) (a row of NaN gives
    0); without that, no entry equals a NaN maximum and the min would return n. The
    decode loop reports non-finite logits separately (nemotron/state.py)."""
    n = x.shape[-1]
    x = jnp.where(jnp.isnan(x), -jnp.inf, x)
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == top, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def leading_true(ok):
    """How many entries of the 1-D bool `ok` are True before the first False."""
    n = ok.shape[0]
    return jnp.min(jnp.where(ok, n, jnp.arange(n, dtype=jnp.int32))).astype(jnp.int32)


def nonfinite_rows(x):
    """[R] bool: the rows of `x` [R, n] holding NaN or Inf. One max per row over values
    the decoder has already computed (NaN propagates through the max)."""
    return ~jnp.isfinite(jnp.max(jnp.abs(x), axis=-1))
