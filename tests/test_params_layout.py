"""The stored (stacked, scanned) and decoding (per-layer, unrolled) params layouts
hold the same weights and compute the same forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from packed_ss_jax import Model, cache as cache_lib
from packed_ss_jax.nemotron import layouts
from packed_ss_jax import model as model_lib
from tiny import _params, tiny_config


def test_unstack_stack_round_trip_and_model_layout():
    c = tiny_config(layers=3)
    stored = _params(c, jax.random.PRNGKey(0))
    decoding = model_lib.unstack_layers(stored)
    assert sorted(k for k in decoding if k.startswith("layer_")) == ["layer_0", "layer_1", "layer_2"]
    np.testing.assert_array_equal(decoding["layer_2"]["mlp"]["up_proj"],
                                  stored["layers"]["mlp"]["up_proj"][2])
    back = model_lib.stack_layers(decoding)
    assert jax.tree.structure(back) == jax.tree.structure(stored)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(stored)):
        np.testing.assert_array_equal(a, b)
    m = Model(config=c, params=stored)
    assert "layers" not in m.params and "layer_0" in m.params
    assert model_lib.unstack_layers(m.params) is m.params  # already in the decoding layout
    for a, b in zip(jax.tree.leaves(m.stored_params), jax.tree.leaves(stored)):
        np.testing.assert_array_equal(a, b)


def test_both_layouts_compute_the_same_cached_forward():
    c = tiny_config(layers=3)
    stored = _params(c, jax.random.PRNGKey(1))
    prompt = jnp.arange(3, 9, dtype=jnp.int32)
    call = layouts.prefill(prompt)
    _, kv = model_lib.forward(c, stored, *call[:3], model_lib.empty_cache(c, 0), 0)
    cache = cache_lib.commit(model_lib.empty_cache(c, 16), kv, jnp.arange(6), 0)
    x, draft = jnp.int32(4), jnp.array([5, 6, 7], jnp.int32)
    call = layouts.packed(x, draft, jnp.int32(6), c.mask_token_id)
    forward = jax.jit(functools.partial(model_lib.forward, c))
    outs = [forward(p, *call[:3], cache, 6, call.draft_rows)
            for p in (stored, model_lib.unstack_layers(stored))]
    (l1, kv1), (l2, kv2) = outs
    np.testing.assert_allclose(l1, l2, atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(kv1), jax.tree.leaves(kv2)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    # The visibility vector form of cache_len is the same prefix.
    l3, _ = forward(stored, *call[:3], cache, jnp.arange(16) < 6, call.draft_rows)
    np.testing.assert_allclose(l1, l3, atol=1e-6)
