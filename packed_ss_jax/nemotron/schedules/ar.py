"""AR: one verifier row per call; the reference every schedule must reproduce."""

from __future__ import annotations

import jax.numpy as jnp

from .. import layouts
from ...calls import run_call
from ...sampling import Sampler, next_keys
from ..state import State, advance, choose_first


def step(m, params, s: State, *, B: int, sampler: Sampler) -> State:
    s, (k,) = next_keys(s, 1, sampler)
    logits, kv = run_call(m, params, layouts.single(s.x, s.cache_len), s.cache, s.cache_len)
    v = choose_first(logits[0], sampler, k)[None]
    return advance(s, kv, jnp.arange(1), v, jnp.int32(1), v[0], s.draft, s.draft_len, calls=1,
                   verifier=logits)
