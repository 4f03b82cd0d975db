"""Linear-SS: a drafting call, then a verifying call, per iteration (2 NFE).

The draft is made from the newest verified prefix, `[x, MASK^(B-1)]` in diffusion
mode (reads the cache, writes nothing); `[x, d_1..d_{B-1}]` is then verified causally.
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import layouts
from ...calls import run_call
from ...sampling import Sampler, next_keys
from ..state import State, advance, propose, verify_draft


def step(m, params, s: State, *, B: int, sampler: Sampler) -> State:
    W = B - 1
    s, (k_draft, k_verify) = next_keys(s, 2, sampler)
    call = layouts.draft_block(s.x, s.cache_len, B, m.mask_id)
    d_logits, _ = run_call(m, params, call, s.cache, s.cache_len, out_rows=jnp.arange(1, B))
    draft, q = propose(d_logits, sampler, m.mask_id, k_draft)  # unshifted: row j drafts c+j

    logits, kv = run_call(m, params, layouts.verify(s.x, draft, s.cache_len), s.cache, s.cache_len)
    h, accepted = verify_draft(logits, draft, W, q, sampler, k_verify)
    return advance(s, kv, jnp.arange(B), accepted, h + 1, accepted[h], s.draft, jnp.int32(0),
                   calls=2, verifier=logits, drafter=d_logits)
