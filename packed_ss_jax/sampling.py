"""Exact speculative sampling (Section 3.2, Algorithm 2).

The target is the verifier's tempered, truncated distribution `p`. Each draft token
carries the distribution `Q` it was sampled from, even when `Q` was computed from an
older prefix (Packed-SS drafts one call ahead): a draft `d` is accepted with
probability min(1, p(d) / Q(d)); at the first rejection the correction is drawn from
normalised [p - Q]_+; after full acceptance a bonus is drawn from p. With this rule
the output follows the AR distribution exactly, whatever `Q` is, so `Q` may be
truncated further for storage without any effect on the output law.

Storage of Q: without truncation, full rows [W, V]; with top-k, the k nonzero entries
([W, k] ids and probabilities); with top-p alone, at most `TOP_P_STORE` entries (the
drafter's nucleus, capped; the cap only changes which drafts are proposed).
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp

from .reductions import leading_true

TOP_P_STORE = 64


@dataclasses.dataclass(frozen=True)
class Sampler:
    """temperature 0 is greedy (argmax, ties to the lowest id); top_k/top_p truncate."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"top_k must be an integer >= 1 (or None), got {k!r}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                              or not 0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (or None), got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def store_size(self, vocab: int) -> int | None:
        """Entries of Q kept per draft position; None = full rows."""
        if self.top_k is not None:
            return min(self.top_k, vocab)
        if self.top_p is not None and self.top_p < 1.0:
            return min(TOP_P_STORE, vocab)
        return None


@flax.struct.dataclass
class StoredQ:
    """Proposal distributions of the draft positions: dense [W, V], or sparse ids/probs [W, K]."""

    probs: jax.Array
    ids: jax.Array | None = None

    def of(self, tokens):
        """Q(tokens[i]) at each position i."""
        if self.ids is None:
            return jnp.take_along_axis(self.probs, tokens[:, None], axis=1)[:, 0]
        hit = self.ids == tokens[:, None]
        return jnp.sum(jnp.where(hit, self.probs, 0.0), axis=1)

    def dense_row(self, i, vocab: int):
        if self.ids is None:
            return self.probs[i]
        return jnp.zeros(vocab, jnp.float32).at[self.ids[i]].add(self.probs[i])

    def sample(self, key):
        """One token per position."""
        choice = jax.random.categorical(key, jnp.log(self.probs), axis=-1)
        if self.ids is None:
            return choice.astype(jnp.int32)
        return jnp.take_along_axis(self.ids, choice[:, None], axis=1)[:, 0].astype(jnp.int32)

    def shift(self, a, width: int):
        """Positions a, a+1, ... (Eq. 4's suffix), padded with copies of the last row."""
        def take(x):
            padded = jnp.concatenate([x, jnp.repeat(x[-1:], width, axis=0)])
            return jax.lax.dynamic_slice_in_dim(padded, a, width, axis=0)
        return StoredQ(take(self.probs), None if self.ids is None else take(self.ids))


def _keep_top_k(x, k: int):
    _, idx = jax.lax.top_k(x, k)
    keep = jnp.zeros(x.shape, bool)
    return jnp.put_along_axis(keep, idx, True, axis=-1, inplace=False)


def _keep_top_p(probs, p: float):
    """Smallest prefix of the descending order whose mass reaches p (ties: lower id first)."""
    order = jnp.argsort(-probs, axis=-1, stable=True)
    sorted_p = jnp.take_along_axis(probs, order, axis=-1)
    keep_sorted = (jnp.cumsum(sorted_p, axis=-1) - sorted_p) < p
    keep = jnp.zeros(probs.shape, bool)
    return jnp.put_along_axis(keep, order, keep_sorted, axis=-1, inplace=False)


def target(logits, s: Sampler):
    """The tempered, truncated distribution [..., V]: temperature, then top-k, then top-p."""
    x = logits.astype(jnp.float32) / s.temperature
    if s.top_k is not None and s.top_k < x.shape[-1]:
        x = jnp.where(_keep_top_k(x, s.top_k), x, -jnp.inf)
    probs = jax.nn.softmax(x, axis=-1)
    if s.top_p is not None and s.top_p < 1.0:
        probs = jnp.where(_keep_top_p(probs, s.top_p), probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return probs


def proposal(logits, s: Sampler, mask_id: int) -> StoredQ:
    """The drafter's Q for each row (MASK excluded), in its storage form."""
    probs = target(logits.at[..., mask_id].set(-jnp.inf), s)
    k = s.store_size(logits.shape[-1])
    if k is None:
        return StoredQ(probs)
    top, ids = jax.lax.top_k(probs, k)
    return StoredQ(top / jnp.sum(top, axis=-1, keepdims=True), ids.astype(jnp.int32))


def accept_ratio(p_d, q_d):
    """Acceptance probability of a draft token: min(1, p(d) / Q(d))."""
    return jnp.minimum(1.0, p_d / jnp.maximum(q_d, 1e-30))


def residual(p_row, q_row):
    """Correction distribution at the first rejection: normalised [p - Q]_+."""
    r = jnp.maximum(p_row - q_row, 0.0)
    total = jnp.sum(r)
    # A rejection is impossible where p <= Q everywhere; rounding aside, fall back to p.
    return jnp.where(total > 1e-12, r / jnp.maximum(total, 1e-30), p_row)


def sample_from(key, probs):
    return jax.random.categorical(key, jnp.log(probs)).astype(jnp.int32)


def verify(key, p_rows, draft, draft_len, q: StoredQ):
    """Algorithm 2's acceptance: returns h and the accepted tokens C (padded to len(p_rows)).

    p_rows[i] is the target at the position of draft[i] (its last row has no draft:
    the bonus position). C = draft[:h] + [correction or bonus].
    """
    W = draft.shape[0]
    k_accept, k_next = jax.random.split(key)
    u = jax.random.uniform(k_accept, (W,))
    p_d = jnp.take_along_axis(p_rows[:W], draft[:, None], axis=1)[:, 0]
    ok = (u < accept_ratio(p_d, q.of(draft))) & (jnp.arange(W) < draft_len)
    h = leading_true(ok)
    V = p_rows.shape[-1]
    rejected = h < draft_len
    dist = jnp.where(rejected, residual(p_rows[h], q.dense_row(jnp.minimum(h, W - 1), V)), p_rows[h])
    nxt = sample_from(k_next, dist)
    k = jnp.arange(W + 1)
    padded = jnp.concatenate([draft, jnp.zeros(1, jnp.int32)])
    return h, jnp.where(k < h, padded, nxt).astype(jnp.int32)
