"""One pure `step(state) -> state` per SetDLM schedule (App. C, D.2, E.6; Section 3.2).

Each step is one iteration of Algorithm 3 (or, for "native", of the release's threshold
decoder): choose U_t and its order, make the call(s), accept, commit the clean rows, keep
the correction for the next call's N row, store the next draft, apply the stop rule.
Greedy steps take the argmax with MASK excluded, in the window's order (LTR or
confidence); sampled steps (LTR only) verify each draft one call after drafting it,
against the `Q` it was drawn from (Algorithm 2), and split fresh keys from the state's
key every step. Each schedule's rows: README.md#schedules; orders and the sampling
rule: docs/setdlm.md.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from .. import sampling
from ..sampling import Sampler, StoredQ
from . import layouts
from .state import (State, accept, commit, finish, first_ranks, matches, predict, forward_visible,
                    set_pending, store_drafts, window)

THRESHOLD = 0.9  # the release's confidence threshold (E.6 "Native baseline")


def _pending(s: State):
    """The layouts' arguments after `n`: the pending token N (committed last iteration,
    not yet in the cache), its output index, and whether there is one (0 or 1)."""
    return s.pend_tok[0], s.pend_out[0], s.pend_n


def target(logits, sampler: Sampler, mask_id: int):
    """The verifier's tempered, truncated log-distribution [..., V], MASK excluded."""
    return sampling.target(logits.at[..., mask_id].set(-jnp.inf), sampler)


def _propose(logits, sampler: Sampler, mask_id: int, key):
    """Draft tokens, the probability each carries (its confidence score: the argmax's
    probability, or Q(d)), and Q (None when greedy)."""
    z, prob = predict(logits, mask_id)
    if sampler.greedy:
        return z, prob, None

    def sampled():
        q = sampling.proposal(logits, sampler, mask_id)
        drawn = q.sample(key)
        return (jnp.where(sampler.argmax, z, drawn),
                jnp.where(sampler.argmax, prob, jnp.exp(q.of(drawn))), q)

    # Greedy rows never read the Q stored with their drafts: none is computed for them.
    return sampling.greedy_or_sampled(sampler, lambda: (z, prob, StoredQ.empty_of(
        logits.shape[:-1], sampler, logits.shape[-1])), sampled)


def _stored_q(s: State, w) -> StoredQ:
    """The stored Q of each rank of window `w`, looked up by output index."""
    row = jnp.argmax(s.q_out[None, :] == w.out[:, None], axis=1)
    return StoredQ(s.q.logp[row], s.q.ids[row])


def _verify(m, logits, drafts, draft_len, q: StoredQ | None, w, sampler: Sampler, key):
    """h and v: the drafts accepted in rank order and, per rank, the verifier's token
    (v[h] is the correction, or the next rank's token when all were accepted).
    Greedy: drafts equal to the argmax (Eq. 2). Sampling: Algorithm 2 against `q`."""
    v, _ = predict(logits, m.mask_id)
    h = matches(w, drafts, v)
    if sampler.greedy:
        return h, v

    def sampled():
        logp = target(logits, sampler, m.mask_id)
        padded = jnp.concatenate([logp, logp[-1:]])  # rank W has no query: never used
        h_s, C = sampling.verify(key, padded, drafts, draft_len, q)
        return (jnp.where(sampler.argmax, h, h_s),
                jnp.where(sampler.argmax, v, C[: drafts.shape[0]]))

    return sampling.greedy_or_sampled(sampler, lambda: (h, v), sampled)


def _verified(s: State, w, v, h, kv, pend_n, A):
    """Accepts ranks < A, commits N and the h matched O rows (rows 0..W of the call),
    and keeps the correction at rank h, if any, for the next N row."""
    W = w.out.shape[0]
    s = accept(s, w, v, first_ranks(w, A))
    rows = jnp.minimum(jnp.arange(1 + W) + (1 - pend_n), W)  # N present: row 0; else start at O_0
    outs = jnp.concatenate([s.pend_out[:1], w.out])[rows]
    s = commit(s, kv, rows, outs, pend_n + h)
    has_correction = h < w.u
    return set_pending(s, v[jnp.minimum(h, W - 1)][None], w.out[jnp.minimum(h, W - 1)][None],
                       has_correction.astype(jnp.int32))


