"""Decoding state and the steps every schedule shares: accept, stop, emit, commit.

The state is one pytree carried through `lax.while_loop`. Stopping (the stop markers,
EOS among them, and the length limit) is decided here, inside the loop (Algorithm 1,
lines 7-8); counts and the marker table are traced, so a new `max_new_tokens`, EOS id or
stop sequence never recompiles.

Non-finite logits stop the loop too: a token is appended only if the logits row it
was chosen from is finite, and the loop goes on only if the drafter rows are finite
too. Otherwise `nonfinite_at` records the generated position where it stopped and
the driver raises on the host (results.check_finite). Verifier rows past the appended
tokens are not looked at: they condition on rejected drafts, so a token whose
embedding is NaN can poison them without ever being output, and AR decoding would
not stop there either.
"""

from __future__ import annotations

from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from .. import cache as cache_lib
from .. import sampling, stops
from ..reductions import first_argmax, leading_true, nonfinite_rows
from ..sampling import Sampler, StoredQ


class ForwardModel(Protocol):
    """What a schedule needs from a model (see model.py for the contract)."""

    mask_id: int
    vocab_size: int

    def forward(self, params, tokens, positions, mask, cache, cache_len, draft_rows,
                out_rows=None): ...

    def empty_cache(self, size: int): ...


@flax.struct.dataclass
class State:
    cache: Any
    cache_len: jax.Array   # committed positions == position of x
    x: jax.Array           # last verified token; not yet in the cache
    draft: jax.Array       # [B-1] next draft, MASK-padded
    draft_len: jax.Array   # real draft tokens in `draft`
    out: jax.Array         # [capacity] generated tokens
    n_tokens: jax.Array
    done: jax.Array
    nfe: jax.Array
    iterations: jax.Array
    accept_hist: jax.Array        # [B+1]: accept_hist[k] = iterations that emitted k tokens
    max_new: jax.Array
    stop_tok: jax.Array    # [K, Lm] stop markers (EOS included), see stops.py
    stop_len: jax.Array    # [K] (0: unused entry)
    nonfinite_at: jax.Array  # generated position where NaN/Inf logits stopped the loop; -1: none
    stopped: jax.Array     # a stop marker (EOS among them) ended the output
    key: Any = None        # PRNG key (sampling only), threaded through the loop
    draft_q: Any = None    # StoredQ of the draft (sampling only): what each d was drawn from
    sampler: Any = None    # the Sampler with its traced temperature / top-p (sampling only)


def verifier_tokens(logits):
    """Greedy AR choice: argmax over the full vocabulary (first index on ties)."""
    return first_argmax(logits)


def drafter_tokens(logits, mask_id: int):
    """Greedy draft choice: argmax with MASK excluded (a MASK is never a draft)."""
    return first_argmax(jnp.where(jnp.arange(logits.shape[-1]) == mask_id, -jnp.inf, logits))


def matched_prefix(draft, draft_len, verified):
    """h: leading draft tokens equal to the verifier's predictions (Eq. 2).

    draft[i] is d^(i+1); verified[i] is v^(i+1). Slots past draft_len are padding and
    never match, even if the verifier happens to predict the MASK id.
    """
    ok = (draft == verified[: draft.shape[0]]) & (jnp.arange(draft.shape[0]) < draft_len)
    return leading_true(ok)


def stop_nonfinite(s: State, bad, position=None) -> State:
    """Stops the loop when `bad` (scalar bool): non-finite logits were read for the
    generated position `position` (default: the next one)."""
    at = s.n_tokens if position is None else position
    return s.replace(nonfinite_at=jnp.where(bad, at, s.nonfinite_at), done=s.done | bad)


def choose_first(logits, sampler: Sampler, key):
    """The token after the prompt: argmax, or a draw from the target."""
    greedy = verifier_tokens(logits)
    if sampler.greedy:
        return greedy

    def sampled():
        drawn = sampling.sample_from(key, sampling.target(logits, sampler))
        return jnp.where(sampler.argmax, greedy, drawn)

    return sampling.greedy_or_sampled(sampler, lambda: greedy, sampled)


def verify_draft(v_logits, draft, draft_len, q, sampler: Sampler, key):
    """h and the accepted tokens C (C[:h] = accepted drafts, C[h] = correction or bonus).

    v_logits[i] is the verifier row predicting the position of draft[i]. Greedy (the
    greedy program, or a sampled one at temperature 0): exact match against the argmax
    (Eq. 2). Sampling: Algorithm 2 against the stored Q.
    """
    v = verifier_tokens(v_logits)
    h = matched_prefix(draft, draft_len, v)
    if sampler.greedy:
        return h, v

    def sampled():
        h_s, C = sampling.verify(key, sampling.target(v_logits, sampler), draft, draft_len, q)
        return jnp.where(sampler.argmax, h, h_s), jnp.where(sampler.argmax, v, C)

    return sampling.greedy_or_sampled(sampler, lambda: (h, v), sampled)


