"""Packed-SS (Algorithm 1): verify D_{t-1} and draft Z_t from P_{t-1} in one call.

Input `[x, D̄ | x, MASK^(B-1)]` (2B rows, static mask). First-half row i gives
v^(i+1) for position c+i+1; second-half row j >= 1 gives z^(j) for position c+j.
After A = h + 1 accepted tokens, the proposals past them become the next draft
(Eq. 4): D_t = z^(A+1..W), MASK-padded to W = B - 1 slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import layouts
from .state import State, advance, drafter_tokens, matched_prefix, run_call, verifier_tokens


def step(m, params, s: State, *, B: int) -> State:
    W = B - 1
    call = layouts.packed(s.x, s.draft, s.cache_len, m.mask_id)
    rows = jnp.concatenate([jnp.arange(B), B + 1 + jnp.arange(W)])
    logits, kv = run_call(m, params, call, s.cache, s.cache_len, out_rows=rows)
    v = verifier_tokens(logits[:B])
    z = drafter_tokens(logits[B:], m.mask_id)
    h = matched_prefix(s.draft, s.draft_len, v)
    A = h + 1
    kept = jax.lax.dynamic_slice(jnp.concatenate([z, jnp.full(W, m.mask_id, jnp.int32)]), (A,), (W,))
    return advance(s, kv, jnp.arange(B), v, A, v[h], kept, jnp.maximum(W - A, 0), calls=1)
