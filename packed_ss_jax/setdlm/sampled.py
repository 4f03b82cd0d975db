"""Exact LTR sampling for the SetDLM schedules (Section 3.2, Algorithm 2).

The target at an output position is the tempered, truncated distribution of the
SetDLM AR conditional with the MASK token excluded: the M query at that position
seeing the committed prefix and the earlier-rank drafts. Serial one-token-at-a-time
ancestral sampling from it is the reference law ("serial").

Each draft token is drawn from the drafter's distribution Q at its R query (for
Quadratic-SS, the branch matching the accepted prefix), and its Q is stored with it:
Packed-SS and Quadratic-SS verify a draft one call after drafting it, against the Q
it was drawn from. Verification runs in LTR rank order with Algorithm 2: a draft d is
accepted with probability min(1, p(d) / Q(d)); the first rejection draws the
correction from normalised [p - Q]_+; when every stored draft is accepted, the next
unresolved rank of the window (if any) is drawn from p, its M query seeing all the
accepted drafts, as the greedy schedules take its argmax. A window whose drafts are
all accepted and that has no further rank ends the iteration without a correction;
the next position is then drawn in the next call.

Every step splits fresh keys from the key carried in the state, so all uniforms are
independent and a seed reproduces a run. Only the LTR order is supported: the
confidence order would make the verification order depend on the drafts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import sampling
from ..sampling import Sampler, StoredQ
from . import layouts
from .state import (State, accept, commit, finish, first_ranks, run_call, set_pending,
                    store_drafts, window)


def target(logits, sampler: Sampler, mask_id: int):
    """The verifier's tempered, truncated distribution [..., V], MASK excluded."""
    return sampling.target(logits.at[..., mask_id].set(-jnp.inf), sampler)


def empty_q(sampler: Sampler, W: int, vocab: int) -> StoredQ:
    return StoredQ.empty(sampler, W, vocab)


def _split(s: State, n: int):
    keys = jax.random.split(s.key, n + 1)
    return s.replace(key=keys[0]), list(keys[1:])


def _n(s: State):
    return s.pend_tok[0], s.pend_out[0], s.pend_n


def _stored_q(s: State, w) -> StoredQ:
    """The stored Q of each rank of window `w`, looked up by output index."""
    row = jnp.argmax(s.q_out[None, :] == w.out[:, None], axis=1)
    return StoredQ(s.q.logp[row], None if s.q.ids is None else s.q.ids[row])


def _verify(key, logp_rows, drafts, draft_len, q: StoredQ):
    """Algorithm 2 over the window's ranks: h and C (C[:h] drafts, C[h] correction)."""
    padded = jnp.concatenate([logp_rows, logp_rows[-1:]])  # rank W has no query: never used
    h, C = sampling.verify(key, padded, drafts, draft_len, q)
    return h, C[: drafts.shape[0]]


def _verified(s: State, w, v, h, kv, p, A):
    """As the greedy schedules: accept ranks < A, commit N and the h accepted O rows,
    keep the correction at rank h, if any, for the next N row."""
    W = w.out.shape[0]
    s = accept(s, w, v, first_ranks(w, A))
    rows = jnp.minimum(jnp.arange(1 + W) + (1 - p), W)
    outs = jnp.concatenate([s.pend_out[:1], w.out])[rows]
    s = commit(s, kv, rows, outs, p + h)
    has_correction = h < w.u
    return set_pending(s, v[jnp.minimum(h, W - 1)][None], w.out[jnp.minimum(h, W - 1)][None],
                       has_correction.astype(jnp.int32))


def _store(s: State, w, z, q: StoredQ, A) -> State:
    s = store_drafts(s, w, z, jnp.exp(q.of(z)), from_rank=A)
    return s.replace(q=q, q_out=jnp.where(w.active, w.out, -1))


def _call_and_verify(m, params, s: State, W: int, sampler: Sampler, layout, proposal_rows: int):
    """The start of a one-call step (Packed, Quadratic): one call over the window's M rows
    (which verify the stored drafts against their stored Q) and `proposal_rows` drafting
    rows. Returns the state, window, p, the call's logits (M rows, then the drafting
    rows), kv, h, v and the key left for drawing the next drafts."""
    s, (k_verify, k_draft) = _split(s, 2)
    w = window(s, W, "ltr", use_drafts=True)
    n_tok, n_out, p = _n(s)
    drafts = s.draft[w.out]
    call = layout(s.n, n_tok, n_out, p, w, drafts, m.mask_id)
    logits, kv = run_call(m, params, call, s, 1 + W + jnp.arange(W + proposal_rows))
    h, v = _verify(k_verify, target(logits[:W], sampler, m.mask_id), drafts, w.kappa,
                   _stored_q(s, w))
    return s, w, p, logits, kv, h, v, k_draft


