"""The SetDLM training objective: the two-stream masks, orders and targets on tiny
sequences with known answers; the query rows compute exactly the conditionals the
decoder asks for (the serial reference's tokens come out of the verifier stream); the
losses fall; an export reloads through the real SetDLM reader to identical logits."""

import itertools
import json

import jax
import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import Model
from packed_ss_jax import model as model_lib
from packed_ss_jax.setdlm import checkpoint as setdlm_ckpt
from packed_ss_jax.api import decode
from packed_ss_jax.setdlm.state import MASK_LOGIT
from packed_ss_jax.training import corpus, export
from packed_ss_jax.training import setdlm_objective as so
from packed_ss_jax.training import train as train_lib
from packed_ss_jax.training.tokenizer import special_ids, train_tokenizer
from setdlm_reference import two_stream
from tiny import _params

MASK = 2


def test_attention_mask_known_answer():
    """L = 3, verifier cuts [0, 1, 2], drafter cuts [0, 0, 1]: rows and columns are
    [c0 c1 c2 | v0 v1 v2 | d0 d1 d2] (clean, verifier, drafter streams, in rank order)."""
    m = np.asarray(so.attention_mask(np.array([[0, 1, 2], [0, 0, 1]])))
    want = np.array([
        # c0 c1 c2 v0 v1 v2 d0 d1 d2
        [1, 0, 0, 0, 0, 0, 0, 0, 0],  # c0
        [1, 1, 0, 0, 0, 0, 0, 0, 0],  # c1
        [1, 1, 1, 0, 0, 0, 0, 0, 0],  # c2: clean rows causal in feeding order
        [0, 0, 0, 1, 0, 0, 0, 0, 0],  # v0: nothing fed yet, sees itself
        [1, 0, 0, 0, 1, 0, 0, 0, 0],  # v1: every earlier rank
        [1, 1, 0, 0, 0, 1, 0, 0, 0],  # v2
        [0, 0, 0, 0, 0, 0, 1, 0, 0],  # d0
        [0, 0, 0, 0, 0, 0, 0, 1, 0],  # d1: gap 1, sees no clean row
        [1, 0, 0, 0, 0, 0, 0, 0, 1],  # d2: gap 1, sees rank 0 only
    ], bool)
    np.testing.assert_array_equal(m, want)


def test_verifier_stream_is_the_decoders_two_stream_construction():
    """With the verifier stream alone, tokens, positions and mask are exactly
    `two_stream` (setdlm_reference.py: the release's duplicate-mask construction)."""
    rng = np.random.default_rng(1)
    x0 = rng.integers(4, 40, (1, 10)).astype(np.int32)
    oc = so.OrderConfig(p_ltr=0.0, spans=(4,), span_probs=(1.0,))
    tokens, positions, cuts, targets, _, _ = so.two_stream_batch(rng, x0, MASK, oc)
    sigma = positions[0, :10]
    want_t, want_p, want_m = two_stream(x0[0], sigma, MASK)
    np.testing.assert_array_equal(tokens[0, :20], want_t)
    np.testing.assert_array_equal(positions[0, :20], want_p)
    np.testing.assert_array_equal(np.asarray(so.attention_mask(cuts[0, :1])), want_m)
    np.testing.assert_array_equal(targets[0], x0[0, sigma])
    assert sorted(sigma) == list(range(10)) and list(sigma) != list(range(10))
    assert (tokens[0, 10:] == MASK).all() and (positions[0, 20:] == sigma).all()


def test_next_token_targets_known_answer():
    """x0 = [10 11 12 13] fed in order sigma = [1 0 3 2]: only the clean row of rank 0
    (position 1) has its next position (2) still unfed; the others see theirs or have none."""
    tok, w = so.next_targets(np.array([10, 11, 12, 13]), np.array([1, 0, 3, 2]))
    np.testing.assert_array_equal(w, [1, 0, 0, 0])
    assert tok[0] == 12
    tok, w = so.next_targets(np.array([10, 11, 12, 13]), np.arange(4))
    np.testing.assert_array_equal(tok[:3], [11, 12, 13])
    np.testing.assert_array_equal(w, [1, 1, 1, 0])


def test_orders_stay_within_the_window_and_gaps_within_bounds():
    rng = np.random.default_rng(0)
    L = 40
    assert (so.feed_order(rng, L, so.OrderConfig(p_ltr=1.0)) == np.arange(L)).all()
    for D in (1, 4, 8, 16):
        oc = so.OrderConfig(p_ltr=0.0, spans=(D,), span_probs=(1.0,), max_gap=6)
        for _ in range(50):
            sigma = so.feed_order(rng, L, oc)
            assert sorted(sigma) == list(range(L))
            # The decoder never feeds a position W or more past the leftmost unfed one.
            unfed_min = [min(set(range(L)) - set(sigma[:i])) for i in range(L)]
            assert all(sigma[i] < unfed_min[i] + D for i in range(L)), (D, sigma)
            cut = so.draft_cuts(rng, L, oc)
            k = np.arange(L)
            assert cut[0] == 0 and (cut[1:] < k[1:]).all() and (cut >= 0).all()
            assert (k - cut <= 6).all()
    with pytest.raises(ValueError, match="p_ltr"):
        so.OrderConfig(p_ltr=1.5)


def _tiny_setdlm():
    c = train_lib.model_config(24, {"mask": MASK, "eos": 1, "bos": 0}, family="setdlm",
                               hidden=32, layers=2, heads=4, kv_heads=2, head_dim=16,
                               intermediate=48, block_size=4, max_pos=256)
    return Model(config=c, params=_params(c, jax.random.PRNGKey(3)))


