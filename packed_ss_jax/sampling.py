"""Exact speculative sampling (Section 3.2, Algorithm 2).

The target is the verifier's tempered, truncated distribution `p`. Each draft token
carries the distribution `Q` it was drawn from, even when `Q` came from an older prefix:
a draft `d` is accepted with probability min(1, p(d) / Q(d)), the first rejection draws
the correction from normalised [p - Q]_+, full acceptance a bonus from p. The output then
follows the AR law whatever `Q` is, so `Q` may be truncated for storage (`Q_STORE`).

Everything is computed on log-probabilities, so any temperature > 0 gives a valid law.
A sampled program decodes a temperature of exactly 0 greedily, as data; a batch's step
branches on its live rows' values (`batch_plan`). The rules and why: docs/sampling.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .reductions import leading_true

Q_STORE = 64
PLANS = ("argmax", "whole", "mixed")   # a batch's step, by index (see `batch_plan`)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What a compiled decode is specialised on: greedy or sampled, and top-k's k (it
    fixes the stored proposals' shape). The temperature and top-p are not: they are
    traced (`Sampler`), so one sampled program serves every temperature (0 included:
    `Sampler.argmax`) and every top-p."""

    greedy: bool = True
    top_k: int | None = None

    def bind(self, temperature, top_p) -> Sampler:
        """The sampler of this program with its traced values (top_p 1: no truncation)."""
        if self.greedy:
            return Sampler()
        return Sampler(temperature, self.top_k, top_p, greedy=False)


@flax.struct.dataclass
class Sampler:
    """temperature 0 is greedy (argmax, ties to the lowest id); top_k/top_p truncate.

    Built from Python numbers (checked here) or, inside a program, from traced values
    (`Sampling.bind`): `greedy` and `top_k` are static, temperature and top_p are data.
    `plan`: inside a batch's step, the index in PLANS its live rows allow (traced, the
    same for every row); None: each row by its own values. `some_argmax`: in a batch's
    first call, whether any row is greedy (traced, the same for every row); None: this
    row's own temperature decides."""

    temperature: Any = 0.0
    top_k: int | None = flax.struct.field(pytree_node=False, default=None)
    top_p: Any = None
    greedy: bool | None = flax.struct.field(pytree_node=False, default=None)
    plan: Any = None
    some_argmax: Any = None

    def __post_init__(self):
        if self.greedy is not None:  # rebuilt from traced values: nothing to check
            return
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
        if p is not None and p >= 1.0:  # keeps every token: no truncation
            object.__setattr__(self, "top_p", None)
        object.__setattr__(self, "greedy", t == 0)

    @property
    def sampling(self) -> Sampling:
        """The static part: what picks the compiled program."""
        if self.greedy:  # truncation does not change an argmax
            return Sampling()
        return Sampling(False, self.top_k)

    @property
    def traced(self) -> dict:
        """The data part: the values a sampled program takes as arguments (float32, as the
        program holds them), the temperature and top-p (1 when top-p does not truncate)."""
        return {"temperature": np.float32(self.temperature),
                "top_p": np.float32(1.0 if self.top_p is None else self.top_p)}

    @property
    def argmax(self):
        """Whether this sampled program decodes greedily (traced: temperature == 0)."""
        return self.temperature == 0

    def store_size(self, vocab: int) -> int:
        """Entries of Q kept per draft position."""
        return min(Q_STORE if self.top_k is None else self.top_k, vocab)


def greedy_or_sampled(sampler: Sampler, greedy, sampled):
    """`greedy()` or `sampled()` (no arguments; the same structure out) for a sampled
    program: `sampled` picks per row by `sampler.argmax`; a batch whose live rows are all
    greedy (plan "argmax") runs `greedy` alone."""
    if sampler.plan is None:
        return sampled()
    return jax.lax.cond(sampler.plan == PLANS.index("argmax"), greedy, sampled)


def next_keys(state, n: int, sampler: Sampler):
    """n fresh PRNG keys for a loop step (None when greedy) and `state` with its key
    (`state.key`) advanced."""
    if sampler.greedy:
        return state, [None] * n
    keys = jax.random.split(state.key, n + 1)
    return state.replace(key=keys[0]), list(keys[1:])


