"""Live-length attention (the cache read CHUNK slots at a time) against the full read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from packed_ss_jax import cache as cache_lib
from packed_ss_jax.nemotron import layouts
from packed_ss_jax import model as model_lib
from tiny import tiny_model

# read in chunks, the last one overlapping the one before
POSITIONS = model_lib.LIVE_MIN_POSITIONS + 40
C = model_lib.chunk_size(POSITIONS)
ROWS = 5


_compiled = {}


def forward(m, cache, seen, live_attention: bool):
    """Logits of one call after the cache slots `seen`, through the chosen attention
    (picked while tracing, so each variant is compiled on its own, once per dtype)."""
    key = (m.config, live_attention)
    if key not in _compiled:
        saved = model_lib.LIVE_ATTENTION
        model_lib.LIVE_ATTENTION = (jax.default_backend(),) if live_attention else ()
        try:
            call = layouts.verify(jnp.int32(3), jnp.arange(ROWS - 1, dtype=jnp.int32) % 7,
                                  jnp.int32(POSITIONS))
            fn = jax.jit(lambda p, cache, seen: m.forward(
                p, call.tokens, call.positions, call.mask, cache, seen)[0])
            _compiled[key] = fn.lower(m.params, cache, seen).compile()
        finally:
            model_lib.LIVE_ATTENTION = saved
    return np.asarray(_compiled[key](m.params, cache, seen))


def filled_cache(m, fill_from: int, fill):
    """A cache of random keys/values, `fill` from slot `fill_from` on."""
    c = m.config
    dt = model_lib.param_dtype(c)
    key = jax.random.PRNGKey(1)
    out = {"k": [], "v": []}
    for name in ("k", "v"):
        for _ in range(c.num_layers):
            key, sub = jax.random.split(key)
            x = jax.random.normal(sub, (c.num_kv_heads, POSITIONS, c.head_dim), jnp.float32)
            x = jnp.where(jnp.arange(POSITIONS)[None, :, None] < fill_from, x, fill).astype(dt)
            out[name].append(cache_lib.stored(x))
    return out


@pytest.mark.parametrize("live", [0, 1, C, C + 1, POSITIONS - 1, POSITIONS])
def test_live_read_equals_full_read(live):
    m = tiny_model(0)
    cache = filled_cache(m, POSITIONS, 0.0)
    seen = jnp.arange(POSITIONS) < live
    full, part = (forward(m, cache, seen, flag) for flag in (False, True))
    np.testing.assert_allclose(part, full, atol=1e-5 * float(np.abs(full).max()), rtol=0)


def test_marked_slots_with_holes():
    """SetDLM passes the visible slots as a mask (entries past a stop are masked out)."""
    m = tiny_model(0)
    cache = filled_cache(m, POSITIONS, 0.0)
    rng = np.random.default_rng(0)
    seen = jnp.asarray((rng.random(POSITIONS) < 0.5) & (np.arange(POSITIONS) < POSITIONS - 30))
    full, part = (forward(m, cache, seen, flag) for flag in (False, True))
    np.testing.assert_allclose(part, full, atol=1e-5 * float(np.abs(full).max()), rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunks_past_the_live_length_are_never_read(dtype):
    """NaNs past the last live chunk poison a full read (0 * NaN), not a live one."""
    m = tiny_model(0, dtype=dtype)
    live = C // 2
    cache = filled_cache(m, C, jnp.nan)
    seen = jnp.arange(POSITIONS) < live
    assert not np.isfinite(forward(m, cache, seen, False)).all()  # the full read sees them
    reference = forward(m, filled_cache(m, C, 0.0), seen, True)
    np.testing.assert_array_equal(forward(m, cache, seen, True), reference)


def test_decode_over_live_chunks_matches_ar():
    """End to end: Packed-SS over a cache read in chunks gives AR's greedy output (AR
    decoded over a short cache, read whole)."""
    import packed_ss_jax as ps

    m = tiny_model(0)
    prompt = [3, 4, 5, 6, 2]
    live = ps.decode(m, prompt, schedule="packed", block_size=4, max_new_tokens=40,
                     eos_id=None, cache_size=model_lib.LIVE_MIN_POSITIONS)
    whole = ps.decode(m, prompt, schedule="ar", max_new_tokens=40, eos_id=None, cache_size=64)
    assert list(live.tokens) == list(whole.tokens)