def _store(s: State, w, z, score, q: StoredQ | None, A) -> State:
    """Keeps the proposals for the ranks after the accepted ones (and, when sampling,
    the Q they were drawn from, by output index)."""
    s = store_drafts(s, w, z, score, from_rank=A)
    if q is None:
        return s
    return s.replace(q=q, q_out=jnp.where(w.active, w.out, -1))


def _one_call(m, params, s: State, W: int, order: str, sampler: Sampler, layout,
              proposal_rows: int):
    """A one-call step (Packed, Quadratic): the call over `[N | O | M | drafting rows]`;
    its M rows verify the stored drafts. Returns the state, window, pend_n, the call's logits
    (M rows, then the drafting rows), kv, h, v and the key left for the next drafts."""
    s, (k_verify, k_draft) = sampling.next_keys(s, 2, sampler)
    w = window(s, W, order, use_drafts=True)
    pend_n = s.pend_n
    drafts = s.draft[w.out]
    call = layout(s.n, *_pending(s), w, drafts, m.mask_id)
    logits, kv = forward_visible(m, params, call, s, 1 + W + jnp.arange(W + proposal_rows))
    q = None if sampler.greedy else _stored_q(s, w)
    h, v = _verify(m, logits[:W], drafts, w.kappa, q, w, sampler, k_verify)
    return s, w, pend_n, logits, kv, h, v, k_draft


def packed(m, params, s: State, *, W: int, order: str, sampler: Sampler) -> State:
    s, w, pend_n, logits, kv, h, v, k_draft = _one_call(m, params, s, W, order, sampler,
                                                   layouts.packed, W)  # M then R
    z, score, q = _propose(logits[W:], sampler, m.mask_id, k_draft)  # from P_{t-1}
    A = jnp.minimum(h + 1, w.u)
    s = _verified(s, w, v, h, kv, pend_n, A)
    s = _store(s, w, z, score, q, A)
    rows = pend_n + 3 * w.u
    return finish(s, w, first_ranks(w, A), A, 1, rows, rows, verifier=logits[:W],
                  drafter=logits[W:])


def quadratic(m, params, s: State, *, W: int, order: str, sampler: Sampler) -> State:
    s, w, pend_n, logits, kv, h, v, k_draft = _one_call(m, params, s, W, order, sampler,
                                                   layouts.quadratic, W * W)  # M, branches
    A = jnp.minimum(h + 1, w.u)
    # Branch h drafted the ranks after the correction given the h accepted drafts; the
    # next drafts come from it alone.
    branch = logits[W:].reshape(W, W, -1)[jnp.minimum(h, W - 1)]
    z, score, q = _propose(branch, sampler, m.mask_id, k_draft)
    s = _verified(s, w, v, h, kv, pend_n, A)
    s = _store(s, w, z, score, q, A)
    rows = pend_n + 2 * w.u + w.u * w.u
    return finish(s, w, first_ranks(w, A), A, 1, rows, rows, verifier=logits[:W], drafter=branch)


def branched(m, params, s: State, *, W: int, order: str, sampler: Sampler,
             branches: int) -> State:
    """Packed-SS plus Quadratic-SS's branches for the `branches - 1` most accepted
    outcomes (layouts.branched): the branch of the outcome the verification reaches
    drafts the next ranks; without one, Packed-SS's R does."""
    layout = functools.partial(layouts.branched, branches=branches)
    s, w, pend_n, logits, kv, h, v, k_draft = _one_call(m, params, s, W, order, sampler,
                                                   layout, W * branches)  # M, R, branches
    A = jnp.minimum(h + 1, w.u)
    # Which branch matches is decided by this call's verification alone, so the next
    # drafts' Q is fixed before the next call verifies them (the argument of App. E.4).
    hit = layouts.branch_outcomes(w, branches) == h
    group = jnp.where(jnp.any(hit), 1 + jnp.argmax(hit), 0) if branches > 1 else 0
    drafter = logits[W:].reshape(branches, W, -1)[group]
    z, score, q = _propose(drafter, sampler, m.mask_id, k_draft)
    s = _verified(s, w, v, h, kv, pend_n, A)
    s = _store(s, w, z, score, q, A)
    rows = pend_n + (2 + branches) * w.u
    return finish(s, w, first_ranks(w, A), A, 1, rows, rows, verifier=logits[:W],
                  drafter=drafter)