def propose(logits, sampler: Sampler, mask_id: int, key):
    """Draft tokens from drafter rows, with their Q when sampling (None when greedy)."""
    greedy = drafter_tokens(logits, mask_id)
    if sampler.greedy:
        return greedy, None

    def sampled():
        q = sampling.proposal(logits, sampler, mask_id)
        return jnp.where(sampler.argmax, greedy, q.sample(key)), q

    # Greedy rows never read the Q stored with their drafts: none is computed for them.
    return sampling.greedy_or_sampled(sampler, lambda: (greedy, StoredQ.empty_of(
        logits.shape[:-1], sampler, logits.shape[-1])), sampled)


def empty_q(sampler: Sampler, width: int, vocab: int):
    return None if sampler.greedy else StoredQ.empty(sampler, width, vocab)


def emit(s: State, accepted, count, verifier, drafter=None) -> State:
    """Appends accepted[:a], a = min(count, tokens left, the end of the first stop marker
    completed by accepted[:count]) (Alg. 1, l. 7-8).

    verifier[k] is the logits row accepted[k] was chosen by; drafter, the rows the next
    draft came from. If verifier[r] holds NaN/Inf for some r < a, only accepted[:r] is
    appended; then, or if drafter does, decoding stops after what was appended (see the
    module docstring)."""
    k = jnp.arange(accepted.shape[0])
    is_stop = stops.ends_in_new(s.out, s.n_tokens, accepted, count, s.stop_tok, s.stop_len)
    stop_at = jnp.where(jnp.any(is_stop), jnp.argmax(is_stop) + 1, count)
    a = jnp.minimum(jnp.minimum(count, s.max_new - s.n_tokens), stop_at).astype(jnp.int32)
    row_bad = nonfinite_rows(verifier) & (k < a)
    a = jnp.min(jnp.where(row_bad, k, a)).astype(jnp.int32)  # tokens before the first bad row
    bad = jnp.any(row_bad)
    if drafter is not None:
        bad = bad | jnp.any(nonfinite_rows(drafter))
    s = stop_nonfinite(s, bad, s.n_tokens + a)
    capacity = s.out.shape[0]
    index = jnp.where(k < a, s.n_tokens + k, capacity)  # out-of-range rows are dropped
    out = s.out.at[index].set(accepted, mode="drop")
    n_tokens = s.n_tokens + a
    marker = jnp.any(is_stop & (k < a))
    return s.replace(out=out, n_tokens=n_tokens, done=s.done | marker | (n_tokens >= s.max_new),
                     stopped=s.stopped | marker,
                     iterations=s.iterations + 1, accept_hist=s.accept_hist.at[a].add(1))


def advance(s: State, kv_rows, rows, accepted, count, next_x, draft, draft_len, calls: int,
            draft_q=None, *, verifier, drafter=None) -> State:
    """Commits the first `count` candidate rows (x and the accepted drafts), makes the
    correction/bonus token the next x, stores the next draft (and its Q), and emits
    (`verifier`, `drafter`: the logits behind `accepted` and `draft`, see `emit`)."""
    cache = cache_lib.commit(s.cache, kv_rows, rows, s.cache_len, after=accepted)
    s = s.replace(cache=cache, cache_len=s.cache_len + count, x=next_x, draft=draft,
                  draft_len=draft_len, nfe=s.nfe + calls,
                  draft_q=s.draft_q if draft_q is None else draft_q)
    return emit(s, accepted, count, verifier, drafter)


def first_state(cache, n, first, draft, draft_len, *, B: int, capacity: int,
          max_new, stop_tok, stop_len, verifier, drafter=None, key=None,
          draft_q=None, sampler=None) -> State:
    """State after the first call: the prompt is cached, `first` is the first token
    (chosen by the logits row `verifier` [1, V]; `drafter`: the rows of `draft`)."""
    s = State(cache=cache, cache_len=jnp.asarray(n, jnp.int32), x=first, draft=draft,
              draft_len=jnp.asarray(draft_len, jnp.int32),
              out=jnp.zeros(capacity, jnp.int32), n_tokens=jnp.int32(0), done=jnp.bool_(False),
              nfe=jnp.int32(1), iterations=jnp.int32(0), accept_hist=jnp.zeros(B + 1, jnp.int32),
              max_new=jnp.asarray(max_new, jnp.int32), stop_tok=jnp.asarray(stop_tok, jnp.int32),
              stop_len=jnp.asarray(stop_len, jnp.int32),
              nonfinite_at=jnp.int32(-1), stopped=jnp.bool_(False), key=key, draft_q=draft_q,
              sampler=None if sampler is None or sampler.greedy else sampler)
    return emit(s, first[None], jnp.int32(1), verifier, drafter)


def no_draft(B: int, mask_id: int):
    return jnp.full(B - 1, mask_id, jnp.int32), 0
