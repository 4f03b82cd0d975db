"""Row buffers and attention masks of every call a schedule makes (SPEC, App. D.1, E.2).

A layout is the tokens, positions, mask (row attends to row, among the new rows;
every row also sees the committed cache) and which rows are drafting rows (the
draft-only LoRA switch). Masks of regular calls are static NumPy constants: only
the tokens and the base position change from call to call.

Notation: `x` is the last verified token, at position `c` = cache length, not yet
cached; `draft` holds `B - 1` positions, MASK-padded.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from ..calls import Call, causal, i32 as _i32
from ..calls import prefill  # noqa: F401  (the prompt call is this family's too)


@functools.lru_cache(maxsize=None)
def packed_mask(B: int) -> np.ndarray:
    """[[T_B, 0], [0, J_B]]: causal verify half, bidirectional draft half, no crossing."""
    m = np.zeros((2 * B, 2 * B), bool)
    m[:B, :B] = causal(B)
    m[B:, B:] = True
    return m


@functools.lru_cache(maxsize=None)
def quadratic_mask(B: int) -> np.ndarray:
    """B groups `[d_i, MASK^B]`: d rows form a causal chain; group i's masks see d_0..d_i
    and their whole group."""
    G = B + 1
    m = np.zeros((B * G, B * G), bool)
    heads = np.arange(B) * G
    for i in range(B):
        m[heads[i], heads[: i + 1]] = True          # d_i verifies: sees d_0..d_i
        rows = heads[i] + np.arange(1, G)
        m[np.ix_(rows, heads[:i])] = True           # masks see the earlier chain
        m[np.ix_(rows, heads[i] + np.arange(G))] = True  # and their own group
    return m


@functools.lru_cache(maxsize=None)
def _branched_static(B: int, groups: int) -> np.ndarray:
    """The static part of Branched-SS's mask: Packed-SS's, and each group of B MASK rows
    seeing itself."""
    G = 2 * B + B * groups
    m = np.zeros((G, G), bool)
    m[: 2 * B, : 2 * B] = packed_mask(B)
    for j in range(groups):
        rows = 2 * B + j * B + np.arange(B)
        m[np.ix_(rows, rows)] = True
    return m


def branch_outcomes(draft_len, branches: int):
    """The acceptance outcomes given a branch besides the zero-accepted one: the whole
    draft accepted, then one fewer, and so on (branches - 1 of them; below 0: unused)."""
    return (draft_len - jnp.arange(branches - 1)).astype(jnp.int32)


def single(x, c) -> Call:
    """AR: one causal row `[x]` at position c."""
    return Call(_i32(x)[None], _i32(c)[None], jnp.ones((1, 1), bool), jnp.zeros(1, bool))


def verify(x, draft, c) -> Call:
    """Linear-SS verify: `[x, d_1..d_{B-1}]`, causal, verifier rows."""
    B = draft.shape[0] + 1
    return Call(jnp.concatenate([_i32(x)[None], draft]), c + _i32(np.arange(B)),
                jnp.asarray(causal(B)), jnp.zeros(B, bool))


def draft_block(x, c, B: int, mask_id: int) -> Call:
    """Linear-SS draft: `[x, MASK^(B-1)]`, bidirectional, drafting rows."""
    tokens = jnp.concatenate([_i32(x)[None], jnp.full(B - 1, mask_id, jnp.int32)])
    return Call(tokens, c + _i32(np.arange(B)), jnp.ones((B, B), bool), jnp.ones(B, bool))


def packed(x, draft, c, mask_id: int) -> Call:
    """Packed-SS: `[x, D̄ | x, MASK^(B-1)]`, both halves at positions c..c+B-1."""
    B = draft.shape[0] + 1
    x = _i32(x)[None]
    tokens = jnp.concatenate([x, draft, x, jnp.full(B - 1, mask_id, jnp.int32)])
    pos = np.arange(B)
    return Call(tokens, c + _i32(np.concatenate([pos, pos])), jnp.asarray(packed_mask(B)),
                jnp.asarray(np.arange(2 * B) >= B))


def branched(x, draft, draft_len, c, mask_id: int, branches: int) -> Call:
    """Branched-SS: Packed-SS's `[x, D̄ | x, MASK^(B-1)]`, then for each outcome h of
    `branch_outcomes` (h of the draft's tokens accepted) the group `MASK^B` at positions
    c+h+1 .. c+h+B seeing x, d_1..d_h: Quadratic-SS's branch h without its head (it reads
    d_h's row in the verify half). The outcomes follow the draft's length, so the rows'
    view of the verify half is traced; the rest of the mask is static."""
    B = draft.shape[0] + 1
    base = packed(x, draft, c, mask_id)
    groups = branches - 1
    h = jnp.maximum(branch_outcomes(draft_len, branches), 0)   # unused groups: anywhere
    pos = jnp.concatenate([base.positions, (c + h + 1)[:, None] + jnp.arange(B)[None, :]
                           .astype(jnp.int32)], axis=None)
    tokens = jnp.concatenate([base.tokens, jnp.full(groups * B, mask_id, jnp.int32)])
    sees = jnp.repeat(jnp.arange(B)[None, :] <= h[:, None], B, axis=0)   # [groups*B, B]
    mask = jnp.asarray(_branched_static(B, groups)).at[2 * B:, :B].set(sees)
    return Call(tokens, pos.astype(jnp.int32), mask,
                jnp.asarray(np.arange(2 * B + groups * B) >= B))


def quadratic(x, draft, c, mask_id: int) -> Call:
    """Quadratic-SS: group i = `[d_i, MASK^B]` at positions c+i .. c+i+B (d_0 = x)."""
    B = draft.shape[0] + 1
    G = B + 1
    d = jnp.concatenate([_i32(x)[None], draft])
    tokens = jnp.full((B, G), mask_id, jnp.int32).at[:, 0].set(d).reshape(-1)
    pos = (np.arange(B)[:, None] + np.arange(G)[None, :]).reshape(-1)
    draft_rows = (np.arange(B * G) % G) != 0
    return Call(tokens, c + _i32(pos), jnp.asarray(quadratic_mask(B)), jnp.asarray(draft_rows))


def first_call(prompt, n, B: int, mask_id: int) -> Call:
    """Packed/Quadratic first call (App. E.2): `[prompt (causal) | MASK^B]`.

    The prompt is padded to its bucket; its real length `n` is traced, so the mask
    rows see columns `< n` only (padding rows are never seen by anyone). The masks
    sit at positions n..n+B-1 and see each other.
    """
    P = prompt.shape[0]
    tokens = jnp.concatenate([_i32(prompt), jnp.full(B, mask_id, jnp.int32)])
    positions = jnp.concatenate([_i32(np.arange(P)), n + _i32(np.arange(B))])
    top = jnp.concatenate([jnp.asarray(causal(P)), jnp.zeros((P, B), bool)], axis=1)
    sees_prompt = jnp.broadcast_to(jnp.arange(P)[None, :] < n, (B, P))
    bottom = jnp.concatenate([sees_prompt, jnp.ones((B, B), bool)], axis=1)
    return Call(tokens, positions, jnp.concatenate([top, bottom]), jnp.asarray(np.arange(P + B) >= P))


def score(tokens) -> tuple[Call, np.ndarray]:
    """The AR forward over a whole sequence [T], to score it: causal verifier rows; the
    distribution of token i comes from row i - 1 (`rows[i]`; row 0 predicts nothing)."""
    T = tokens.shape[0]
    call = Call(_i32(tokens), jnp.arange(T, dtype=jnp.int32), jnp.asarray(causal(T)),
                jnp.zeros(T, bool))
    return call, np.maximum(np.arange(T) - 1, 0)
