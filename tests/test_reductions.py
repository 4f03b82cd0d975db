import jax
import jax.numpy as jnp
import numpy as np

from packed_ss_jax.reductions import first_argmax, leading_true


def test_first_argmax_matches_argmax_with_ties():
    x = jax.random.randint(jax.random.PRNGKey(0), (500, 37), 0, 4).astype(jnp.float32)  # many ties
    x = x.at[:3].set(-jnp.inf).at[3, :].set(jnp.inf)  # whole rows of -inf / +inf
    got = np.asarray(first_argmax(x))
    np.testing.assert_array_equal(got, np.argmax(np.asarray(x), axis=-1))
    assert got.dtype == np.int32


def test_leading_true_matches_cumprod():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7):
        for _ in range(50):
            ok = rng.random(n) < 0.7
            assert int(leading_true(jnp.asarray(ok))) == int(np.sum(np.cumprod(ok)))
    assert int(leading_true(jnp.ones(5, bool))) == 5
    assert int(leading_true(jnp.zeros(5, bool))) == 0
