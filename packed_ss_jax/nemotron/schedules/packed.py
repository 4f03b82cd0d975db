"""Packed-SS (Algorithms 1 and 2): verify D_{t-1} and draft Z_t from P_{t-1} in one call.

Input `[x, D̄ | x, MASK^(B-1)]` (2B rows, static mask). First-half row i gives
v^(i+1) for position c+i+1; second-half row j >= 1 gives z^(j) for position c+j.
After A = h + 1 accepted tokens, the proposals past them become the next draft
(Eq. 4): D_t = z^(A+1..W), MASK-padded to W = B - 1 positions. When sampling, each kept
proposal keeps the Q it was drawn from, computed from P_{t-1}: the next call divides
by that stored Q, not by a fresh one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import layouts
from ...calls import run_call
from ...sampling import Sampler, next_keys
from ..state import State, advance, propose, verify_draft


def step(m, params, s: State, *, B: int, sampler: Sampler) -> State:
    W = B - 1
    s, (k_verify, k_draft) = next_keys(s, 2, sampler)
    call = layouts.packed(s.x, s.draft, s.cache_len, m.mask_id)
    rows = jnp.concatenate([jnp.arange(B), B + 1 + jnp.arange(W)])
    logits, kv = run_call(m, params, call, s.cache, s.cache_len, out_rows=rows)
    h, accepted = verify_draft(logits[:B], s.draft, s.draft_len, s.draft_q, sampler, k_verify)
    z, qz = propose(logits[B:], sampler, m.mask_id, k_draft)
    A = h + 1
    kept = jax.lax.dynamic_slice(jnp.concatenate([z, jnp.full(W, m.mask_id, jnp.int32)]), (A,), (W,))
    kept_q = None if qz is None else qz.shift(A, W)
    return advance(s, kv, jnp.arange(B), accepted, A, accepted[h], kept, jnp.maximum(W - A, 0),
                   calls=1, draft_q=kept_q, verifier=logits[:B], drafter=logits[B:])
