"""One pure `step(state) -> state` per SetDLM schedule (App. C, D.2, E.6).

Greedy everywhere: predictions are argmax with the MASK logit excluded. Each step is
one iteration of Algorithm 3 (or of the release's decoder for "native"):
choose U_t and its order, make the call(s), accept, commit the clean rows, keep the
correction for the next call's N row, store the next draft, apply the stop rule.

serial     one query per call `[N | M]`: the serial one-token-at-a-time reference.
native     the release's threshold decoder: commit the most confident proposal and
           every proposal with probability >= 0.9; they are fed next call.
linear     draft `[N | R]` from the newest prefix, then verify `[O | M]` (2 NFE).
quadratic  `[N | O | M | branches]`: verify and draft every acceptance outcome (1 NFE).
packed     `[N | O | M | R]`: verify D_{t-1} and draft from P_{t-1} in one call.
"""

from __future__ import annotations

import jax.numpy as jnp

from . import layouts
from .state import (State, accept, commit, finish, first_ranks, matches, predict, run_call,
                    set_pending, store_drafts, window)

THRESHOLD = 0.9  # the release's confidence threshold (E.6 "Native baseline")


def _n(s: State):
    return s.pend_tok[0], s.pend_out[0], s.pend_n


def _verified(s: State, w, v, h, kv, p, A):
    """Accepts ranks < A, commits N and the h matched O rows (rows 0..W of the call),
    and keeps the correction at rank h, if any, for the next N row."""
    W = w.out.shape[0]
    s = accept(s, w, v, first_ranks(w, A))
    rows = jnp.minimum(jnp.arange(1 + W) + (1 - p), W)  # N present: row 0; else start at O_0
    outs = jnp.concatenate([s.pend_out[:1], w.out])[rows]
    s = commit(s, kv, rows, outs, p + h)
    has_correction = h < w.u
    return set_pending(s, v[jnp.minimum(h, W - 1)][None], w.out[jnp.minimum(h, W - 1)][None],
                       has_correction.astype(jnp.int32))


def packed(m, params, s: State, *, W: int, order: str) -> State:
    w = window(s, W, order, use_drafts=True)
    n_tok, n_out, p = _n(s)
    drafts = s.draft[w.out]
    call = layouts.packed(s.n, n_tok, n_out, p, w, drafts, m.mask_id)
    logits, kv = run_call(m, params, call, s, 1 + W + jnp.arange(2 * W))  # M then R rows
    v, _ = predict(logits[:W], m.mask_id)
    z, z_prob = predict(logits[W:], m.mask_id)
    h = matches(w, drafts, v)
    A = jnp.minimum(h + 1, w.u)
    s = _verified(s, w, v, h, kv, p, A)
    s = store_drafts(s, w, z, z_prob, from_rank=A)
    rows = p + 3 * w.u
    return finish(s, w, first_ranks(w, A), A, 1, rows, rows, verifier=logits[:W],
                  drafter=logits[W:])


def quadratic(m, params, s: State, *, W: int, order: str) -> State:
    w = window(s, W, order, use_drafts=True)
    n_tok, n_out, p = _n(s)
    drafts = s.draft[w.out]
    call = layouts.quadratic(s.n, n_tok, n_out, p, w, drafts, m.mask_id)
    logits, kv = run_call(m, params, call, s, 1 + W + jnp.arange(W + W * W))  # M, branches
    v, _ = predict(logits[:W], m.mask_id)
    h = matches(w, drafts, v)
    A = jnp.minimum(h + 1, w.u)
    # Branch h drafted the ranks after the correction given the h accepted drafts.
    branch = logits[W:].reshape(W, W, -1)[jnp.minimum(h, W - 1)]
    z, z_prob = predict(branch, m.mask_id)
    s = _verified(s, w, v, h, kv, p, A)
    s = store_drafts(s, w, z, z_prob, from_rank=A)
    rows = p + 2 * w.u + w.u * w.u
    return finish(s, w, first_ranks(w, A), A, 1, rows, rows, verifier=logits[:W], drafter=branch)


def linear(m, params, s: State, *, W: int, order: str) -> State:
    # The order is fixed before the drafting call, from last iteration's verifier scores.
    w = window(s, W, order, use_drafts=False)
    n_tok, n_out, p = _n(s)
    d_logits, kv = run_call(m, params, layouts.draft(s.n, n_tok, n_out, p, w, m.mask_id), s,
                            1 + jnp.arange(W))
    z, _ = predict(d_logits, m.mask_id)
    s = commit(s, kv, jnp.zeros(1, jnp.int32), s.pend_out[:1], p, after=z)  # N, cached now
    logits, kv = run_call(m, params, layouts.verify(s.n, w, z, m.mask_id), s, W + jnp.arange(W))
    v, v_prob = predict(logits, m.mask_id)
    h = matches(w, z, v)
    A = jnp.minimum(h + 1, w.u)
    s = accept(s, w, v, first_ranks(w, A))
    s = commit(s, kv, jnp.arange(W), w.out, h)
    s = set_pending(s, v[jnp.minimum(h, W - 1)][None], w.out[jnp.minimum(h, W - 1)][None],
                    (h < w.u).astype(jnp.int32))
    s = store_drafts(s, w, v, v_prob, from_rank=A)  # scores for the next order (E.6)
    return finish(s, w, first_ranks(w, A), A, 2, p + 3 * w.u, jnp.maximum(p + w.u, 2 * w.u),
                  verifier=logits, drafter=d_logits)


def native(m, params, s: State, *, W: int, order: str) -> State:
    w = window(s, W, "ltr", use_drafts=False)
    call = layouts.step(s.n, s.pend_tok, s.pend_out, s.pend_n, w, m.mask_id)
    logits, kv = run_call(m, params, call, s, W + jnp.arange(W))
    p = s.pend_n
    x, conf = predict(logits, m.mask_id)
    s = commit(s, kv, jnp.arange(W), s.pend_out, p, after=x)
    conf = jnp.where(w.active, conf, -1.0)
    take = w.active & ((conf >= THRESHOLD) | (jnp.arange(W) == jnp.argmax(conf)))
    s = accept(s, w, x, take)
    order_ = jnp.argsort(~take, stable=True)  # fed next call in textual order
    A = jnp.sum(take).astype(jnp.int32)
    s = set_pending(s, x[order_], w.out[order_], A)
    rows = p + w.u
    return finish(s, w, take, A, 1, rows, rows, verifier=logits)


def serial(m, params, s: State, *, W: int, order: str) -> State:
    w = window(s, 1, "ltr", use_drafts=False)
    n_tok, n_out, p = _n(s)
    logits, kv = run_call(m, params, layouts.serial(s.n, n_tok, n_out, p, w, m.mask_id), s,
                          jnp.ones(1, jnp.int32))
    v, _ = predict(logits, m.mask_id)
    s = commit(s, kv, jnp.zeros(1, jnp.int32), s.pend_out[:1], p, after=v)
    take = first_ranks(w, 1)
    s = accept(s, w, v, take)
    s = set_pending(s, v, w.out, jnp.int32(1))
    return finish(s, w, take, jnp.int32(1), 1, p + 1, p + 1, verifier=logits)


SCHEDULES = {"serial": serial, "native": native, "linear": linear, "quadratic": quadratic,
             "packed": packed}
