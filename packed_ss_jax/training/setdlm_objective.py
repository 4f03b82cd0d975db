"""The SetDLM objective at small scale: the two-stream (duplicate-mask) construction.

One training row holds a clean window `x0` three times, in a feeding order `sigma`:

    [ x0[sigma] | MASK^L | MASK^L ]      positions [ sigma | sigma | sigma ]

The clean stream is causal in feeding order, as the decoder fills its cache. A query row
of rank k sits at sigma(k), predicts the token there (no shift) and sees the clean rows
of rank < cut[k] and itself: cut[k] = k in the verifier stream (the any-order AR
conditional the M rows compute), k - g_k with a drawn gap g_k >= 1 in the drafter stream
(what a draft query made one call ahead sees). The loss weighs both streams' CE and the
clean stream's next-token CE; the why and the orders: docs/setdlm.md#training-objective.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import model as model_lib
from ..config import ModelConfig
from ..setdlm.state import MASK_LOGIT

STREAMS = 2  # query streams: verifier, drafter


@dataclasses.dataclass(frozen=True)
class OrderConfig:
    p_ltr: float = 0.7                       # rows fed in textual order
    spans: tuple[int, ...] = (4, 8, 16)      # lead bound D of a shuffled row
    span_probs: tuple[float, ...] = (0.3, 0.4, 0.3)
    max_gap: int = 15                        # drafter gaps 1..max_gap (window W <= 16)
    gap_power: float = 1.0                   # P(g) ~ g^-gap_power: small gaps are checked most

    def __post_init__(self):
        if not 0 <= self.p_ltr <= 1:
            raise ValueError(f"OrderConfig.p_ltr must be in [0, 1], got {self.p_ltr}")
        if len(self.spans) != len(self.span_probs) or min(self.spans) < 1:
            raise ValueError(f"OrderConfig.spans {self.spans} needs one probability each "
                             f"(span_probs {self.span_probs}) and spans >= 1")
        if self.max_gap < 1:
            raise ValueError(f"OrderConfig.max_gap must be >= 1, got {self.max_gap}")

    def gap_probs(self) -> np.ndarray:
        w = np.arange(1, self.max_gap + 1, dtype=np.float64) ** -self.gap_power
        return w / w.sum()


def feed_order(rng: np.random.Generator, L: int, oc: OrderConfig = OrderConfig()) -> np.ndarray:
    """sigma [L]: the position fed at each rank (textual, or a local shuffle)."""
    if rng.random() < oc.p_ltr:
        return np.arange(L)
    D = int(rng.choice(oc.spans, p=np.asarray(oc.span_probs) / np.sum(oc.span_probs)))
    return np.argsort(np.arange(L) + D * rng.random(L), kind="stable")


def draft_cuts(rng: np.random.Generator, L: int, oc: OrderConfig = OrderConfig()) -> np.ndarray:
    """cut [L]: the drafter query of rank k sees the clean ranks < cut[k] = max(k - g, 0)."""
    g = rng.choice(np.arange(1, oc.max_gap + 1), size=L, p=oc.gap_probs())
    return np.maximum(np.arange(L) - g, 0)


def next_targets(x0: np.ndarray, sigma: np.ndarray):
    """For the clean row of rank i (position sigma(i)): x0[sigma(i) + 1] and whether that
    position is fed later (weight 1) or is past the window / already seen (weight 0)."""
    L = x0.shape[0]
    rank = np.empty(L, np.int64)
    rank[sigma] = np.arange(L)
    nxt = sigma + 1
    ok = nxt < L
    ok[ok] = rank[nxt[ok]] > np.arange(L)[ok]
    return np.where(ok, x0[np.minimum(nxt, L - 1)], 0).astype(np.int32), ok.astype(np.float32)


def two_stream_batch(rng: np.random.Generator, clean: np.ndarray, mask_id: int,
                     oc: OrderConfig = OrderConfig()):
    """clean [N, L] -> (tokens [N, 3L], positions [N, 3L], cuts [N, 2, L], targets [N, L],
    next_tok [N, L], next_w [N, L]), everything in feeding (rank) order."""
    N, L = clean.shape
    tokens = np.full((N, 3 * L), mask_id, np.int32)
    positions = np.zeros((N, 3 * L), np.int32)
    cuts = np.zeros((N, STREAMS, L), np.int32)
    targets = np.zeros((N, L), np.int32)
    next_tok = np.zeros((N, L), np.int32)
    next_w = np.zeros((N, L), np.float32)
    for n in range(N):
        sigma = feed_order(rng, L, oc)
        tokens[n, :L] = clean[n, sigma]
        positions[n] = np.tile(sigma, 3)
        cuts[n, 0] = np.arange(L)
        cuts[n, 1] = draft_cuts(rng, L, oc)
        targets[n] = clean[n, sigma]
        next_tok[n], next_w[n] = next_targets(clean[n], sigma)
    return tokens, positions, cuts, targets, next_tok, next_w


def attention_mask(cuts):
    """cuts [Q, L] -> [(1+Q)L, (1+Q)L] bool: clean rows causal in rank; query row k of
    stream q sees the clean ranks < cuts[q, k] and itself."""
    Q, L = cuts.shape
    k = jnp.arange(L)
    rows = [jnp.concatenate([k[None, :] <= k[:, None], jnp.zeros((L, Q * L), bool)], axis=1)]
    for q in range(Q):
        own = jnp.zeros((L, Q * L), bool).at[:, q * L:(q + 1) * L].set(jnp.eye(L, dtype=bool))
        rows.append(jnp.concatenate([k[None, :] < cuts[q][:, None], own], axis=1))
    return jnp.concatenate(rows, axis=0)


def losses(c: ModelConfig, params, tokens, positions, cuts, targets, next_tok, next_w):
    """(ar, diff, next): mean CE of the verifier stream, of the drafter stream, and the
    weighted mean next-token CE of the clean stream."""
    N, T = tokens.shape
    L = T // (1 + STREAMS)
    cache = model_lib.empty_cache(c, 0)

    def one(t, p, cut):
        return model_lib.forward(c, params, t, p, attention_mask(cut), cache, jnp.int32(0))[0]

    # As the release (and the decoder) do, the MASK logit is removed before the softmax.
    logits = jax.vmap(one)(tokens, positions, cuts).at[..., c.mask_token_id].set(MASK_LOGIT)
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = lambda lp, y: -jnp.take_along_axis(lp, y[..., None], axis=-1)[..., 0]  # noqa: E731
    ar = jnp.mean(ce(logp[:, L:2 * L], targets))
    diff = jnp.mean(ce(logp[:, 2 * L:], targets))
    nxt = jnp.sum(ce(logp[:, :L], next_tok) * next_w) / jnp.maximum(jnp.sum(next_w), 1.0)
    return ar, diff, nxt
