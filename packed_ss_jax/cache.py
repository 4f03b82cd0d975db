"""The functional KV cache: fixed-size buffers indexed by slot.

Every cache leaf has its slot axis at axis 1 (`[layers, slots, ...]`). A call's
new rows are returned by the forward, and the decoder commits a fixed number of
candidate rows at `cache_len`, then advances `cache_len` by the accepted count
only: rejected rows stay in the buffer, invisible (every row sees slots
`< cache_len` only) and are overwritten by the next commit. The buffer therefore
keeps one block of headroom past the last committed slot, since
`dynamic_update_slice` clamps a start index that would run off the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def commit(cache, kv_rows, rows, start):
    """Writes kv_rows[:, rows] into cache slots start, start+1, ... (a functional update)."""
    rows = jnp.asarray(rows)

    def write(buf, new):
        picked = jnp.take(new, rows, axis=1).astype(buf.dtype)
        return jax.lax.dynamic_update_slice_in_dim(buf, picked, start, axis=1)

    return jax.tree.map(write, cache, kv_rows)
