"""The decoder never emits garbage, whatever the numbers.

Small temperatures: any T > 0 is a valid law, and T -> 0 gives the greedy tokens
(float32 softmax of logits / T used to turn into NaN and token 0 from T ~ 1e-9 on).
Non-finite weights: decoding stops with a NonFiniteError at the first generated
position whose logits hold NaN/Inf, and no id outside [0, V) ever leaves the engine.

Each temperature is a compiled program per schedule, so the decode-level tests give
each schedule one small temperature (every temperature is covered by each family) and
share those programs with the NaN tests; the sampling functions themselves are checked
at every temperature, with and without truncation.
"""

import dataclasses
import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import Model, results, sampling
from packed_ss_jax import NonFiniteError
from packed_ss_jax.reductions import first_argmax
from packed_ss_jax.sampling import Sampler, StoredQ
from test_setdlm_decode import tiny_setdlm, tiny_setdlm_config
from tiny import _params, tiny_model

SMALL_T = [1e-6, 1e-10, 1e-30, 1e-45]  # 1e-45 is subnormal in float32
SEEDS = [0, 1, 2, 3]

# --- the sampling functions, at every temperature --------------------------------------

LOGITS = jnp.asarray(np.random.default_rng(0).normal(size=(6, 40)) * 30.0, jnp.float32)
TRUNCATIONS = [dict(), dict(top_k=3), dict(top_p=0.5)]


@functools.lru_cache(maxsize=None)
def _sampled(samplers: tuple[Sampler, ...]):
    """Jitted targets and draws for several samplers in one program (the bug only showed
    under jit, where XLA fuses the multiplication by 1 / T into an FMA)."""
    def draw(key, logits):
        keys = jax.random.split(key, logits.shape[0])
        out = []
        for s in samplers:
            logp = sampling.target(logits, s)
            out.append((logp, jax.vmap(sampling.sample_from)(keys, logp)))
        return out
    return jax.jit(draw)


def test_small_temperature_target_is_the_argmax():
    samplers = tuple(Sampler(t, **kw) for t in SMALL_T for kw in TRUNCATIONS)
    want = np.argmax(np.asarray(LOGITS), axis=-1)
    for seed in range(3):
        drawn = _sampled(samplers)(jax.random.PRNGKey(seed), LOGITS)
        for s, (logp, tokens) in zip(samplers, drawn):
            logp = np.asarray(logp)
            assert not np.isnan(logp).any(), s
            np.testing.assert_array_equal(logp.argmax(-1), want)
            np.testing.assert_array_equal(np.exp(logp).max(-1), 1.0)
            np.testing.assert_array_equal(np.asarray(tokens), want)


def test_huge_temperature_is_uniform():
    samplers = (Sampler(1e30), Sampler(3e38))
    for logp, tokens in _sampled(samplers)(jax.random.PRNGKey(0), LOGITS.at[:, 5].set(-jnp.inf)):
        p = np.exp(np.asarray(logp))
        np.testing.assert_allclose(p[:, 0], 1 / 39, rtol=1e-5)  # the -inf column stays out
        assert (p[:, 5] == 0).all() and not np.isnan(p).any()
        assert ((np.asarray(tokens) >= 0) & (np.asarray(tokens) < 40)).all()


def test_small_temperature_speculative_step_returns_the_argmax():
    """Algorithm 2 at T -> 0: drafts equal to the argmax are accepted, the first other
    one is replaced by the argmax (the residual of two point masses)."""
    V, W = LOGITS.shape[1], LOGITS.shape[0] - 1
    want = np.argmax(np.asarray(LOGITS), axis=-1)
    mask_id = next(i for i in range(V) if i not in want)
    # The drafter agrees with the target on the first two positions only.
    q_logits = jnp.concatenate([LOGITS[:2], -LOGITS[2:W]])
    samplers = [Sampler(t, **kw) for t in SMALL_T for kw in (dict(), dict(top_k=4))]

    @jax.jit
    def steps(key):
        out = []
        for s in samplers:
            q = sampling.proposal(q_logits, s, mask_id)
            draft = q.sample(key)
            out.append((draft, *sampling.verify(key, sampling.target(LOGITS, s), draft, W, q)))
        return out

    for draft, h, C in steps(jax.random.PRNGKey(1)):
        np.testing.assert_array_equal(np.asarray(draft)[:2], want[:2])
        assert int(h) == 2
        np.testing.assert_array_equal(np.asarray(C)[:3], want[:3])


