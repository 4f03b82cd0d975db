"""Quadratic-SS: verify and pre-draft a branch for every acceptance outcome (1 NFE).

Group i = `[d_i, MASK^B]` (d_0 = x), B(B+1) rows. The d rows verify; group h, the
branch for h accepted drafts, drafts the B positions after d_h: its first proposal
(the correction/bonus position) is dropped and the other B-1 become the next draft.
When sampling, the next draft is drawn from the selected branch only (App. E.4).
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import layouts
from ...calls import run_call
from ...sampling import Sampler, next_keys
from ..state import State, advance, propose, verify_draft


def step(m, params, s: State, *, B: int, sampler: Sampler) -> State:
    G = B + 1
    s, (k_verify, k_draft) = next_keys(s, 2, sampler)
    call = layouts.quadratic(s.x, s.draft, s.cache_len, m.mask_id)
    logits, kv = run_call(m, params, call, s.cache, s.cache_len)
    logits = logits.reshape(B, G, -1)
    h, accepted = verify_draft(logits[:, 0], s.draft, s.draft_len, s.draft_q, sampler, k_verify)
    d_logits = logits[h, 2:]
    branch, q = propose(d_logits, sampler, m.mask_id, k_draft)
    return advance(s, kv, jnp.arange(B) * G, accepted, h + 1, accepted[h], branch,
                   jnp.int32(B - 1), calls=1, draft_q=q, verifier=logits[:, 0], drafter=d_logits)