def batch_plan(sampler: Sampler, live):
    """The index in PLANS of the cheapest step exact for every live row of a batch
    (`sampler`'s values and `live` with a leading row axis)."""
    greedy = (sampler.temperature == 0) | ~live
    whole = jnp.all(greedy | (sampler.top_p >= 1))
    return jnp.where(jnp.all(greedy), PLANS.index("argmax"),
                     jnp.where(whole, PLANS.index("whole"), PLANS.index("mixed")))


@flax.struct.dataclass
class StoredQ:
    """Proposal distributions of the draft positions as log-probabilities: sparse ids and
    log-probabilities [W, K] (-inf: no mass), as decodes store them, or dense [W, V]
    (`ids` None)."""

    logp: jax.Array
    ids: jax.Array | None = None

    @staticmethod
    def empty(sampler: Sampler, width: int, vocab: int) -> StoredQ:
        """Storage for `width` draft positions, holding no proposal yet."""
        return StoredQ.empty_of((width,), sampler, vocab)

    @staticmethod
    def empty_of(rows: tuple, sampler: Sampler, vocab: int) -> StoredQ:
        """Storage for draft positions of shape `rows`, holding no proposal."""
        k = sampler.store_size(vocab)
        return StoredQ(jnp.full((*rows, k), -jnp.inf, jnp.float32),
                       jnp.zeros((*rows, k), jnp.int32))

    @property
    def probs(self):
        return jnp.exp(self.logp)

    def of(self, tokens):
        """log Q(tokens[i]) at each position i."""
        if self.ids is None:
            return jnp.take_along_axis(self.logp, tokens[:, None], axis=1)[:, 0]
        hit = self.ids == tokens[:, None]
        return jnp.max(jnp.where(hit, self.logp, -jnp.inf), axis=1)

    def dense_row(self, i, vocab: int):
        if self.ids is None:
            return self.logp[i]
        return jnp.full(vocab, -jnp.inf, jnp.float32).at[self.ids[i]].set(self.logp[i])

    def sample(self, key):
        """One token per position."""
        choice = jax.random.categorical(key, self.logp, axis=-1)
        if self.ids is None:
            return choice.astype(jnp.int32)
        return jnp.take_along_axis(self.ids, choice[:, None], axis=1)[:, 0].astype(jnp.int32)

    def shift(self, a, width: int):
        """Positions a, a+1, ... (Eq. 4's suffix), padded with copies of the last row."""
        def take(x):
            padded = jnp.concatenate([x, jnp.repeat(x[-1:], width, axis=0)])
            return jax.lax.dynamic_slice_in_dim(padded, a, width, axis=0)
        return StoredQ(take(self.logp), None if self.ids is None else take(self.ids))


def _keep_top_k(x, k: int):
    _, idx = jax.lax.top_k(x, k)
    keep = jnp.zeros(x.shape, bool)
    return jnp.put_along_axis(keep, idx, True, axis=-1, inplace=False)


def _keep_top_p(logp, rank, p: float):
    """Smallest prefix of the descending order of `rank` (the tempered logits, whose order
    is the distribution's; ties: lower id first) whose mass under `logp` reaches p; never
    empty. The most likely token is kept whatever p: a p that is 0 or subnormal in
    float32 (a tiny Python float; XLA's CPU backend flushes subnormals to 0) would
    otherwise keep nothing, and an empty support samples garbage (NaN weights). The order
    is not read off `logp`: normalising rounds tokens a few ulps apart to one value, and
    the token kept alone must be the argmax (temperature 0's token)."""
    order = jnp.argsort(-rank, axis=-1, stable=True)
    sorted_p = jnp.exp(jnp.take_along_axis(logp, order, axis=-1))
    first = jnp.arange(logp.shape[-1]) == 0
    keep_sorted = ((jnp.cumsum(sorted_p, axis=-1) - sorted_p) < p) | first
    keep = jnp.zeros(logp.shape, bool)
    return jnp.put_along_axis(keep, order, keep_sorted, axis=-1, inplace=False)


def _normalise(z):
    """z - log(sum(exp(z))) over the last axis, for rows whose largest entry is about 0
    (between -log V and 0): the sum lies in [1 / V, V], so it needs no shift."""
    return z - jnp.log(jnp.sum(jnp.exp(z), axis=-1, keepdims=True))


