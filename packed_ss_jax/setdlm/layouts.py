"""Row buffers and masks of SetDLM calls (App. D.2; SPEC "SetDLM layouts").

Every position can appear as a clean token row and as MASK query rows, all with the
same position id; a MASK row predicts the token at its own position. Clean rows see
the cache and earlier clean rows in their feeding order; a MASK row sees the cache,
the clean rows its conditional is on, and itself, never another MASK row.

Shapes are static: a window of W ranks is always laid out in full, and ranks >= u
(and an absent N) are padding rows that see only themselves and that no row sees.
Masks are data built from the window, since the order and the drafts change the
pattern from call to call. Region names follow the paper: N (the correction not yet
fed), O (the previous draft, rank order), M (verifier queries), R (draft queries). Each
layout takes the pending N as `pend_tok` (its token), `pend_out` (its output index) and
`pend_n` (1 when there is one, else 0: its row is then padding).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..calls import Call
from .state import Window


def _i32(a):
    return jnp.asarray(a, jnp.int32)


def _earlier_drafts(w: Window):
    """K[r, s]: rank s < r holds a draft (the K_r of App. D.2)."""
    r = jnp.arange(w.out.shape[0])
    return w.drafted[None, :] & (r[None, :] < r[:, None])


def _call(tokens, positions, mask):
    return Call(_i32(tokens), _i32(positions), mask, jnp.zeros(tokens.shape[0], bool))


def _n_row(width: int):
    return jnp.zeros((1, width), bool).at[0, 0].set(True)


def packed(n, pend_tok, pend_out, pend_n, w: Window, drafts, mask_id: int) -> Call:
    """Packed-SS `[N | O | M | R]`, 1 + 3W rows (pend_n + 3u used):
    O_r <- O_{K_r} + O_r, M_r <- O_{K_r} + M_r, R_r <- R_r; O, M, R also see N."""
    W = w.out.shape[0]
    K, I, Z = _earlier_drafts(w), jnp.eye(W, dtype=bool), jnp.zeros((W, W), bool)
    sees_n = (w.active & (pend_n > 0))[:, None]
    mask = jnp.concatenate([
        _n_row(1 + 3 * W),
        jnp.concatenate([sees_n, K | I, Z, Z], axis=1),
        jnp.concatenate([sees_n, K, I, Z], axis=1),
        jnp.concatenate([sees_n, Z, Z, I], axis=1),
    ])
    masks = jnp.full(W, mask_id, jnp.int32)
    tokens = jnp.concatenate([jnp.where(pend_n > 0, pend_tok, mask_id)[None],
                              jnp.where(w.drafted, drafts, mask_id), masks, masks])
    pos = n + w.out
    positions = jnp.concatenate([(n + jnp.maximum(pend_out, 0))[None], pos, pos, pos])
    return _call(tokens, positions, mask)


def quadratic(n, pend_tok, pend_out, pend_n, w: Window, drafts, mask_id: int) -> Call:
    """Quadratic-SS `[N | O | M | branch_0 .. branch_{W-1}]`, 1 + 2W + W^2 rows
    (pend_n + 2u + u^2 used). Branch b is the outcome "b drafts accepted": its W queries,
    one per rank, see N, the drafted O_s with s < b (what M_b sees) and themselves;
    branch 0 is Packed-SS's R."""
    W = w.out.shape[0]
    K, I, Z = _earlier_drafts(w), jnp.eye(W, dtype=bool), jnp.zeros((W, W), bool)
    sees_n = (w.active & (pend_n > 0))[:, None]
    branch_o = jnp.broadcast_to(K[:, None, :], (W, W, W)).reshape(W * W, W)  # [b, k] -> s
    mask = jnp.concatenate([
        _n_row(1 + 2 * W + W * W),
        jnp.concatenate([sees_n, K | I, Z, jnp.zeros((W, W * W), bool)], axis=1),
        jnp.concatenate([sees_n, K, I, jnp.zeros((W, W * W), bool)], axis=1),
        jnp.concatenate([jnp.tile(sees_n, (W, 1)), branch_o, jnp.zeros((W * W, W), bool),
                         jnp.eye(W * W, dtype=bool)], axis=1),
    ])
    tokens = jnp.concatenate([jnp.where(pend_n > 0, pend_tok, mask_id)[None],
                              jnp.where(w.drafted, drafts, mask_id),
                              jnp.full(W + W * W, mask_id, jnp.int32)])
    pos = n + w.out
    positions = jnp.concatenate([(n + jnp.maximum(pend_out, 0))[None], pos, pos, jnp.tile(pos, W)])
    return _call(tokens, positions, mask)


def branch_outcomes(w: Window, branches: int):
    """The acceptance outcomes given a branch besides Packed-SS's zero-accepted R: every
    draft of the window accepted (h = kappa, the leading drafted ranks), then one fewer,
    and so on (branches - 1 of them; below 0: unused). An outcome h leaves ranks to draft
    only if h + 1 < u (h accepted and the correction), so they start at most at u - 2."""
    return (jnp.minimum(w.kappa, w.u - 2) - jnp.arange(branches - 1)).astype(jnp.int32)


