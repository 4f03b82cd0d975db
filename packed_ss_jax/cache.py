"""The functional KV cache: fixed-size buffers indexed by position.

The cache is `{"k", "v"}`, each a list with one `[kv_heads, positions, head_dim]` buffer per
layer (why this layout: docs/performance.md). The decoder commits a fixed number of
candidate rows at `cache_len` and advances `cache_len` by the accepted count only:
rejected rows stay in the buffer, invisible (a row sees positions `< cache_len` only), and
the next commit overwrites them. The buffer keeps one block of headroom past the last
committed position, since `dynamic_update_slice` clamps a start index that would run off the
end. On the CPU a bf16 cache is stored as its bits, in `uint16` buffers (`stored` /
`loaded`), so that it is updated in place (docs/performance.md#precision).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

POSITION_AXIS = 1
# Backends whose XLA computes most 16-bit float operations in float32 (see module doc).
WIDENING_BACKENDS = ("cpu",)


def widens_16bit() -> bool:
    """Whether the default backend (the one programs are compiled for) widens 16-bit
    float operations."""
    return jax.default_backend() in WIDENING_BACKENDS


def storage_dtype(dtype):
    """The dtype a cache of `dtype` values is stored in (see module doc)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4 and widens_16bit():
        return jnp.dtype(f"uint{8 * dtype.itemsize}")
    return dtype


def stored(a):
    """Values -> their stored form (the bits of a 16-bit float, anything else as it is)."""
    bits = storage_dtype(a.dtype)
    return a if bits == a.dtype else jax.lax.bitcast_convert_type(a, bits)


def loaded(buf, dtype):
    """A stored buffer read back as `dtype` values (a bitcast; see the module doc)."""
    dtype = jnp.dtype(dtype)
    if buf.dtype == dtype:
        return buf
    if storage_dtype(dtype) != buf.dtype:
        raise TypeError(f"a cache buffer of {buf.dtype} does not hold {dtype} values "
                        f"(those are stored as {storage_dtype(dtype)})")
    return jax.lax.bitcast_convert_type(buf, dtype)


def empty(shape, dtype):
    """A zero buffer holding `dtype` values in their stored form."""
    return jnp.zeros(shape, storage_dtype(dtype))


def commit(cache, kv_rows, rows, start, after=None):
    """Writes the kv rows `rows` (on POSITION_AXIS) into cache positions start, start+1, ...
    (a functional update).

    `kv_rows` are the forward's new rows, in the cache's stored form (see module doc).
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
        if new.dtype != buf.dtype:
            raise TypeError(f"kv rows of {new.dtype} cannot be committed to a cache stored "
                            f"as {buf.dtype}: the forward returns them in the cache's form")
        picked = jnp.take(new, rows, axis=POSITION_AXIS)
        return jax.lax.dynamic_update_slice_in_dim(buf, picked, start, axis=POSITION_AXIS)

    return jax.tree.map(write, cache, kv_rows)
