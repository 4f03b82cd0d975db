"""Exact LTR sampling with the SetDLM schedules (Section 3.2, Algorithm 2).

The exact joint law of the first L tokens under serial one-token-at-a-time sampling
from the SetDLM AR conditional (a MASK query after the causal prefix, MASK excluded,
tempered and truncated in NumPy, independently of the library) is enumerated from
full forwards. Each schedule draws N samples (the decode vmapped over fixed seeds)
and the chi-square test of tests/test_sampling.py must not reject at ALPHA; a wrong
acceptance rule (always accept) must be rejected by the same test.
"""

import functools

import jax
import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import Model, ModelConfig, sampling
from packed_ss_jax.options import on_sampled_program
from packed_ss_jax.sampling import Sampler
from setdlm_reference import serial_ltr
from test_sampling import ALPHA, chi_square, np_target, sample_many, tv_shift_rejections
from tiny import _params

VOCAB = 6
MASK, EOS = VOCAB - 1, 1
N = 20_000
PROMPT = [1, 2, 3]
L = 4
W = 3  # W = 3 and L = 4: Quadratic-SS's branch 1 drafts differ from Packed-SS's R rows
CAPACITY = 8
SEED0 = 4_321
FEW = 256   # samples enough to tell two schedules' draws apart


@functools.lru_cache(maxsize=None)
def tiny_setdlm(seed: int = 0) -> Model:
    c = ModelConfig(family="setdlm", vocab_size=VOCAB, hidden_size=32, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48,
                    rms_norm_eps=1e-6, mask_token_id=MASK, eos_token_id=EOS, bos_token_id=0,
                    block_size=W, max_position_embeddings=64, rope_theta=10000.0,
                    qk_norm=True, tie_embeddings=True)
    return Model(config=c, params=_params(c, jax.random.PRNGKey(seed)), source=f"tiny({seed})")


MODEL = tiny_setdlm()


def exact_law(s: Sampler, eos=None):
    """{continuation: probability} for serial sampling stopped at EOS or L tokens."""
    law = {}

    def grow(seq, prob):
        if len(seq) == L or (seq and seq[-1] == eos):
            law[tuple(seq)] = law.get(tuple(seq), 0.0) + prob
            return
        full = PROMPT + seq + [MASK]  # clean rows causal; the MASK query sees them all
        T = len(full)
        logits = ps.logits(MODEL, full, np.arange(T), np.tril(np.ones((T, T), bool)))[-1]
        logits = logits.astype(np.float64)
        logits[MASK] = -np.inf
        p = np_target(logits, s)
        for t in range(VOCAB):
            if p[t] > 0:
                grow(seq + [t], prob * p[t])

    grow([], 1.0)
    return law


def draw(schedule, s: Sampler, eos=None, window=W, n=N, **kw):
    tok, E, _ = sample_many(MODEL, PROMPT, SEED0 + np.arange(n), schedule=schedule,
                            window=window, max_new_tokens=L, eos_id=eos, cache_size=CAPACITY,
                            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, **kw)
    return [tuple(row[:k]) for row, k in zip(tok.tolist(), E.tolist())]


SETTINGS = {
    "T=1": (Sampler(1.0), None),
    "T=1.5,top_k=4,top_p=0.95,eos=3": (Sampler(1.5, top_k=4, top_p=0.95), 3),
}
CASES = [("serial", "T=1"), ("linear", "T=1"), ("quadratic", "T=1"), ("packed", "T=1"),
         ("packed", "T=1.5,top_k=4,top_p=0.95,eos=3")]


@pytest.fixture(scope="module")
def laws():
    return {name: exact_law(s, eos) for name, (s, eos) in SETTINGS.items()}


_SAMPLES = {}


@pytest.mark.parametrize("schedule,setting", CASES)
def test_follows_serial_distribution(laws, schedule, setting):
    s, eos = SETTINGS[setting]
    law = laws[setting]
    if eos is not None:
        assert any(len(k) < L for k in law)  # the stop rule really acts
    samples = draw(schedule, s, eos)
    _SAMPLES[(schedule, setting)] = samples
    p = chi_square(samples, law)
    print(f"chi-square p-value {schedule:9s} {setting}: {p:.4f}")
    assert p > ALPHA


