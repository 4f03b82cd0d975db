"""The fixture checkpoint loaded in bf16 against the float32 reference logits.

Tolerance. Storing a weight in bf16 rounds it by a relative 2^-9 at most; the bf16
forward rounds each matmul input once more by the same amount, and accumulates in
float32 (norms, softmax, RoPE, the residual stream and the logits stay float32). So its
error should be of the order of what the weights' rounding alone costs, which is
measured exactly here: the float32 forward run on the same bf16-rounded weights. The
test allows the bf16 forward twice that error (root mean square over each logits array;
measured: 1.2-1.6x), at most 5% of the largest reference logit anywhere (measured:
2.6%), and the same greedy token wherever the reference's top-2 gap exceeds twice the
largest error. Sums in bf16, or a bf16 residual stream, move the logits further.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import cache as cache_lib
from packed_ss_jax.nemotron import layouts
from packed_ss_jax import model as model_lib


def causal(n):
    return np.tril(np.ones((n, n), bool))


@pytest.fixture(scope="module")
def models(nemotron_dir):
    bf16 = ps.load(nemotron_dir, lora=False, dtype="bfloat16")
    f32 = ps.load(nemotron_dir, lora=False)
    rounded = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), f32.params)
    return bf16, ps.Model(config=f32.config, params=rounded, source="bf16-rounded")


def rms(x):
    return float(np.sqrt(np.mean(np.square(x))))


def check(got, rounded, want, what):
    assert np.isfinite(got).all(), what
    err, floor = got - want, rounded - want
    assert rms(err) <= 2 * rms(floor), f"{what}: rms error {rms(err):.3g} vs {rms(floor):.3g}"
    worst = float(np.max(np.abs(err)))
    assert worst <= 0.05 * np.max(np.abs(want)), f"{what}: max error {worst:.3g}"
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * worst
    assert clear.any(), f"{what}: no row with a clear greedy choice: the check is vacuous"
    np.testing.assert_array_equal(got[clear].argmax(-1), want[clear].argmax(-1), what)


@pytest.mark.parametrize("name", ["ar", "long", "prefix"])
def test_causal_logits(models, nemotron_ref, name):
    tokens = nemotron_ref[f"{name}_tokens"]
    T = len(tokens)
    got, rounded = (ps.logits(m, tokens, np.arange(T), causal(T)) for m in models)
    check(got, rounded, nemotron_ref[f"{name}_logits"], name)


@pytest.mark.parametrize("name", ["block", "packed"])
def test_whole_forward_layouts(models, nemotron_ref, name):
    r = nemotron_ref
    args = (r[f"{name}_full_tokens"], r[f"{name}_full_positions"], r[f"{name}_full_mask"])
    got, rounded = (ps.logits(m, *args)[r[f"{name}_rows"]] for m in models)
    check(got, rounded, r[f"{name}_logits"], name)


@pytest.mark.parametrize("slack", [32, model_lib.LIVE_MIN_POSITIONS], ids=["short", "chunked"])
def test_cached_route(models, nemotron_ref, slack):
    """Prefix through a bf16 cache (committed in its stored form), then the packed rows;
    the long cache is read by the live-length attention where the backend uses it."""
    r = nemotron_ref
    prefix = jnp.asarray(r["prefix_tokens"])
    P = len(prefix)
    outs = []
    for m in models:
        _, kv = m.forward(m.params, *layouts.prefill(prefix)[:3], m.empty_cache(0), 0)
        cache = cache_lib.commit(m.empty_cache(P + slack), kv, jnp.arange(P), 0)
        got, _ = m.forward(m.params, jnp.asarray(r["packed_tokens"]),
                           jnp.asarray(r["packed_positions"]), jnp.asarray(r["packed_mask"][:, P:]),
                           cache, P)
        outs.append(np.asarray(got))
    check(*outs, r["packed_logits"], "packed (cached)")
