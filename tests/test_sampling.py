"""Theorem 3.3: sampled continuations follow the AR distribution exactly.

The exact joint law of the first tokens is enumerated from full causal forwards,
with the tempered/truncated target computed here in NumPy (independently of the
library). Each schedule draws N samples (the decode vmapped over seeds, fixed seeds)
and a chi-square goodness-of-fit test must not reject at ALPHA. Continuations with an
expected count below POOL are pooled into one cell. N is sized so that the test
detects a total-variation error of 0.02 in the least favourable direction (mass moved
proportionally out of the likeliest continuation) with power >= 0.85 (`test_power`).
Negative controls, a wrong acceptance rule and a wrong residual, must be rejected by
the same test.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import packed_ss_jax as ps
from packed_ss_jax import results, sampling
from packed_ss_jax.options import on_sampled_program
from packed_ss_jax.sampling import Sampler
from tiny import tiny_model

ALPHA = 0.01
POOL = 50
N = 20_000
PROMPT = [1, 2, 3]
L = 3
B = 3
CAPACITY = 8
SEED0 = 12_345
MODEL = tiny_model(5, vocab=6)  # MASK = 5


def np_target(logits, s: Sampler):
    """Temperature, then top-k, then top-p (smallest prefix reaching p); NumPy."""
    x = logits.astype(np.float64) / s.temperature
    if s.top_k is not None:
        cut = np.sort(x)[-s.top_k]
        x = np.where(x >= cut, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if s.top_p is not None:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        keep = np.zeros_like(p, bool)
        keep[order[before < s.top_p]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def exact_law(s: Sampler, eos=None, length=L):
    """{continuation: probability} for AR sampling stopped at EOS or `length` tokens."""
    V = MODEL.vocab_size
    law = {}

    def grow(seq, prob):
        if len(seq) == length or (seq and seq[-1] == eos):
            law[tuple(seq)] = law.get(tuple(seq), 0.0) + prob
            return
        full = PROMPT + seq
        T = len(full)
        logits = ps.logits(MODEL, full, np.arange(T), np.tril(np.ones((T, T), bool)))[-1]
        p = np_target(logits, s)
        for t in range(V):
            if p[t] > 0:
                grow(seq + [t], prob * p[t])

    grow([], 1.0)
    return law


_DRAWN = {}


def draw(schedule, s: Sampler, eos=None, seed0=SEED0, **extra):
    key = (schedule, s, eos, seed0, sampling.accept_ratio, sampling.residual,
           tuple(extra.items()))
    if key not in _DRAWN:
        _DRAWN[key] = _draw(schedule, s, eos, seed0, **extra)
    return _DRAWN[key]


def sample_many(model, prompt, seeds, **options):
    """Many independent samples of one request in one call: the decode (`decoder`, traced
    anew, so it reads the sampling rules as they are now) vmapped over the seeds; row i is
    what `decode(model, prompt, seed=seeds[i], **options)` gives. Returns tokens [N, C],
    lengths [N] and NFE [N]; NonFiniteError as `decode` raises it if any sample met NaN/Inf
    logits."""
    fn = ps.decoder(model, **options)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.asarray(seeds, jnp.uint32))
    many = jax.jit(jax.vmap(fn, in_axes=(None, None, None, 0)))
    tokens, n, stats = jax.device_get(many(model.params, np.asarray(prompt, np.int32),
                                           np.int32(len(prompt)), keys))
    results.check_finite(stats["nonfinite_at"], stats["iterations"], tokens)
    return np.asarray(tokens), np.asarray(n), np.asarray(stats["nfe"])


def _draw(schedule, s: Sampler, eos, seed0, length=L, **extra):
    toks, n, _ = sample_many(MODEL, PROMPT, seed0 + np.arange(N), schedule=schedule,
                             block_size=B, max_new_tokens=length, eos_id=eos, cache_size=CAPACITY,
                             temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                             **extra)
    return [tuple(row[:k]) for row, k in zip(toks.tolist(), n.tolist())]


def chi_square(samples, law):
    """p-value of the samples against the law; cells with expected count < 5 are pooled."""
    keys = list(law)
    probs = np.array([law[k] for k in keys])
    counts = dict.fromkeys(keys, 0)
    outside = 0
    for x in samples:
        if x in counts:
            counts[x] += 1
        else:
            outside += 1  # an impossible continuation
    if outside:
        return 0.0
    obs = np.array([counts[k] for k in keys], float)
    exp = probs * len(samples)
    small = exp < POOL
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


SETTINGS = {
    "T=1": (Sampler(1.0), None),
    # truncation and the EOS stop rule together (each setting is one compile per schedule)
    "T=0.8,top_k=4,top_p=0.9,eos=0": (Sampler(0.8, top_k=4, top_p=0.9), 0),
}
CASES = [(sched, name) for name in SETTINGS for sched in ["ar", "linear", "quadratic", "packed"]
         if name == "T=1" or sched != "ar"]


@pytest.fixture(scope="module")
def laws():
    return {name: exact_law(s, eos) for name, (s, eos) in SETTINGS.items()}


P_VALUES = {}


@pytest.mark.parametrize("schedule,setting", CASES)
def test_follows_ar_distribution(laws, schedule, setting):
    s, eos = SETTINGS[setting]
    if eos is not None:
        assert any(len(k) < L for k in laws[setting])  # the stop rule really acts
    p = chi_square(draw(schedule, s, eos), laws[setting])
    P_VALUES[(schedule, setting)] = p
    print(f"chi-square p-value {schedule:9s} {setting}: {p:.4f}")
    assert p > ALPHA


BRANCHED_L = 5   # long enough that drafts from a branch are verified (L = 3 is not)


@pytest.fixture(scope="module")
def branched_law():
    return exact_law(SETTINGS["T=1"][0], length=BRANCHED_L)


@pytest.mark.parametrize("branches", [2, 3])
def test_branched_follows_ar_distribution(branched_law, branches):
    """Branched-SS at T=1 with 2 and 3 branches (3 = B: one per outcome): the next draft
    comes from the branch the verification selects, and the law is AR's."""
    s = SETTINGS["T=1"][0]
    p = chi_square(draw("branched", s, length=BRANCHED_L, branches=branches), branched_law)
    print(f"chi-square p-value branched k={branches}: {p:.4f}")
    assert p > ALPHA


