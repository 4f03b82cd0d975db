"""SetDLM layouts: fixture parity (both checkpoint copies, whole-forward and cached
routes) and the masks of App. D.2 spelled out by hand."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import cache as cache_lib
from packed_ss_jax import model as model_lib
from packed_ss_jax.setdlm import layouts
from packed_ss_jax.setdlm.state import Window
from setdlm_reference import two_stream



ATOL = 1e-4
MASK = 299


@pytest.fixture(scope="module", params=["bin", "safetensors", "converted"])
def model(request, setdlm, setdlm_safetensors_dir, setdlm_dir, tmp_path_factory):
    if request.param == "bin":
        return setdlm
    if request.param == "safetensors":
        return ps.load(setdlm_safetensors_dir)
    out = ps.convert(setdlm_dir, tmp_path_factory.mktemp("conv") / "m", dtype="float32",
                     progress=False)
    return ps.load(out)


def check(got, want, what):
    err = float(np.max(np.abs(np.asarray(got) - want)))
    assert err < ATOL, f"{what}: max abs error {err:.3g}"


@pytest.mark.parametrize("name", ["train", "window", "step", "packed"])
def test_whole_forward_parity(model, setdlm_ref, name):
    r = setdlm_ref
    got = ps.logits(model, r[f"{name}_full_tokens"], r[f"{name}_full_positions"],
                    r[f"{name}_full_mask"])
    check(got[r[f"{name}_rows"]], r[f"{name}_logits"], name)
    if name == "train":
        L = len(r["train_tokens"])
        check(got[:L], r["train_logits_clean"], "train_logits_clean")
    else:
        P = len(r["prefix_tokens"])
        check(got[:P], r["prefix_logits"], "prefix")


def test_two_stream_construction(setdlm, setdlm_ref):
    r = setdlm_ref
    tokens, positions, mask = two_stream(r["train_tokens"], r["train_order"], MASK)
    np.testing.assert_array_equal(tokens, r["train_input_tokens"])
    np.testing.assert_array_equal(positions, r["train_positions"])
    np.testing.assert_array_equal(mask, r["train_mask"])
    np.testing.assert_array_equal(r["train_input_tokens"][: len(r["train_tokens"])],
                                  r["train_targets"])
    L = len(r["train_tokens"])
    check(ps.logits(setdlm, tokens, positions, mask)[L:], r["train_logits"], "two_stream")


@functools.partial(jax.jit, static_argnums=0)
def _forward(config, params, tokens, positions, mask, cache, cache_len):
    return model_lib.forward(config, params, tokens, positions, mask, cache, cache_len)


def _cached(model, r):
    """The prefix through the cache route: a causal pass whose K/V fill the cache."""
    P = len(r["prefix_tokens"])
    causal = np.tril(np.ones((P, P), bool))
    logits, kv = _forward(model.config, model.params, jnp.asarray(r["prefix_tokens"]),
                          jnp.arange(P), jnp.asarray(causal), model.empty_cache(0), 0)
    check(logits, r["prefix_logits"], "prefix_cached")
    cache = cache_lib.commit(model.empty_cache(P + 16), kv, jnp.arange(P), 0)
    return P, cache


def _run(model, call, cache, P):
    logits, _ = _forward(model.config, model.params, call.tokens, call.positions, call.mask,
                         cache, P)
    return np.asarray(logits)


def _full_window(outs, drafted=None):
    outs = np.asarray(outs, np.int32)
    active = np.ones(len(outs), bool)
    return Window(jnp.asarray(outs), jnp.asarray(active),
                  jnp.asarray(active if drafted is None else drafted))


@pytest.fixture(scope="module", params=["bin", "safetensors"])
def copy(request, setdlm, setdlm_safetensors_dir):
    return setdlm if request.param == "bin" else ps.load(setdlm_safetensors_dir)


def test_packed_layout_reproduces_the_fixture(copy, setdlm_ref):
    model = copy
    r = setdlm_ref
    P, cache = _cached(model, r)
    # [N | O_0..O_3 | M^4 | R^4]: N at output index 0 (position 10), the window at 1..4.
    toks = r["packed_tokens"]
    call = layouts.packed(P, toks[0], 0, 1, _full_window([1, 2, 3, 4]), jnp.asarray(toks[1:5]),
                          MASK)
    np.testing.assert_array_equal(call.tokens, toks)
    np.testing.assert_array_equal(call.positions, r["packed_positions"])
    np.testing.assert_array_equal(call.mask, r["packed_mask"][:, P:])
    check(_run(model, call, cache, P), r["packed_logits"], "packed_cached")


def test_native_step_layout_reproduces_the_fixture(copy, setdlm_ref):
    model = copy
    r = setdlm_ref
    P, cache = _cached(model, r)
    W, n_clean = 4, 2
    c_tok = np.zeros(W, np.int32)
    c_tok[:n_clean] = r["step_tokens"][:n_clean]
    c_out = np.array([0, 1, -1, -1], np.int32)
    w = _full_window([2, 3, 4, 5])
    call = layouts.native(P, jnp.asarray(c_tok), jnp.asarray(c_out), n_clean, w, MASK)
    live = np.r_[0:n_clean, W:2 * W]  # the padding clean slots are rows 2, 3
    np.testing.assert_array_equal(np.asarray(call.tokens)[live], r["step_tokens"])
    np.testing.assert_array_equal(np.asarray(call.positions)[live], r["step_positions"])
    np.testing.assert_array_equal(np.asarray(call.mask)[np.ix_(live, live)], r["step_mask"][:, P:])
    check(_run(model, call, cache, P)[live], r["step_logits"], "step_cached")
    # No clean rows: the first window of the decoder (every MASK sees the cache and itself).
    call = layouts.native(P, jnp.zeros(W, jnp.int32), jnp.full(W, -1), 0,
                        _full_window([0, 1, 2, 3]), MASK)
    np.testing.assert_array_equal(np.asarray(call.mask)[W:, W:], r["window_mask"][:, P:])
    check(_run(model, call, cache, P)[W:], r["window_logits"], "window_cached")


# --- masks by hand (App. D.2): rank 1 has no draft, so K_2 = {0} ---------------------------

def _bool(rows):
    return np.array([[c == "1" for c in row.replace(" ", "")] for row in rows])


def test_packed_mask_by_hand():
    w = _full_window([5, 6, 7], drafted=[True, False, True])
    call = layouts.packed(10, 3, 4, 1, w, jnp.array([8, 8, 8]), MASK)
    #              N O0 O1 O2 M0 M1 M2 R0 R1 R2
    want = _bool(["1  0  0  0  0  0  0  0  0  0",   # N sees itself
                  "1  1  0  0  0  0  0  0  0  0",   # O_0 <- N, O_0
                  "1  1  1  0  0  0  0  0  0  0",   # O_1 (no draft: a MASK row)
                  "1  1  0  1  0  0  0  0  0  0",   # O_2 <- O_{K_2} = O_0, O_2
                  "1  0  0  0  1  0  0  0  0  0",   # M_0 <- N, M_0
                  "1  1  0  0  0  1  0  0  0  0",   # M_1 <- O_0, M_1
                  "1  1  0  0  0  0  1  0  0  0",   # M_2 <- O_0 (not the missing O_1), M_2
                  "1  0  0  0  0  0  0  1  0  0",   # R_r <- N, R_r
                  "1  0  0  0  0  0  0  0  1  0",
                  "1  0  0  0  0  0  0  0  0  1"])
    np.testing.assert_array_equal(call.mask, want)
    np.testing.assert_array_equal(call.tokens, [3, 8, MASK, 8] + [MASK] * 6)
    np.testing.assert_array_equal(call.positions, [14] + [15, 16, 17] * 3)


def test_quadratic_mask_by_hand():
    # No N to feed (p = 0: a padding row); branch b sees the drafts of ranks < b.
    w = _full_window([0, 1], drafted=[True, True])
    call = layouts.quadratic(4, 0, -1, 0, w, jnp.array([6, 7]), MASK)
    #              N O0 O1 M0 M1 B00 B01 B10 B11
    want = _bool(["1  0  0  0  0  0   0   0   0",
                  "0  1  0  0  0  0   0   0   0",
                  "0  1  1  0  0  0   0   0   0",
                  "0  0  0  1  0  0   0   0   0",
                  "0  1  0  0  1  0   0   0   0",
                  "0  0  0  0  0  1   0   0   0",   # branch 0 (= R): the cache only
                  "0  0  0  0  0  0   1   0   0",
                  "0  1  0  0  0  0   0   1   0",   # branch 1: O_0 accepted
                  "0  1  0  0  0  0   0   0   1"])
    np.testing.assert_array_equal(call.mask, want)
    np.testing.assert_array_equal(call.positions, [4, 4, 5, 4, 5, 4, 5, 4, 5])


def test_linear_and_native_masks_by_hand():
    w = _full_window([2, 3])
    draft = layouts.draft(4, 9, 1, 1, w, MASK)
    np.testing.assert_array_equal(draft.mask, _bool(["100", "110", "101"]))
    verify = layouts.verify(4, w, jnp.array([6, 7]), MASK)
    np.testing.assert_array_equal(verify.mask, _bool(["1000", "1100", "0010", "1001"]))
    w3 = _full_window([2, 3, 4])
    step = layouts.native(4, jnp.array([6, 7, 0]), jnp.array([0, 1, -1]), 2, w3, MASK)
    #                                   C0 C1 C2 Q0 Q1 Q2
    np.testing.assert_array_equal(step.mask, _bool(["1  0  0  0  0  0",
                                                    "1  1  0  0  0  0",
                                                    "0  0  1  0  0  0",   # padding clean slot
                                                    "1  1  0  1  0  0",
                                                    "1  1  0  0  1  0",
                                                    "1  1  0  0  0  1"]))
    np.testing.assert_array_equal(step.tokens, [6, 7, MASK, MASK, MASK, MASK])