def packed(m, params, s: State, *, W: int, sampler: Sampler) -> State:
    s, w, p, logits, kv, h, v, k_draft = _call_and_verify(m, params, s, W, sampler,
                                                          layouts.packed, W)  # M then R
    q = sampling.proposal(logits[W:], sampler, m.mask_id)  # from P_{t-1}
    z = q.sample(k_draft)
    A = jnp.minimum(h + 1, w.u)
    s = _verified(s, w, v, h, kv, p, A)
    s = _store(s, w, z, q, A)
    rows = p + 3 * w.u
    return finish(s, w, first_ranks(w, A), A, 1, rows, rows, verifier=logits[:W],
                  drafter=logits[W:])


def quadratic(m, params, s: State, *, W: int, sampler: Sampler) -> State:
    s, w, p, logits, kv, h, v, k_draft = _call_and_verify(m, params, s, W, sampler,
                                                          layouts.quadratic, W * W)  # M, branches
    A = jnp.minimum(h + 1, w.u)
    # The next drafts come from the branch of the accepted prefix only (h drafts).
    branch = logits[W:].reshape(W, W, -1)[jnp.minimum(h, W - 1)]
    q = sampling.proposal(branch, sampler, m.mask_id)
    z = q.sample(k_draft)
    s = _verified(s, w, v, h, kv, p, A)
    s = _store(s, w, z, q, A)
    rows = p + 2 * w.u + w.u * w.u
    return finish(s, w, first_ranks(w, A), A, 1, rows, rows, verifier=logits[:W], drafter=branch)


def linear(m, params, s: State, *, W: int, sampler: Sampler) -> State:
    s, (k_verify, k_draft) = _split(s, 2)
    w = window(s, W, "ltr", use_drafts=False)
    n_tok, n_out, p = _n(s)
    d_logits, kv = run_call(m, params, layouts.draft(s.n, n_tok, n_out, p, w, m.mask_id), s,
                            1 + jnp.arange(W))
    q = sampling.proposal(d_logits, sampler, m.mask_id)  # from the newest prefix
    z = q.sample(k_draft)
    s = commit(s, kv, jnp.zeros(1, jnp.int32), s.pend_out[:1], p, after=z)  # N, cached now
    logits, kv = run_call(m, params, layouts.verify(s.n, w, z, m.mask_id), s, W + jnp.arange(W))
    h, v = _verify(k_verify, target(logits, sampler, m.mask_id), z, w.u, q)
    A = jnp.minimum(h + 1, w.u)
    s = accept(s, w, v, first_ranks(w, A))
    s = commit(s, kv, jnp.arange(W), w.out, h)
    s = set_pending(s, v[jnp.minimum(h, W - 1)][None], w.out[jnp.minimum(h, W - 1)][None],
                    (h < w.u).astype(jnp.int32))
    return finish(s, w, first_ranks(w, A), A, 2, p + 3 * w.u, jnp.maximum(p + w.u, 2 * w.u),
                  verifier=logits, drafter=d_logits)


def serial(m, params, s: State, *, W: int, sampler: Sampler) -> State:
    """Plain ancestral sampling, one token per call: the reference law."""
    s, (k,) = _split(s, 1)
    w = window(s, 1, "ltr", use_drafts=False)
    n_tok, n_out, p = _n(s)
    logits, kv = run_call(m, params, layouts.serial(s.n, n_tok, n_out, p, w, m.mask_id), s,
                          jnp.ones(1, jnp.int32))
    v = sampling.sample_from(k, target(logits[0], sampler, m.mask_id))[None]
    s = commit(s, kv, jnp.zeros(1, jnp.int32), s.pend_out[:1], p, after=v)
    take = first_ranks(w, 1)
    s = accept(s, w, v, take)
    s = set_pending(s, v, w.out, jnp.int32(1))
    return finish(s, w, take, jnp.int32(1), 1, p + 1, p + 1, verifier=logits)


SAMPLED = {"serial": serial, "linear": linear, "quadratic": quadratic, "packed": packed}