def test_log_space_rules():
    lp = jnp.log(jnp.asarray([0.5, 0.3, 0.2, 0.0]))
    lq = jnp.log(jnp.asarray([0.2, 0.3, 0.0, 0.5]))
    tiny = jnp.asarray([0.0, -200.0, -jnp.inf, -jnp.inf])  # e^-200 underflows as a probability
    rules = jax.jit(lambda lp, lq, tiny: (
        sampling.accept_ratio(lp, lq), sampling.accept_ratio(lq, lp), sampling.residual(lp, lq),
        sampling.residual(lp, lp), sampling.residual(tiny, jnp.where(tiny > -1, 0.0, -jnp.inf))))
    a_pq, a_qp, r, r_same, r_tiny = map(np.asarray, rules(lp, lq, tiny))
    np.testing.assert_allclose(a_pq, [1.0, 1.0, 1.0, 0.0], rtol=1e-6)  # p(d) = 0: never
    np.testing.assert_allclose(a_qp[:2], [0.4, 1.0], rtol=1e-6)
    np.testing.assert_allclose(np.exp(r) / np.exp(r).sum(), [0.6, 0.0, 0.4, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(r_same, lp)  # no mass left: p itself
    np.testing.assert_allclose(r_tiny[1], -200.0)  # kept, where probabilities would be 0


def test_stored_q_holds_log_probabilities():
    @jax.jit
    def stored(x):
        q = sampling.proposal(x, Sampler(1.0, top_k=5), mask_id=39)
        return q, q.of(q.ids[:, 1]), q.dense_row(2, 40)

    q, of, dense = stored(LOGITS)
    assert isinstance(q, StoredQ) and q.logp.shape == (6, 5)
    np.testing.assert_allclose(np.asarray(q.probs).sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(of), np.asarray(q.logp)[:, 1])
    np.testing.assert_array_equal(np.asarray(dense)[np.asarray(q.ids[2])], np.asarray(q.logp[2]))
    assert np.isneginf(np.delete(np.asarray(dense), np.asarray(q.ids[2]))).all()


def test_non_finite_logits_still_give_vocabulary_ids():
    x = LOGITS.at[0].set(jnp.nan).at[1, 3].set(jnp.nan).at[2].set(-jnp.inf).at[3, 7].set(jnp.inf)
    V = x.shape[1]
    samplers = (Sampler(1.0), Sampler(1e-30, top_k=3), Sampler(0.7, top_p=0.9))

    @jax.jit
    def ids(key, x):
        drafts = [sampling.proposal(x, s, mask_id=V - 1).sample(key) for s in samplers]
        return first_argmax(x), drafts

    greedy, drafts = ids(jax.random.PRNGKey(1), x)
    greedy = np.asarray(greedy)
    assert greedy[0] == 0 and greedy[2] == 0 and greedy[3] == 7
    assert greedy[1] == np.nanargmax(np.asarray(x[1]))
    for logp, tokens in _sampled(samplers)(jax.random.PRNGKey(0), x):
        assert not np.isnan(np.asarray(logp)).any()
        assert ((np.asarray(tokens) >= 0) & (np.asarray(tokens) < V)).all()
    for z in drafts:
        assert ((np.asarray(z) >= 0) & (np.asarray(z) < V)).all()


# --- decoding: small temperatures give the greedy tokens -------------------------------

NEMOTRON = tiny_model(1)  # the config of tests/tiny.py: its greedy programs are shared
PROMPT = [2, 3, 4]
L, B = 16, 3
# One temperature per schedule (each is a compile); every temperature is used.
NEMOTRON_T = {"ar": 1e-45, "linear": 1e-30, "quadratic": 1e-10, "packed": 1e-6}

# SetDLM with an untied head, so that one token's embedding row can be broken alone, for
# the sampled schedules; the greedy schedules run tests/test_setdlm_decode.py's model
# (tied head), whose programs are shared.
W, CACHE = 3, 64
SETDLM_PROMPT = [2, 3]
_UNTIED = dataclasses.replace(tiny_setdlm_config(), tie_embeddings=False)
SETDLM = Model(config=_UNTIED, params=_params(_UNTIED, jax.random.PRNGKey(0)),
               source="tiny-untied(0)")
SETDLM_T = {"serial": 1e-45, "linear": 1e-30, "quadratic": 1e-10, "packed": 1e-6}


def _decode(model, schedule, temperature=0.0, seed=0):
    if model.config.family == "setdlm":
        return ps.decode(model, SETDLM_PROMPT, schedule=schedule, window=W, max_new_tokens=L,
                         eos_id=None, cache_size=CACHE, temperature=temperature, seed=seed)
    return ps.decode(model, PROMPT, schedule=schedule, block_size=B, max_new_tokens=L,
                     eos_id=None, temperature=temperature, seed=seed)


@functools.lru_cache(maxsize=None)
def _greedy(family):
    """The clean model's greedy continuation."""
    if family == "setdlm":
        return _decode(SETDLM, "serial").tokens
    return _decode(NEMOTRON, "ar").tokens


@pytest.mark.parametrize("model,temperatures", [(NEMOTRON, NEMOTRON_T), (SETDLM, SETDLM_T)],
                         ids=["nemotron", "setdlm"])
def test_small_temperature_is_greedy(model, temperatures):
    want = _greedy(model.config.family)
    assert len(set(want)) > 2  # a continuation with some variety
    for schedule, t in temperatures.items():
        for seed in SEEDS:
            assert _decode(model, schedule, t, seed).tokens == want, (schedule, t, seed)


def test_fixture_small_temperature_is_greedy(nemotron, nemotron_ref):
    """The fixture checkpoint (real logit margins, about 0.01 at the smallest), Packed-SS at a
    subnormal temperature, against the reference greedy continuation."""
    prompt, want = nemotron_ref["greedy_prompt"].tolist(), nemotron_ref["greedy_continuation"]
    for seed in SEEDS[:2]:
        r = ps.decode(nemotron, prompt, schedule="packed", block_size=5, max_new_tokens=20,
                      eos_id=None, temperature=1e-45, seed=seed)
        assert r.tokens == want[:20].tolist()


def test_huge_temperature_decodes_valid_ids():
    tokens = _decode(NEMOTRON, "ar", 1e30).tokens
    assert len(tokens) == L and all(0 <= t < NEMOTRON.vocab_size for t in tokens)
    assert len(set(tokens)) > 3  # all but uniform


# --- decoding: non-finite weights raise, never out-of-range ids ------------------------

def _broken(model, **params):
    return dataclasses.replace(model, params={**model.params, **params})


def _nan_layer(p):
    return jax.tree.map(lambda x: x * jnp.nan, p)


def _expect_stop(model, schedule, temperature, position):
    """Decoding raises NonFiniteError at `position`, with the clean greedy tokens before it."""
    with pytest.raises(NonFiniteError, match="non-finite logits") as e:
        _decode(model, schedule, temperature)
    assert e.value.position == position, (schedule, temperature)
    assert e.value.tokens == _greedy(model.config.family)[:position]


def _first_new(tokens, prompt):
    """A token of the greedy continuation, first output at position i > 0, absent from the
    prompt and from the prompt's padding (id 0: padded rows reach every row through the
    attention's 0 * NaN)."""
    for i, t in enumerate(tokens):
        if i > 0 and t != 0 and t not in prompt and t not in tokens[:i]:
            return t, i
    raise AssertionError("no suitable token")


def _cases(model, head_value):
    """(model, position of the first non-finite logits): one token's embedding row (fine
    until that token is the input), one head column, one layer's weights."""
    family = model.config.family
    t, i = _first_new(_greedy(family), SETDLM_PROMPT if family == "setdlm" else PROMPT)
    p = model.params
    return [(_broken(model, embed=p["embed"].at[t].set(jnp.nan)), i + 1),
            (_broken(model, head=p["head"].at[:, 5].set(head_value)), 0),
            (_broken(model, layer_1=_nan_layer(p["layer_1"])), 0)]


def test_nemotron_non_finite_weights_raise():
    for model, position in _cases(NEMOTRON, jnp.inf):
        for schedule, t in NEMOTRON_T.items():
            _expect_stop(model, schedule, 0.0, position)
            _expect_stop(model, schedule, t, position)


def test_setdlm_non_finite_weights_raise():
    for model, position in _cases(SETDLM, -jnp.inf):
        _expect_stop(model, "serial", 0.0, position)
        for schedule, t in SETDLM_T.items():
            _expect_stop(model, schedule, t, position)
    tied = tiny_setdlm(0)  # greedy programs shared with tests/test_setdlm_decode.py
    for params in [{"embed": tied.params["embed"].at[4].set(jnp.nan)},  # also its head column
                   {"layer_0": _nan_layer(tied.params["layer_0"])}]:
        model = _broken(tied, **params)
        for schedule in ["serial", "native", "linear", "quadratic", "packed"]:
            with pytest.raises(NonFiniteError) as e:
                ps.decode(model, SETDLM_PROMPT, schedule=schedule, window=W, max_new_tokens=L,
                          eos_id=None, cache_size=CACHE)
            assert (e.value.position, e.value.tokens) == (0, []), schedule


def test_nemotron_broken_drafter_raises_in_speculative_schedules():
    """NaN in the draft-only adapter: AR never reads it; the speculative schedules do."""
    attn = NEMOTRON.params["layer_0"]["attn"]
    model = _broken(NEMOTRON, layer_0={**NEMOTRON.params["layer_0"],
                                       "attn": {**attn, "lora_b": attn["lora_b"] * jnp.nan}})
    assert _decode(model, "ar").tokens == _greedy("nemotron")
    for schedule in ["linear", "quadratic", "packed"]:
        with pytest.raises(NonFiniteError) as e:
            _decode(model, schedule)
        assert e.value.tokens == _greedy("nemotron")[: e.value.position]


def test_check_finite_reports_the_first_stopped_sample():
    results.check_finite(np.int32(-1), 3, np.arange(5))  # finite: nothing to say
    results.check_finite(np.full(4, -1), np.ones(4), np.zeros((4, 5)))
    with pytest.raises(NonFiniteError, match="iteration 7, at generated position 2") as e:
        results.check_finite(np.array([-1, 2, 0]), np.array([9, 7, 1]),
                            np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]]))
    assert e.value.tokens == [4, 5]
    again = pickle.loads(pickle.dumps(e.value))
    assert (again.position, again.tokens, str(again)) == (2, [4, 5], str(e.value))
