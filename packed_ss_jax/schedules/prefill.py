"""The two ways a schedule starts (one NFE each, App. E.2).

`prefill` (AR, Linear-SS): a causal pass over the prompt gives the first token.
`first_call` (Packed-SS, Quadratic-SS): the same pass plus B MASK rows after the
prompt, so the first call also yields a full draft of B-1 tokens for positions
n+1..n+B-1 (the proposal for position n is dropped: the verifier fills it).
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import cache as cache_lib
from .. import layouts
from .state import (ForwardModel, State, drafter_tokens, no_draft, run_call, start,
                    verifier_tokens)


def _cache_prompt(m: ForwardModel, kv_rows, P: int, capacity: int, B: int):
    # Headroom of one block past `capacity` keeps every later commit in range.
    return cache_lib.commit(m.empty_cache(capacity + B), kv_rows, jnp.arange(P), 0)


def prefill(m: ForwardModel, params, prompt, n, *, B: int, capacity: int, max_new, eos_id) -> State:
    call = layouts.prefill(prompt)
    logits, kv = run_call(m, params, call, m.empty_cache(0), 0, out_rows=(n - 1)[None])
    first = verifier_tokens(logits[0])
    cache = _cache_prompt(m, kv, prompt.shape[0], capacity, B)
    draft, draft_len = no_draft(B, m.mask_id)
    return start(m, cache, n, first, draft, draft_len, B=B, capacity=capacity, max_new=max_new,
                 eos_id=eos_id)


def first_call(m: ForwardModel, params, prompt, n, *, B: int, capacity: int, max_new,
               eos_id) -> State:
    P = prompt.shape[0]
    call = layouts.first_call(prompt, n, B, m.mask_id)
    rows = jnp.concatenate([(n - 1)[None], P + 1 + jnp.arange(B - 1)])
    logits, kv = run_call(m, params, call, m.empty_cache(0), 0, out_rows=rows)
    first = verifier_tokens(logits[0])
    draft = drafter_tokens(logits[1:], m.mask_id)
    cache = _cache_prompt(m, kv, P, capacity, B)
    return start(m, cache, n, first, draft, B - 1, B=B, capacity=capacity, max_new=max_new,
                 eos_id=eos_id)
