"""Theorem 3.2: under Assumption 3.1, NFE(Packed-SS) <= NFE(Linear-SS) for every length."""

import numpy as np
import pytest

import packed_ss_jax as ps
from synthetic import arbitrary_table, model_for, monotone_table

PROMPT = [3, 4, 5]
MAX_OUT = 40


def nfe(model, schedule, B, L, eos=None):
    r = ps.decode(model, PROMPT, schedule=schedule, block_size=B, max_new_tokens=L, eos_id=eos,
                  cache_size=128)
    return r


@pytest.mark.parametrize("B", [2, 4, 8])
def test_packed_never_needs_more_calls_than_linear(B):
    rng = np.random.default_rng(B)
    for _ in range(12):
        model = model_for(monotone_table(rng, MAX_OUT + B + 2), vocab=24, prompt_len=len(PROMPT))
        for L in range(1, 25):
            packed, linear = nfe(model, "packed", B, L), nfe(model, "linear", B, L)
            assert packed.tokens == linear.tokens
            assert packed.nfe <= linear.nfe, (B, L, packed.nfe, linear.nfe)


def test_bound_holds_with_eos_stopping():
    rng = np.random.default_rng(7)
    for _ in range(10):
        model = model_for(monotone_table(rng, MAX_OUT + 10), vocab=24, prompt_len=len(PROMPT))
        ar = nfe(model, "ar", 2, 30).tokens
        eos = ar[int(rng.integers(0, 30))]  # a token the continuation really contains
        packed, linear = nfe(model, "packed", 4, 30, eos), nfe(model, "linear", 4, 30, eos)
        assert packed.tokens == linear.tokens == ar[: ar.index(eos) + 1]
        assert packed.nfe <= linear.nfe


def test_synthetic_model_is_what_it_claims():
    """All-correct drafter: every speculative call accepts the full draft plus a bonus."""
    table = np.ones((MAX_OUT + 1, MAX_OUT + 1), bool)
    model = model_for(table, vocab=24, prompt_len=len(PROMPT))
    r = nfe(model, "linear", 4, 21)
    assert r.nfe == 1 + 2 * 5 and r.accept_hist[4] == 5  # 1 + 5 x 4 tokens
    none = model_for(np.zeros_like(table), vocab=24, prompt_len=len(PROMPT))
    assert nfe(none, "packed", 4, 10).nfe == 10  # nothing accepted: one token per call


def test_inequality_fails_without_the_assumption():
    """A drafter right from context 0 (position 2) and from context 2, wrong elsewhere.

    Linear-SS visits contexts 1, 2, 10: its context-2 draft is all correct.
    Packed-SS accepts position 2 from its first-call draft, jumps to context 3 and
    never drafts from context 2, so it crawls one token per call.
    """
    B = 8
    table = np.zeros((MAX_OUT + 1, MAX_OUT + 1), bool)
    table[2, 0] = True
    table[3:10, 2] = True
    model = model_for(table, vocab=24, prompt_len=len(PROMPT))
    packed, linear = nfe(model, "packed", B, 10), nfe(model, "linear", B, 10)
    assert packed.tokens == linear.tokens
    assert linear.nfe == 5
    assert packed.nfe == 9
    # The table breaks Assumption 3.1: position 2 is correct at context 0, wrong at 1.
    assert table[2, 0] and not table[2, 1]
    # Random non-monotone tables also break it, found by search.
    rng = np.random.default_rng(0)
    broken = 0
    for _ in range(40):
        t = arbitrary_table(rng, MAX_OUT, p=0.15)
        t[:, 2] = rng.random() < 0.5  # some contexts draft whole blocks right
        m = model_for(t, vocab=24, prompt_len=len(PROMPT))
        broken += nfe(m, "packed", B, 12).nfe > nfe(m, "linear", B, 12).nfe
    assert broken > 0