def target(logits, s: Sampler):
    """Log-probabilities [..., V] of the tempered, truncated distribution: temperature,
    then top-k, then top-p; -inf outside the support."""
    x = logits.astype(jnp.float32)
    x = jnp.where(jnp.isnan(x), -jnp.inf, x)
    top = jnp.max(x, axis=-1, keepdims=True)
    d = x - top
    # The largest logit is exactly 0 whatever T; an infinite gap stays -inf even where
    # 1 / T is flushed to 0 (huge T) or overflows (subnormal T), where d / T alone
    # would give 0 * inf or inf - inf.
    z = jnp.where(x == top, 0.0, jnp.where(d == -jnp.inf, -jnp.inf, d / s.temperature))
    if s.top_k is not None and s.top_k < x.shape[-1]:
        z = jnp.where(_keep_top_k(x, s.top_k), z, -jnp.inf)
    logp = _normalise(z)
    if s.top_p is None:
        return logp

    # Traced top-p: 1 keeps the distribution as it is (not renormalised: the same values
    # as no truncation). Unbatched, the sort runs only where top-p truncates; in a batch,
    # only when the plan says some row does.
    def nucleus():
        return jax.lax.cond(s.top_p >= 1, lambda: logp, lambda: _normalise(
            jnp.where(_keep_top_p(logp, z, s.top_p), logp, -jnp.inf)))

    if s.plan is None:
        return nucleus()
    return jax.lax.cond(s.plan == PLANS.index("whole"), lambda: logp, nucleus)


def proposal(logits, s: Sampler, mask_id: int) -> StoredQ:
    """The drafter's Q for each row (MASK excluded), in its storage form."""
    logp = target(logits.at[..., mask_id].set(-jnp.inf), s)
    top, ids = jax.lax.top_k(logp, s.store_size(logits.shape[-1]))
    return StoredQ(_normalise(top), ids.astype(jnp.int32))


def accept_ratio(logp_d, logq_d):
    """Acceptance probability of a draft token, min(1, p(d) / Q(d)), from log p(d) and
    log Q(d): exp(min(0, log p - log Q)); 0 where p(d) = 0."""
    ratio = jnp.exp(jnp.minimum(0.0, logp_d - logq_d))
    return jnp.where(logp_d == -jnp.inf, 0.0, ratio)


def _log1mexp(a):
    """log(1 - exp(a)) for a <= 0, accurate at both ends (Maechler, 2012)."""
    return jnp.where(a > -math.log(2.0), jnp.log(-jnp.expm1(a)), jnp.log1p(-jnp.exp(a)))


def residual(logp_row, logq_row):
    """Correction distribution at the first rejection, [p - Q]_+, as unnormalised
    log-weights: log p + log(1 - Q / p) where p > Q, -inf elsewhere."""
    above = logp_row > logq_row
    gap = jnp.where(above, logq_row - logp_row, -1.0)
    log_r = jnp.where(above, logp_row + _log1mexp(gap), -jnp.inf)
    # A rejection is impossible where p <= Q everywhere; rounding aside, fall back to p.
    return jnp.where(jnp.any(above), log_r, logp_row)


def sample_from(key, logp):
    """One draw from (unnormalised) log-weights; an id in [0, V) whatever they hold."""
    return jax.random.categorical(key, logp).astype(jnp.int32)


def verify(key, logp_rows, draft, draft_len, q: StoredQ):
    """Algorithm 2's acceptance: returns h and the accepted tokens C (padded to len(logp_rows)).

    logp_rows[i] is the target (log-probabilities) at the position of draft[i] (its last
    row has no draft: the bonus position). C = draft[:h] + [correction or bonus].
    """
    W = draft.shape[0]
    k_accept, k_next = jax.random.split(key)
    u = jax.random.uniform(k_accept, (W,))
    logp_d = jnp.take_along_axis(logp_rows[:W], draft[:, None], axis=1)[:, 0]
    ok = (u < accept_ratio(logp_d, q.of(draft))) & (jnp.arange(W) < draft_len)
    h = leading_true(ok)
    V = logp_rows.shape[-1]
    rejected = h < draft_len
    dist = jnp.where(rejected, residual(logp_rows[h], q.dense_row(jnp.minimum(h, W - 1), V)),
                     logp_rows[h])
    nxt = sample_from(k_next, dist)
    k = jnp.arange(W + 1)
    padded = jnp.concatenate([draft, jnp.zeros(1, jnp.int32)])
    return h, jnp.where(k < h, padded, nxt).astype(jnp.int32)
