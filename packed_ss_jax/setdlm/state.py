"""SetDLM decoding state and the bookkeeping every schedule shares (App. C, Alg. 3).

With any-order verification the accepted positions need not form a prefix, so the state
keeps, per output index `o` (position `n + o` after an `n`-token prompt), the accepted
token, whether it is resolved, the stored draft and its confidence. `E`, the number of
output positions to fill, starts at the length limit and shrinks only when a stop marker
is accepted (App. E.2); entries past it stay in the cache, masked out of every later call
(`visible`), since moving the live positions together would copy the cache every step
(docs/performance.md). A correction waits in `pend_*` to be fed as the next call's clean
`N` row. Shapes are static, counts traced; non-finite logits stop the loop (`finish`).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from .. import cache as cache_lib
from .. import calls
from ..reductions import first_argmax, leading_true, nonfinite_rows

# The release sets the MASK logit to -1e12 before its softmax/argmax.
MASK_LOGIT = -1e12


@flax.struct.dataclass
class State:
    cache: Any
    cache_len: jax.Array
    position_out: jax.Array    # [S] output index held at each cache position (-1: prompt)
    n: jax.Array           # prompt length
    tok: jax.Array         # [C] accepted token per output index
    res: jax.Array         # [C] resolved (accepted and kept)
    draft: jax.Array       # [C] stored draft token (Packed/Quadratic)
    has_draft: jax.Array   # [C]
    score: jax.Array       # [C] confidence for the order policy; -inf: none
    pend_tok: jax.Array    # [Np] accepted tokens not yet fed as clean rows
    pend_out: jax.Array    # [Np] their output indices
    pend_n: jax.Array
    E: jax.Array           # output positions to fill
    stop_tok: jax.Array    # [K, Lm] stop markers, right-aligned by stop_len
    stop_len: jax.Array    # [K] (0: unused entry)
    done: jax.Array
    nfe: jax.Array
    iterations: jax.Array
    rows: jax.Array        # uncached rows evaluated after the prompt call (Table 2 count)
    max_rows: jax.Array    # most rows in one call after the prompt call
    accept_hist: jax.Array        # [W+1]: iterations that kept k tokens
    trace_out: jax.Array   # [I, W] the order pi_t of each iteration (-1 padded)
    trace_A: jax.Array     # [I] A_t, accepted before the stop rule
    trace_fed: jax.Array   # [I] tokens left to feed as clean rows next call (N / C rows)
    # Output tokens resolved (from finite logits) when NaN/Inf logits stopped the loop;
    # -1: none. A default, so that a driver building the state need not name it.
    nonfinite_at: jax.Array = flax.struct.field(default_factory=lambda: jnp.int32(-1))
    # A stop marker (EOS among them) ended the output.
    stopped: jax.Array = flax.struct.field(default_factory=lambda: jnp.bool_(False))
    # Sampling only (None when greedy): the PRNG key threaded through the loop, and the
    # proposal distributions Q the stored drafts were drawn from, one row per rank of the
    # window that drafted them (`q_out[r]`: that rank's output index, -1: none).
    key: Any = None
    q: Any = None
    q_out: Any = None
    sampler: Any = None   # the Sampler with its traced temperature / top-p


def masked_logits(logits, mask_id: int):
    return logits.at[..., mask_id].set(MASK_LOGIT)


def predict(logits, mask_id: int):
    """Greedy prediction and its probability, MASK excluded (first index on ties)."""
    logits = masked_logits(logits, mask_id)
    tokens = first_argmax(logits)
    probs = jax.nn.softmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]


class Window:
    """U_t in verification order: `out[r]` is pi_t(r+1); ranks >= u are padding."""

    def __init__(self, out, active, drafted):
        self.out, self.active, self.drafted = out, active, drafted
        self.u = jnp.sum(active).astype(jnp.int32)
        # kappa: leading ranks holding a draft (Alg. 3 line 6).
        self.kappa = leading_true(drafted)


def window(s: State, W: int, order: str, use_drafts: bool) -> Window:
    """Alg. 3 lines 3-5: the active window from the left-most unresolved position and its
    order. "ltr" checks in textual order; "confidence" by decreasing stored score, ties by
    textual position, positions without a finite score last in textual order (E.6)."""
    first = jnp.argmax(~s.res).astype(jnp.int32)
    idx = first + jnp.arange(W, dtype=jnp.int32)
    valid = (idx < s.E) & ~s.res[idx]
    if order == "ltr":
        perm = jnp.argsort(~valid, stable=True)
    else:
        score = s.score[idx]
        scored = valid & jnp.isfinite(score)
        group = jnp.where(scored, 0, jnp.where(valid, 1, 2))
        perm = jnp.lexsort((idx, jnp.where(scored, -score, 0.0), group))
    out, active = idx[perm], valid[perm]
    drafted = active & s.has_draft[out] if use_drafts else active
    return Window(out, active, drafted)


def matches(w: Window, drafts, v):
    """h: drafts equal to the verifier's prediction, consecutively in rank order (line 9)."""
    return leading_true(w.drafted & (drafts == v))


def first_ranks(w: Window, count):
    return (jnp.arange(w.out.shape[0]) < count) & w.active


def accept(s: State, w: Window, v, take) -> State:
    """Records (pi(r), v_r) as accepted for the ranks in `take`."""
    C = s.tok.shape[0]
    where = jnp.where(take & w.active, w.out, C)
    return s.replace(tok=s.tok.at[where].set(v, mode="drop"),
                     res=s.res.at[where].set(True, mode="drop"))