@pytest.mark.parametrize("branches,window", [(2, 3), (3, 4)])
def test_branched_follows_serial_distribution(laws, branches, window):
    """Branched-SS at T=1. W = 3, k = 2: in the second iteration the window holds two
    drafts and three ranks, and branch h = 1 drafts the third rank, which the third call
    verifies within the L = 4 tokens. W = 4, k = 3: branches h = 2 and h = 1, the second
    one's draft verified within the four tokens. The law is the serial one, and the draws
    differ from Packed-SS's with the same seeds (the branches' drafts are used)."""
    s = SETTINGS["T=1"][0]
    samples = draw("branched", s, window=window, branches=branches)
    p = chi_square(samples, laws["T=1"])
    print(f"chi-square p-value branched W={window} k={branches}: {p:.4f}")
    assert p > ALPHA
    assert samples[:FEW] != draw("packed", s, window=window, n=FEW)   # same seeds


def test_always_accept_is_caught(laws, monkeypatch):
    monkeypatch.setattr(sampling, "accept_ratio", lambda p_d, q_d: 1.0 + 0.0 * p_d)
    p = chi_square(draw("packed", SETTINGS["T=1"][0]), laws["T=1"])  # traced anew: broken
    print(f"negative control always_accept: p-value {p:.3g}")
    assert p < ALPHA


def test_power(laws):
    """The test detects a law at total-variation distance 0.02 from the true one."""
    rejections = tv_shift_rejections(laws["T=1"], N)
    print(f"power against a TV shift of 0.02: {rejections}/20 rejected")
    assert rejections >= 17


@pytest.mark.parametrize("schedule", ["packed"])
def test_seed_reproduces_and_batch_matches_single(schedule):
    key = (schedule, "T=1")
    batch = _SAMPLES[key] if key in _SAMPLES else draw(schedule, Sampler(1.0))
    for i in [0, 3]:
        runs = [ps.decode(MODEL, PROMPT, schedule=schedule, window=W, max_new_tokens=L,
                          eos_id=None, temperature=1.0, seed=SEED0 + i, cache_size=CAPACITY)
                for _ in range(2)]
        assert tuple(runs[0].tokens) == tuple(runs[1].tokens) == batch[i]
    assert len(set(batch[:200])) > 20  # different seeds, different samples


@pytest.mark.parametrize("schedule", ["linear", "quadratic", "packed"])
def test_temperature_zero_is_greedy(schedule):
    want = serial_ltr(MODEL, PROMPT, 6, [])
    for kw in [dict(), dict(top_k=2, top_p=0.5, seed=9)]:
        r = ps.decode(MODEL, PROMPT, schedule=schedule, window=W, max_new_tokens=6,
                      eos_id=None, temperature=0.0, cache_size=16, **kw)
        assert r.tokens == want


@pytest.mark.parametrize("schedule", ["serial", "linear", "quadratic", "packed"])
def test_the_sampled_program_at_temperature_zero_is_greedy(schedule):
    """A greedy request on the sampled program (the server's slots: temperature 0 as
    data) gives the serial reference's tokens."""
    engine = ps.Engine.of(MODEL)
    request = engine.request(PROMPT, ps.DecodeOptions(
        schedule=schedule, width=W, max_new_tokens=6, eos_id=None, cache_size=16), seed=9)
    shared = on_sampled_program(request)
    assert not shared.program.sampling.greedy
    assert engine.decode(shared).tokens == serial_ltr(MODEL, PROMPT, 6, [])


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=1.0, order="confidence"), "any-order sampling is not supported"),
    (dict(temperature=1.0, schedule="native"), "greedy only"),
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(temperature=1.0, top_k=0), "top_k must be an integer >= 1"),
    (dict(temperature=1.0, seed=-1), "seed must be an integer"),
])
def test_bad_sampling_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ps.decode(MODEL, PROMPT, max_new_tokens=2, cache_size=CAPACITY, **kwargs)
