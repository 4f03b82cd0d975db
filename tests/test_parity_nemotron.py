"""Converted fixture checkpoint reproduces every reference logits array (atol 1e-4, float32)."""

import jax.numpy as jnp
import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import cache as cache_lib
from packed_ss_jax import rope
from packed_ss_jax.nemotron import layouts

ATOL = 1e-4


def causal(n):
    return np.tril(np.ones((n, n), bool))


@pytest.fixture(scope="module", params=["hf", "converted"])
def models(request, nemotron_dir, tmp_path_factory):
    """The same checkpoint read straight from the HF directory and through the converter."""
    if request.param == "hf":
        return ps.load(nemotron_dir, lora=False), ps.load(nemotron_dir, lora=True)
    out = tmp_path_factory.mktemp("conv")
    base = ps.convert(nemotron_dir, out / "base", dtype="float32", lora=False, progress=False)
    lora = ps.convert(nemotron_dir, out / "lora", dtype="float32", lora=True, progress=False)
    return ps.load(base), ps.load(lora)


def check(got, want, what):
    err = float(np.max(np.abs(got - want)))
    assert err < ATOL, f"{what}: max abs error {err:.3g}"
    return err


def test_rope_tables(nemotron, nemotron_ref):
    c = nemotron.config
    np.testing.assert_allclose(rope.inv_freq(c), nemotron_ref["rope_inv_freq"], rtol=1e-6)
    assert rope.attention_factor(c) == pytest.approx(float(nemotron_ref["rope_attention_scaling"]))
    positions = jnp.arange(len(nemotron_ref["long_tokens"]))
    np.testing.assert_allclose(rope.query_scale(c, positions), nemotron_ref["long_llama4_q_scale"],
                               rtol=1e-6)


@pytest.mark.parametrize("name", ["ar", "long", "prefix"])
def test_causal_logits(models, nemotron_ref, name):
    base, _ = models
    tokens = nemotron_ref[f"{name}_tokens"]
    T = len(tokens)
    check(ps.logits(base, tokens, np.arange(T), causal(T)), nemotron_ref[f"{name}_logits"], name)


@pytest.mark.parametrize("name", ["block", "packed"])
def test_whole_forward_layouts(models, nemotron_ref, name):
    base, _ = models
    r = nemotron_ref
    got = ps.logits(base, r[f"{name}_full_tokens"], r[f"{name}_full_positions"], r[f"{name}_full_mask"])
    check(got[r[f"{name}_rows"]], r[f"{name}_logits"], name)


@pytest.mark.parametrize("name", ["block", "packed"])
def test_cached_route(models, nemotron_ref, name):
    """Prefix through the cache, then the query rows: the engine's route."""
    base, _ = models
    r = nemotron_ref
    prefix = r["prefix_tokens"]
    P = len(prefix)
    _, kv = base.forward(base.params, *layouts.prefill(jnp.asarray(prefix))[:3],
                         base.empty_cache(0), 0)
    cache = cache_lib.commit(base.empty_cache(P + 32), kv, jnp.arange(P), 0)
    mask = r[f"{name}_mask"][:, P:]
    assert r[f"{name}_mask"][:, :P].all()  # every query row sees the whole prefix
    got, _ = base.forward(base.params, jnp.asarray(r[f"{name}_tokens"]),
                          jnp.asarray(r[f"{name}_positions"]), jnp.asarray(mask), cache, P)
    check(np.asarray(got), r[f"{name}_logits"], name)


def test_engine_layouts_match_fixture(nemotron, nemotron_ref):
    """layouts.packed / draft_block build exactly the fixture's packed and block inputs."""
    r = nemotron_ref
    P = len(r["prefix_tokens"])
    seed = r["block_tokens"][0]
    draft = r["packed_tokens"][1:8]
    call = layouts.packed(seed, jnp.asarray(draft), P, nemotron.mask_id)
    np.testing.assert_array_equal(call.tokens, r["packed_tokens"])
    np.testing.assert_array_equal(call.positions, r["packed_positions"])
    np.testing.assert_array_equal(call.mask, r["packed_mask"][:, P:])
    call = layouts.draft_block(seed, P, 8, nemotron.mask_id)
    np.testing.assert_array_equal(call.tokens, r["block_tokens"])
    np.testing.assert_array_equal(call.mask, r["block_mask"][:, P:])


def test_lora_rows(models, nemotron_ref):
    """Adapter on for the block rows only; the prefix KV stays the base model's."""
    _, lora = models
    r = nemotron_ref
    rows = r["block_rows"]
    draft_rows = np.zeros(len(r["block_full_tokens"]), bool)
    draft_rows[rows] = True
    got = ps.logits(lora, r["block_full_tokens"], r["block_full_positions"], r["block_full_mask"],
                    draft_rows=draft_rows)
    check(got[rows], r["lora_block_logits"], "lora_block")
    everywhere = ps.logits(lora, r["block_full_tokens"], r["block_full_positions"],
                           r["block_full_mask"], draft_rows=np.ones_like(draft_rows))
    check(everywhere[rows], r["lora_all_block_logits"], "lora_all_block")
    # Verifier rows never see the adapter.
    plain = ps.logits(lora, r["block_full_tokens"], r["block_full_positions"], r["block_full_mask"])
    check(plain[rows], r["block_logits"], "lora off")


def test_packed_call_with_lora_keeps_verifier_rows_base(nemotron, nemotron_lora, nemotron_ref):
    r = nemotron_ref
    P = len(r["prefix_tokens"])
    rows = r["packed_rows"]
    draft_rows = np.zeros(len(r["packed_full_tokens"]), bool)
    draft_rows[P + 8:] = True  # second (drafting) half
    got = ps.logits(nemotron_lora, r["packed_full_tokens"], r["packed_full_positions"],
                    r["packed_full_mask"], draft_rows=draft_rows)[rows]
    check(got[:8], r["packed_logits"][:8], "verifier half under LoRA")
    check(got[8:], r["lora_block_logits"], "drafting half under LoRA")
