"""The functional KV cache: fixed-size buffers indexed by slot.

The cache is `{"k", "v"}`, each a list with one `[kv_heads, slots, head_dim]`
buffer per layer. One buffer per layer, because a layer's slice of a stacked
buffer is materialised (copied) before XLA's dot reads it; slots behind the kv
heads (`SLOT_AXIS`), because the heads are the batch axis of the attention
products and XLA would otherwise transpose (copy) the buffer in every call.

A call's new rows are returned by the forward in the same layout, and the
decoder commits a fixed number of candidate rows at `cache_len`, then advances
`cache_len` by the accepted count only: rejected rows stay in the buffer,
invisible (every row sees slots `< cache_len` only) and are overwritten by the
next commit. The buffer therefore keeps one block of headroom past the last
committed slot, since `dynamic_update_slice` clamps a start index that would
run off the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SLOT_AXIS = 1


def commit(cache, kv_rows, rows, start, after=None):
    """Writes the kv rows `rows` (on SLOT_AXIS) into cache slots start, start+1, ...
    (a functional update).

    `after`: non-negative ints computed from the call's logits (the accepted token ids).
    The write index is made to depend on them (it adds min(after, 0), which is 0), so the
    write waits for every read of the old buffer in this step and XLA does it in place.
    Otherwise the new rows' keys/values are ready before the last layers have read the
    cache, and XLA copies every buffer twice per step to keep the old values readable.
    """
    if after is not None:
        start = start + jnp.minimum(jnp.min(after), 0).astype(jnp.asarray(start).dtype)
    rows = jnp.asarray(rows)

    def write(buf, new):
        picked = jnp.take(new, rows, axis=SLOT_AXIS).astype(buf.dtype)
        return jax.lax.dynamic_update_slice_in_dim(buf, picked, start, axis=SLOT_AXIS)

    return jax.tree.map(write, cache, kv_rows)