@pytest.mark.parametrize("broken", ["always_accept", "residual_from_p"])
def test_wrong_rules_are_caught(laws, monkeypatch, broken):
    if broken == "always_accept":
        monkeypatch.setattr(sampling, "accept_ratio", lambda p_d, q_d: 1.0 + 0.0 * p_d)
    else:
        monkeypatch.setattr(sampling, "residual", lambda p_row, q_row: p_row)
    # `draw` traces the decode anew (its memo is keyed on the rules): it runs the broken one
    p = chi_square(draw("packed", SETTINGS["T=1"][0]), laws["T=1"])
    print(f"negative control {broken}: p-value {p:.3g}")
    assert p < ALPHA


def test_a_capped_stored_proposal_keeps_the_law(laws, monkeypatch):
    """Without top-k a draft's Q is stored as the drafter's Q_STORE most likely tokens.
    Capped below the vocabulary (2 of the 5 tokens a draft may be), the drafts come from
    the capped Q and the output still follows the AR law."""
    monkeypatch.setattr(sampling, "Q_STORE", 2)
    p = chi_square(_draw("packed", SETTINGS["T=1"][0], None, SEED0), laws["T=1"])
    print(f"capped Q: p-value {p:.4f}")
    assert p > ALPHA


def tv_shift_rejections(law, n: int, trials: int = 20, move: float = 0.02) -> int:
    """How often the chi-square test rejects samples from a law at total-variation distance
    `move` from `law` (mass moved proportionally out of the likeliest continuation, the
    least favourable direction)."""
    keys = sorted(law, key=law.get)
    big, smalls = keys[-1], keys[:-1]
    shifted = dict(law)
    shifted[big] -= move
    total_small = sum(law[k] for k in smalls)
    for k in smalls:
        shifted[k] += move * law[k] / total_small
    rng = np.random.default_rng(0)
    rejections = 0
    for _ in range(trials):
        idx = rng.choice(len(keys), size=n, p=np.array([shifted[k] for k in keys]))
        rejections += chi_square([keys[i] for i in idx], law) < ALPHA
    return rejections


def test_power(laws):
    """The test detects a law at total-variation distance 0.02 from the true one."""
    rejections = tv_shift_rejections(laws["T=1"], N)
    print(f"power against a TV shift of 0.02: {rejections}/20 rejected")
    assert rejections >= 17