def commit(s: State, kv_rows, rows, outs, count, after=None) -> State:
    """Appends the first `count` of the candidate rows `rows` (output indices `outs`).

    after: non-negative ints computed from the call's logits (default `count`), so the
    write follows the call's cache reads and happens in place (see `cache.commit`)."""
    cache = cache_lib.commit(s.cache, kv_rows, rows, s.cache_len,
                             after=count if after is None else after)
    position_out = jax.lax.dynamic_update_slice(s.position_out, outs.astype(jnp.int32),
                                                (s.cache_len,))
    return s.replace(cache=cache, position_out=position_out, cache_len=s.cache_len + count)


def set_pending(s: State, tokens, outs, count) -> State:
    Np = s.pend_tok.shape[0]
    keep = jnp.arange(Np) < count
    return s.replace(pend_tok=jnp.where(keep, tokens[:Np], 0),
                     pend_out=jnp.where(keep, outs[:Np], -1), pend_n=count.astype(jnp.int32))


def store_drafts(s: State, w: Window, tokens, scores, from_rank) -> State:
    """Keeps proposals for ranks >= from_rank that are still unresolved (lines 14-15)."""
    C = s.tok.shape[0]
    keep = w.active & (jnp.arange(w.out.shape[0]) >= from_rank)
    clear = jnp.where(w.active, w.out, C)
    where = jnp.where(keep, w.out, C)
    has = s.has_draft.at[clear].set(False, mode="drop").at[where].set(True, mode="drop")
    score = s.score.at[clear].set(-jnp.inf, mode="drop").at[where].set(scores, mode="drop")
    return s.replace(draft=s.draft.at[where].set(tokens, mode="drop"), has_draft=has, score=score)


def stop_end(s: State):
    """Smallest end (exclusive output index) of a stop marker whose tokens are all
    accepted (App. E.2: the marker that ends earliest), or past the buffer when none."""
    C = s.tok.shape[0]
    o = jnp.arange(C)
    K, Lm = s.stop_tok.shape
    n = s.stop_len[:, None]

    def token_k(k, ok):
        # The k-th token from a marker's end sits at output index o - k.
        j = jnp.clip(o - k, 0, C - 1)
        want = jnp.take_along_axis(s.stop_tok, jnp.clip(s.stop_len - 1 - k, 0, Lm - 1)[:, None],
                                   axis=1)
        hit = (o - k >= 0) & s.res[j] & (s.tok[j][None, :] == want)
        return ok & ((k >= n) | hit)

    ok = jax.lax.fori_loop(0, Lm, token_k, jnp.broadcast_to(n > 0, (K, C)))
    return jnp.min(jnp.where(ok, o[None, :] + 1, C + 1)).astype(jnp.int32)


def visible(s: State):
    """[S] bool: the cache positions a call attends to, committed and not past E."""
    S = s.position_out.shape[0]
    return (jnp.arange(S) < s.cache_len) & (s.position_out < s.E)


def forward_visible(m, params, call, s: State, out_rows):
    """One NFE: a SetDLM layout through the model's forward, over the visible cache."""
    return calls.run_call(m, params, call, s.cache, visible(s), out_rows)


def apply_stop(s: State) -> State:
    """Alg. 3 lines 11-12: shrink E to the earliest accepted stop marker and discard
    every accepted or pending entry past it."""
    end = stop_end(s)
    E = jnp.minimum(s.E, end)
    C = s.tok.shape[0]
    res = s.res & (jnp.arange(C) < E)
    keep = (jnp.arange(s.pend_tok.shape[0]) < s.pend_n) & (s.pend_out < E)
    order = jnp.argsort(~keep, stable=True)
    return s.replace(E=E, res=res, pend_tok=s.pend_tok[order], pend_out=s.pend_out[order],
                     pend_n=jnp.sum(keep).astype(jnp.int32), stopped=s.stopped | (end <= s.E))


def finish(s: State, w: Window, take, A, calls: int, rows, call_rows, *, verifier,
           drafter=None) -> State:
    """Stop rule, statistics and the trace; done once positions 0..E-1 are all resolved.

    take: the ranks accepted this iteration; A: their count before the stop rule;
    rows: uncached rows over the iteration's calls; call_rows: those of its largest call;
    verifier[r] / drafter[r]: the logits row that chose rank r's token / draft. NaN or
    Inf in a row behind a kept token or a draft stops decoding: tokens taken from such
    rows are dropped, and `nonfinite_at` is the length of the resolved prefix left."""
    s = apply_stop(s)
    C = s.tok.shape[0]
    kept_ranks = take & w.active & (w.out < s.E)
    bad_ranks = nonfinite_rows(verifier) & kept_ranks
    bad = jnp.any(bad_ranks)
    if drafter is not None:
        bad = bad | jnp.any(nonfinite_rows(drafter) & w.active)
    res = s.res.at[jnp.where(bad_ranks, w.out, C)].set(False, mode="drop")
    s = s.replace(res=res, nonfinite_at=jnp.where(bad, leading_true(res), s.nonfinite_at))
    kept = jnp.sum(kept_ranks)
    it = s.iterations
    trace_out = jax.lax.dynamic_update_slice(
        s.trace_out, jnp.where(w.active, w.out, -1)[None], (jnp.minimum(it, s.trace_out.shape[0] - 1), 0))
    filled = jnp.all(s.res | (jnp.arange(C) >= s.E))
    return s.replace(
        nfe=s.nfe + calls, rows=s.rows + rows, max_rows=jnp.maximum(s.max_rows, call_rows),
        iterations=it + 1, accept_hist=s.accept_hist.at[kept].add(1), trace_out=trace_out,
        trace_A=s.trace_A.at[it].set(A, mode="drop"),
        trace_fed=s.trace_fed.at[it].set(s.pend_n, mode="drop"),
        done=filled | (it + 1 >= s.trace_A.shape[0]) | bad)