def linear(m, params, s: State, *, W: int, order: str, sampler: Sampler) -> State:
    s, (k_verify, k_draft) = sampling.next_keys(s, 2, sampler)
    # The order is fixed before the drafting call, from last iteration's verifier scores.
    w = window(s, W, order, use_drafts=False)
    pend_n = s.pend_n
    d_logits, kv = forward_visible(m, params, layouts.draft(s.n, *_pending(s), w, m.mask_id), s,
                                   1 + jnp.arange(W))
    z, _, q = _propose(d_logits, sampler, m.mask_id, k_draft)  # from the newest prefix
    s = commit(s, kv, jnp.zeros(1, jnp.int32), s.pend_out[:1], pend_n, after=z)  # N, cached now
    logits, kv = forward_visible(m, params, layouts.verify(s.n, w, z, m.mask_id), s, W + jnp.arange(W))
    h, v = _verify(m, logits, z, w.u, q, w, sampler, k_verify)
    A = jnp.minimum(h + 1, w.u)
    s = accept(s, w, v, first_ranks(w, A))
    s = commit(s, kv, jnp.arange(W), w.out, h)
    s = set_pending(s, v[jnp.minimum(h, W - 1)][None], w.out[jnp.minimum(h, W - 1)][None],
                    (h < w.u).astype(jnp.int32))
    if sampler.greedy:  # the verifier's confidences order the next window (E.6)
        _, v_prob = predict(logits, m.mask_id)
        s = store_drafts(s, w, v, v_prob, from_rank=A)
    return finish(s, w, first_ranks(w, A), A, 2, pend_n + 3 * w.u,
                  jnp.maximum(pend_n + w.u, 2 * w.u), verifier=logits, drafter=d_logits)


def native(m, params, s: State, *, W: int, order: str, sampler: Sampler) -> State:
    w = window(s, W, "ltr", use_drafts=False)
    call = layouts.native(s.n, s.pend_tok, s.pend_out, s.pend_n, w, m.mask_id)
    logits, kv = forward_visible(m, params, call, s, W + jnp.arange(W))
    pend_n = s.pend_n
    x, conf = predict(logits, m.mask_id)
    s = commit(s, kv, jnp.arange(W), s.pend_out, pend_n, after=x)
    conf = jnp.where(w.active, conf, -1.0)
    take = w.active & ((conf >= THRESHOLD) | (jnp.arange(W) == jnp.argmax(conf)))
    s = accept(s, w, x, take)
    fed = jnp.argsort(~take, stable=True)  # fed next call in textual order
    A = jnp.sum(take).astype(jnp.int32)
    s = set_pending(s, x[fed], w.out[fed], A)
    rows = pend_n + w.u
    return finish(s, w, take, A, 1, rows, rows, verifier=logits)


def serial(m, params, s: State, *, W: int, order: str, sampler: Sampler) -> State:
    """One token per call: the reference (greedy argmax, or plain ancestral sampling)."""
    s, (k,) = sampling.next_keys(s, 1, sampler)
    w = window(s, 1, "ltr", use_drafts=False)
    pend_n = s.pend_n
    logits, kv = forward_visible(m, params, layouts.serial(s.n, *_pending(s), w, m.mask_id), s,
                                 jnp.ones(1, jnp.int32))
    v, _ = predict(logits, m.mask_id)
    if not sampler.greedy:
        greedy = v

        def sampled():
            drawn = sampling.sample_from(k, target(logits[0], sampler, m.mask_id))[None]
            return jnp.where(sampler.argmax, greedy, drawn)

        v = sampling.greedy_or_sampled(sampler, lambda: greedy, sampled)
    s = commit(s, kv, jnp.zeros(1, jnp.int32), s.pend_out[:1], pend_n, after=v)
    take = first_ranks(w, 1)
    s = accept(s, w, v, take)
    s = set_pending(s, v, w.out, jnp.int32(1))
    return finish(s, w, take, jnp.int32(1), 1, pend_n + 1, pend_n + 1, verifier=logits)


SCHEDULES = {"serial": serial, "native": native, "linear": linear, "quadratic": quadratic,
             "packed": packed, "branched": branched}
# Schedules that sample (temperature > 0); "native" is the release's greedy decoder.
SAMPLED = ("serial", "linear", "quadratic", "packed", "branched")