def test_seed_reproduces_and_batch_matches_single(laws):
    s = Sampler(1.0)
    seeds = np.arange(N) + SEED0
    batch = draw("packed", s)
    for i in [0, 1, 7]:
        one = ps.decode(MODEL, PROMPT, schedule="packed", block_size=B, max_new_tokens=L,
                        eos_id=None, temperature=1.0, seed=int(seeds[i]), cache_size=CAPACITY)
        again = ps.decode(MODEL, PROMPT, schedule="packed", block_size=B, max_new_tokens=L,
                          eos_id=None, temperature=1.0, seed=int(seeds[i]), cache_size=CAPACITY)
        assert tuple(one.tokens) == batch[i] == tuple(again.tokens)
    engine = ps.Engine(MODEL)  # a new engine compiles anew: recompiling changes nothing
    three = engine.decode(engine.request(PROMPT, ps.DecodeOptions(
        schedule="packed", width=B, max_new_tokens=L, eos_id=None, temperature=1.0,
        cache_size=CAPACITY), seed=int(seeds[0])))
    assert three.compile_s > 0 and tuple(three.tokens) == batch[0]
    # Different seeds, different samples: at least as many distinct outputs as 200
    # draws from the exact law give but once in a thousand (by simulation).
    law = np.array(list(laws["T=1"].values()))
    rng = np.random.default_rng(0)
    distinct = [len(set(rng.choice(len(law), 200, p=law / law.sum()))) for _ in range(5000)]
    assert len(set(batch[:200])) >= np.quantile(distinct, 0.001)


@pytest.mark.parametrize("schedule", ["ar", "linear", "quadratic", "packed"])
def test_temperature_zero_is_greedy(nemotron, nemotron_ref, schedule):
    want = nemotron_ref["greedy_continuation"][:20].tolist()
    for kw in [dict(), dict(top_k=5), dict(top_p=0.3), dict(top_k=2, top_p=0.5, seed=9)]:
        r = ps.decode(nemotron, nemotron_ref["greedy_prompt"].tolist(), schedule=schedule,
                      block_size=5, max_new_tokens=20, eos_id=None, temperature=0.0, **kw)
        assert r.tokens == want


@pytest.mark.parametrize("schedule", ["ar", "linear", "quadratic", "packed", "branched"])
def test_the_sampled_program_at_temperature_zero_is_greedy(nemotron, nemotron_ref, schedule):
    """A greedy request on the sampled program (as the server's slots decode it: the
    temperature 0 is data, not the greedy program) gives the reference greedy tokens."""
    engine = ps.Engine.of(nemotron)
    request = engine.request(nemotron_ref["greedy_prompt"].tolist(), ps.DecodeOptions(
        schedule=schedule, width=5, max_new_tokens=20, eos_id=None), seed=9)
    shared = on_sampled_program(request)
    assert request.program.sampling.greedy and not shared.program.sampling.greedy
    assert engine.decode(shared).tokens == nemotron_ref["greedy_continuation"][:20].tolist()


@pytest.mark.parametrize("schedule", ["ar", "packed", "branched"])
def test_the_sampled_program_at_temperature_zero_breaks_ties_as_greedy(schedule):
    """Every logit tied (zero weights): a draw at temperature 0 would pick any of them;
    the sampled program's greedy slots take the lowest id, as the greedy program does."""
    flat = jax.tree.map(jnp.zeros_like, MODEL)
    engine = ps.Engine(flat)
    request = engine.request(PROMPT, ps.DecodeOptions(schedule=schedule, width=B,
                                                      max_new_tokens=6, eos_id=None), seed=3)
    assert engine.decode(on_sampled_program(request)).tokens == engine.decode(request).tokens


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(temperature=1.0, top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(temperature=1.0, top_k=0), "top_k must be an integer >= 1"),
    (dict(temperature=1.0, seed=-1), "seed must be an integer"),
])
def test_bad_sampling_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ps.decode(MODEL, PROMPT, max_new_tokens=2, **kwargs)


def test_stored_q_storage_is_truncated():
    """With top-k the state carries k entries per draft position, not a vocabulary row."""
    import jax.numpy as jnp

    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 50)), jnp.float32)
    q = sampling.proposal(logits, Sampler(1.0, top_k=5), mask_id=49)
    assert q.probs.shape == (4, 5) and q.ids.shape == (4, 5)
    np.testing.assert_allclose(np.asarray(q.probs).sum(-1), 1.0, rtol=1e-6)
    assert 49 not in np.asarray(q.ids)
    # Without top-k, the Q_STORE most likely entries, whatever top-p is (one shape).
    for top_p in (None, 0.5):
        q = sampling.proposal(logits, Sampler(1.0, top_p=top_p), mask_id=49)
        assert q.probs.shape == q.ids.shape == (4, min(sampling.Q_STORE, 50))