def branched(n, pend_tok, pend_out, pend_n, w: Window, drafts, mask_id: int,
             branches: int) -> Call:
    """Branched-SS: Packed-SS's `[N | O | M | R]`, then for each outcome h of
    `branch_outcomes` (h drafts accepted) W queries, one per rank, seeing N, the drafted
    O_s with s < h (what M_h sees) and themselves: Quadratic-SS's branch h. 1 + 3W +
    (branches - 1)W rows; branches = 1 is Packed-SS's call."""
    base = packed(n, pend_tok, pend_out, pend_n, w, drafts, mask_id)
    W, G = w.out.shape[0], branches - 1
    if G == 0:
        return base
    h = jnp.maximum(branch_outcomes(w, branches), 0)            # unused groups: anywhere
    sees_o = jnp.repeat(_earlier_drafts(w)[h], W, axis=0)      # [G*W, W]: M_h's view of O
    sees_n = jnp.tile((w.active & (pend_n > 0))[:, None], (G, 1))
    rows = jnp.concatenate([sees_n, sees_o, jnp.zeros((G * W, 2 * W), bool),
                            jnp.eye(G * W, dtype=bool)], axis=1)
    mask = jnp.concatenate([jnp.pad(base.mask, ((0, 0), (0, G * W))), rows])
    tokens = jnp.concatenate([base.tokens, jnp.full(G * W, mask_id, jnp.int32)])
    positions = jnp.concatenate([base.positions, jnp.tile(n + w.out, G)])
    return _call(tokens, positions, mask)


def draft(n, pend_tok, pend_out, pend_n, w: Window, mask_id: int) -> Call:
    """Linear-SS drafting call `[N | R]`, 1 + W rows (pend_n + u used)."""
    W = w.out.shape[0]
    sees_n = (w.active & (pend_n > 0))[:, None]
    mask = jnp.concatenate([_n_row(1 + W),
                            jnp.concatenate([sees_n, jnp.eye(W, dtype=bool)], axis=1)])
    tokens = jnp.concatenate([jnp.where(pend_n > 0, pend_tok, mask_id)[None],
                              jnp.full(W, mask_id, jnp.int32)])
    positions = jnp.concatenate([(n + jnp.maximum(pend_out, 0))[None], n + w.out])
    return _call(tokens, positions, mask)


def verify(n, w: Window, drafts, mask_id: int) -> Call:
    """Linear-SS verification call `[O | M]`, 2W rows (2u used); N is already cached."""
    W = w.out.shape[0]
    K, I = _earlier_drafts(w), jnp.eye(W, dtype=bool)
    mask = jnp.concatenate([jnp.concatenate([K | I, jnp.zeros((W, W), bool)], axis=1),
                            jnp.concatenate([K, I], axis=1)])
    tokens = jnp.concatenate([jnp.where(w.drafted, drafts, mask_id),
                              jnp.full(W, mask_id, jnp.int32)])
    pos = n + w.out
    return _call(tokens, jnp.concatenate([pos, pos]), mask)


def native(n, c_tok, c_out, c_n, w: Window, mask_id: int) -> Call:
    """Native decoder step `[C | Q]`, 2W rows (pend_n + u used): the tokens committed last
    step as clean rows, causal in feeding order, then the window's MASK queries, each
    seeing every new clean row and itself (the release's inference step)."""
    W = w.out.shape[0]
    live = jnp.arange(c_tok.shape[0]) < c_n
    clean = jnp.tril(jnp.ones((W, W), bool)) & live[None, :] & live[:, None] | jnp.eye(W, dtype=bool)
    sees_c = w.active[:, None] & live[None, :]
    mask = jnp.concatenate([jnp.concatenate([clean, jnp.zeros((W, W), bool)], axis=1),
                            jnp.concatenate([sees_c, jnp.eye(W, dtype=bool)], axis=1)])
    tokens = jnp.concatenate([jnp.where(live, c_tok, mask_id), jnp.full(W, mask_id, jnp.int32)])
    positions = jnp.concatenate([n + jnp.maximum(c_out, 0), n + w.out])
    return _call(tokens, positions, mask)


def serial(n, pend_tok, pend_out, pend_n, w: Window, mask_id: int) -> Call:
    """One-token-at-a-time reference `[N | M]`: the last token fed as a clean row and
    one MASK query at the left-most unresolved position."""
    mask = jnp.array([[True, False], [False, True]]).at[1, 0].set(pend_n > 0)
    tokens = jnp.stack([jnp.where(pend_n > 0, pend_tok, mask_id), jnp.int32(mask_id)])
    positions = jnp.stack([n + jnp.maximum(pend_out, 0), n + w.out[0]])
    return _call(tokens, positions, mask)


def score(tokens, mask_id: int) -> tuple[Call, np.ndarray]:
    """The left-to-right forward over a whole sequence [T], to score it (the serial
    schedule's conditionals, all in one call): T clean rows, each seeing the earlier
    ones, then a MASK query row per position seeing the clean rows before it and itself;
    the distribution of token i comes from query row T + i (`rows[i]`)."""
    T = tokens.shape[0]
    earlier = np.tril(np.ones((T, T), bool))
    mask = np.block([[earlier, np.zeros((T, T), bool)],
                     [np.tril(np.ones((T, T), bool), -1), np.eye(T, dtype=bool)]])
    positions = jnp.tile(jnp.arange(T, dtype=jnp.int32), 2)
    call = _call(jnp.concatenate([_i32(tokens), jnp.full(T, mask_id, jnp.int32)]), positions,
                 jnp.asarray(mask))
    return call, T + np.arange(T)
