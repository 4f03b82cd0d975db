"""Linear-SS: a drafting call, then a verifying call, per iteration (2 NFE).

The draft is made from the newest verified prefix, `[x, MASK^(B-1)]` in diffusion
mode (reads the cache, writes nothing); `[x, d_1..d_{B-1}]` is then verified causally.
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import layouts
from .state import State, advance, drafter_tokens, matched_prefix, run_call, verifier_tokens


def step(m, params, s: State, *, B: int) -> State:
    W = B - 1
    call = layouts.draft_block(s.x, s.cache_len, B, m.mask_id)
    logits, _ = run_call(m, params, call, s.cache, s.cache_len, out_rows=jnp.arange(1, B))
    draft = drafter_tokens(logits, m.mask_id)  # unshifted: row j drafts position c+j

    logits, kv = run_call(m, params, layouts.verify(s.x, draft, s.cache_len), s.cache, s.cache_len)
    v = verifier_tokens(logits)  # v[i] predicts position c+i+1
    h = matched_prefix(draft, W, v)
    return advance(s, kv, jnp.arange(B), v, h + 1, v[h], s.draft, jnp.int32(0), calls=2)
