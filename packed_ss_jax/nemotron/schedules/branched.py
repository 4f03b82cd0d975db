"""Branched-SS, between Packed-SS and Quadratic-SS (the intermediate designs Section 6
leaves to future work).

One call holds Packed-SS's `[x, D̄ | x, MASK^(B-1)]` plus, for each of the k - 1 most
accepted outcomes h (`layouts.branch_outcomes`, counted from the draft's length), the
group `MASK^B` at positions c+h+1 .. c+h+B that sees x, d_1..d_h (Quadratic-SS's branch
h): 2B + (k-1)B rows. When the verification accepts one of those h, its branch supplies
the next draft; otherwise Packed-SS's zero-accepted proposals do. k = 1 is Packed-SS.
Sampling stays exact, since which rows are selected depends on this call's verification
alone. The design and its measurements: docs/branched.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import layouts
from ...calls import run_call
from ...sampling import Sampler, next_keys
from ..state import State, advance, propose, verify_draft
from . import packed


def step(m, params, s: State, *, B: int, sampler: Sampler, branches: int) -> State:
    if branches == 1:  # Packed-SS itself
        return packed.step(m, params, s, B=B, sampler=sampler)
    W, k = B - 1, branches - 1
    s, (k_verify, k_draft) = next_keys(s, 2, sampler)
    outcomes = layouts.branch_outcomes(s.draft_len, branches)
    call = layouts.branched(s.x, s.draft, s.draft_len, s.cache_len, m.mask_id, branches)
    rows = jnp.concatenate([jnp.arange(B), B + 1 + jnp.arange(W)]
                           + [2 * B + j * B + 1 + jnp.arange(W) for j in range(k)])
    logits, kv = run_call(m, params, call, s.cache, s.cache_len, out_rows=rows)
    h, accepted = verify_draft(logits[:B], s.draft, s.draft_len, s.draft_q, sampler, k_verify)
    A = h + 1
    zero = logits[B:B + W]   # z^(1..W), from P_{t-1}
    past = jax.lax.dynamic_slice_in_dim(jnp.concatenate([zero, jnp.repeat(zero[-1:], W, 0)]),
                                        A, W)   # z^(A+1..), padded past z^W
    branch = logits[B + W:].reshape(k, W, -1)
    hit = h == outcomes
    matched = jnp.any(hit)
    d_logits = jnp.where(matched, branch[jnp.argmax(hit)], past)
    draft, q = propose(d_logits, sampler, m.mask_id, k_draft)
    draft_len = jnp.where(matched, W, jnp.maximum(W - A, 0)).astype(jnp.int32)
    draft = jnp.where(jnp.arange(W) < draft_len, draft, m.mask_id)
    return advance(s, kv, jnp.arange(B), accepted, A, accepted[h], draft, draft_len, calls=1,
                   draft_q=q, verifier=logits[:B], drafter=d_logits)
