"""AR: one verifier row per call; the reference every schedule must reproduce."""

from __future__ import annotations

import jax.numpy as jnp

from .. import layouts
from .state import State, advance, run_call, verifier_tokens


def step(m, params, s: State, *, B: int) -> State:
    logits, kv = run_call(m, params, layouts.single(s.x, s.cache_len), s.cache, s.cache_len)
    v = verifier_tokens(logits)
    return advance(s, kv, jnp.arange(1), v, jnp.int32(1), v[0], s.draft, s.draft_len, calls=1)
