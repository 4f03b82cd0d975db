"""How a schedule starts (App. E.2).

`prefill` (AR, Linear-SS; every schedule when sampling): a causal pass over the prompt
gives the first token (1 NFE).
`first_call` (Packed-SS, Quadratic-SS): greedy, the same pass plus B MASK rows after
the prompt, so one call also yields a full draft of B-1 tokens for positions
n+1..n+B-1 (the proposal for position n is dropped: the verifier fills it). When
sampling, the first token is drawn first and a second call `[x, MASK^(B-1)]` drafts
from the prompt and that token (2 NFE), so every draft carries its Q. A sampled
program's greedy request (temperature 0, `Sampler.argmax`) starts as the greedy program
does, in one call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import cache as cache_lib
from . import layouts
from ..reductions import nonfinite_rows
from ..calls import run_call
from ..sampling import Sampler, next_keys
from .state import (ForwardModel, State, choose_first, drafter_tokens, empty_q, no_draft, propose,
                    first_state, stop_nonfinite, verifier_tokens)


def _cache_prompt(m: ForwardModel, kv_rows, P: int, capacity: int, B: int):
    # Headroom of one block past `capacity` keeps every later commit in range.
    return cache_lib.commit(m.empty_cache(capacity + B), kv_rows, jnp.arange(P), 0)


def prefill(m: ForwardModel, params, prompt, n, *, B: int, capacity: int, max_new, stop_tok,
            stop_len, sampler: Sampler, key) -> State:
    call = layouts.prefill(prompt)
    logits, kv = run_call(m, params, call, m.empty_cache(0), 0, out_rows=(n - 1)[None])
    k_first = None
    if not sampler.greedy:
        key, k_first = jax.random.split(key)
    first = choose_first(logits[0], sampler, k_first)
    cache = _cache_prompt(m, kv, prompt.shape[0], capacity, B)
    draft, draft_len = no_draft(B, m.mask_id)
    return first_state(cache, n, first, draft, draft_len, B=B, capacity=capacity, max_new=max_new,
                 stop_tok=stop_tok, stop_len=stop_len, verifier=logits,
                 key=None if sampler.greedy else key,
                 draft_q=empty_q(sampler, B - 1, m.vocab_size), sampler=sampler)


def first_call(m: ForwardModel, params, prompt, n, *, B: int, capacity: int, max_new, stop_tok,
               stop_len, sampler: Sampler, key) -> State:
    kw = dict(B=B, capacity=capacity, max_new=max_new, stop_tok=stop_tok, stop_len=stop_len)
    if sampler.greedy:
        return _greedy_first_call(m, params, prompt, n, **kw)

    def sampled():
        s = prefill(m, params, prompt, n, sampler=sampler, key=key, **kw)
        return jax.lax.cond(s.done, lambda s: s, lambda s: _draft_after_first(m, params, s, B, sampler), s)

    def greedy():  # the sampled state's fields, unused by greedy steps
        s = _greedy_first_call(m, params, prompt, n, **kw)
        return s.replace(key=key, draft_q=empty_q(sampler, B - 1, m.vocab_size), sampler=sampler)

    def either():   # vmapped over a batch, both sides run for every row
        return jax.lax.cond(sampler.argmax, greedy, sampled)

    if sampler.some_argmax is None:
        return either()
    return jax.lax.cond(sampler.some_argmax, either, sampled)


def _greedy_first_call(m: ForwardModel, params, prompt, n, *, B: int, capacity: int, max_new,
                       stop_tok, stop_len) -> State:
    P = prompt.shape[0]
    call = layouts.first_call(prompt, n, B, m.mask_id)
    rows = jnp.concatenate([(n - 1)[None], P + 1 + jnp.arange(B - 1)])
    logits, kv = run_call(m, params, call, m.empty_cache(0), 0, out_rows=rows)
    first = verifier_tokens(logits[0])
    draft = drafter_tokens(logits[1:], m.mask_id)
    cache = _cache_prompt(m, kv, P, capacity, B)
    return first_state(cache, n, first, draft, B - 1, B=B, capacity=capacity, max_new=max_new,
                 stop_tok=stop_tok, stop_len=stop_len, verifier=logits[:1], drafter=logits[1:])


def _draft_after_first(m, params, s: State, B: int, sampler: Sampler) -> State:
    s, (k,) = next_keys(s, 1, sampler)
    call = layouts.draft_block(s.x, s.cache_len, B, m.mask_id)
    logits, _ = run_call(m, params, call, s.cache, s.cache_len, out_rows=jnp.arange(1, B))
    draft, q = propose(logits, sampler, m.mask_id, k)
    s = stop_nonfinite(s, jnp.any(nonfinite_rows(logits)))
    return s.replace(draft=draft, draft_len=jnp.int32(B - 1), draft_q=q, nfe=s.nfe + 1)
