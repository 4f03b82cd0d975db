"""The call contract between a schedule and the model, shared by every family.

A call is a row buffer: tokens, positions, a mask (row attends to row, among the new
rows; every row also sees the cache positions the family marks visible) and which rows are
drafting rows (the draft-only adapter's switch). `run_call` puts one through the
model's forward: one NFE.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np


class Call(NamedTuple):
    tokens: jnp.ndarray      # [T] int32
    positions: jnp.ndarray   # [T] int32
    mask: jnp.ndarray        # [T, T] bool, row attends to column
    draft_rows: jnp.ndarray  # [T] bool


def causal(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n), bool))


def i32(a):
    return jnp.asarray(a, jnp.int32)


def prefill(prompt) -> Call:
    """Causal pass over the (padded) prompt at positions 0..len-1."""
    P = prompt.shape[0]
    return Call(i32(prompt), i32(np.arange(P)), jnp.asarray(causal(P)), jnp.zeros(P, bool))


def run_call(m, params, call: Call, cache, visible, out_rows=None):
    """One NFE: `call` through the model's forward over the cache (`visible`: the number
    of committed positions, or a [S] bool mask of the positions the rows may see)."""
    return m.forward(params, call.tokens, call.positions, call.mask, cache, visible,
                     call.draft_rows, out_rows)