def _training_logits(m, tokens, positions, cuts):
    mask = so.attention_mask(cuts)
    out = model_lib.forward(m.config, m.params, tokens, positions, mask,
                            model_lib.empty_cache(m.config, 0), 0)[0]
    return np.asarray(out.at[..., MASK].set(MASK_LOGIT))


def test_query_rows_are_the_decoders_conditionals():
    """On a random model: the verifier stream's argmax at every output position is the
    serial decoder's token there (its `[N | M]` call: a MASK seeing every earlier token),
    and a drafter row with cut c gives the logits of a MASK at its position that sees
    the first c fed tokens and itself (a draft query over the cache)."""
    m = _tiny_setdlm()
    prompt = [0, 5, 9, 7, 3]
    out = decode(m, prompt, schedule="serial", max_new_tokens=10, eos_id=None, cache_size=64)
    x0 = np.asarray(prompt + out.tokens, np.int32)
    L = len(x0)
    rng = np.random.default_rng(0)
    tokens, positions, cuts, targets, _, _ = so.two_stream_batch(
        rng, x0[None], MASK, so.OrderConfig(p_ltr=1.0))
    logits = _training_logits(m, tokens[0], positions[0], cuts[0])
    verifier, drafter = logits[L:2 * L], logits[2 * L:]
    assert list(verifier[len(prompt):].argmax(-1)) == out.tokens
    for k in (len(prompt) + 2, L - 1):
        c = int(cuts[0, 1, k])
        t = np.concatenate([x0[:c], [MASK]])
        p = np.concatenate([np.arange(c), [k]])
        mask = np.tril(np.ones((c + 1, c + 1), bool))
        want = ps.logits(m, t, p, mask)[-1]
        np.testing.assert_allclose(drafter[k][np.arange(24) != MASK], want[np.arange(24) != MASK],
                                   rtol=1e-5, atol=1e-4)


def test_setdlm_losses_fall_and_export_reloads_identically(tmp_path):
    texts = [p.text for p in itertools.islice(corpus.arithmetic("train"), 400)]
    tok = train_tokenizer(texts, 300)
    ids = special_ids(tok)
    c = train_lib.model_config(tok.get_vocab_size(), ids, family="setdlm", hidden=64, layers=2,
                               heads=4, kv_heads=2, head_dim=16, intermediate=128, block_size=4,
                               max_pos=256)
    assert c.qk_norm and c.tie_embeddings and c.family == "setdlm"
    stream = np.concatenate([np.asarray(e.ids + [ids["eos"]], np.int32)
                             for e in tok.encode_batch(texts)])
    tc = train_lib.TrainConfig.for_family("setdlm", steps=30, batch=8, seq_len=40, lr=3e-3,
                                          warmup=5)
    params = model_lib.init_params(c, jax.random.PRNGKey(0))
    tx = train_lib.optimizer(tc)
    opt_state = tx.init(params)
    step = train_lib.make_step(c, tx, tc.weights())
    rng = np.random.default_rng(0)
    hist = []
    for _ in range(tc.steps):
        starts = rng.integers(0, len(stream) - tc.seq_len, tc.batch)
        clean = np.stack([stream[s:s + tc.seq_len] for s in starts])
        batch = so.two_stream_batch(rng, clean, c.mask_token_id)
        params, opt_state, loss, terms = step(params, opt_state, *batch)
        hist.append([float(t) for t in terms])
    hist = np.asarray(hist)
    first, last = hist[:5].mean(0), hist[-5:].mean(0)
    for name, a, b in zip(("verifier", "drafter", "next-token"), first, last):
        assert b < 0.8 * a, f"{name} loss did not fall: {a:.3f} -> {b:.3f}"

    out = export.export(tmp_path / "ckpt", c, params, tok, length=tc.seq_len)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "bd3lm" and cfg["architectures"] == ["SetDLM"]
    assert cfg["noise_config"]["desired_block_size"] == 4 and cfg["length"] == 40
    assert cfg["qwen3_config"]["num_hidden_layers"] == 2
    assert cfg["backbone_config"]["pretrained_model_name_or_path"] is None
    assert cfg["pad_token_id"] == ids["pad"] and cfg["mask_token_id"] == ids["mask"]
    names = set(export.tensors(c, params))
    assert names == {n for e in setdlm_ckpt.table(c)
                     for n in ([e.name.format(i=i) for i in range(c.num_layers)] if e.layer
                               else [e.name])}
    assert "backbone.model.model.layers.1.self_attn.k_norm.weight" in names
    assert setdlm_ckpt.HEAD not in names                     # tied: not stored

    loaded = ps.load(out)
    assert loaded.config == c
    assert loaded.tokenizer.encode("7 + 5").ids == tok.encode("7 + 5").ids
    tokens, positions, cuts, *_ = so.two_stream_batch(rng, clean[:1, :12], c.mask_token_id)
    mask = np.asarray(so.attention_mask(cuts[0]))
    mine = ps.logits(Model(config=c, params=params), tokens[0], positions[0], mask)
    theirs = ps.logits(loaded, tokens[0], positions[0], mask)
    np.testing.assert_array_equal(mine, theirs)


def test_family_switch_errors():
    with pytest.raises(ValueError, match="family"):
        train_lib.TrainConfig(family="llama")
    c = _tiny_setdlm().config
    tc = train_lib.TrainConfig.for_family("setdlm")
    assert tc.weights() == (tc.ar_weight, tc.diff_weight, tc.next_weight)
    with pytest.raises(ValueError, match="loss terms"):
        train_lib.make_step(c, train_lib.optimizer(tc), (1.0, 0.3))
