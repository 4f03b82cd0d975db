"""Quadratic-SS: verify and pre-draft a branch for every acceptance outcome (1 NFE).

Group i = `[d_i, MASK^B]` (d_0 = x), B(B+1) rows. The d rows verify; group h, the
branch for h accepted drafts, drafts the B positions after d_h: its first proposal
(the correction/bonus position) is dropped and the other B-1 become the next draft.
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import layouts
from .state import State, advance, drafter_tokens, matched_prefix, run_call, verifier_tokens


def step(m, params, s: State, *, B: int) -> State:
    G = B + 1
    call = layouts.quadratic(s.x, s.draft, s.cache_len, m.mask_id)
    logits, kv = run_call(m, params, call, s.cache, s.cache_len)
    logits = logits.reshape(B, G, -1)
    v = verifier_tokens(logits[:, 0])
    h = matched_prefix(s.draft, s.draft_len, v)
    branch = drafter_tokens(logits[h, 2:], m.mask_id)
    return advance(s, kv, jnp.arange(B) * G, v, h + 1, v[h], branch, jnp.int32(B - 1), calls=1)
