"""The jitted while_loop decode equals a plain Python loop of Algorithm 1 (no cache, no jit),
and NFE accounting matches SPEC.md on hand-worked examples."""

import numpy as np
import pytest

import packed_ss_jax as ps
import reference
from synthetic import model_for
from tiny import tiny_model


@pytest.mark.parametrize("schedule", ["packed", "linear", "quadratic", "ar"])
@pytest.mark.parametrize("seed,B,L,eos", [
    (0, 3, 19, None), (1, 5, 25, 3), (2, 3, 30, None), (3, 2, 12, 5),
])
def test_engine_equals_python_loop(schedule, seed, B, L, eos):
    model = tiny_model(seed)
    prompt = np.random.default_rng(seed).integers(0, model.vocab_size - 1, size=5 + seed).tolist()
    want = reference.REFERENCES[schedule](model, prompt, B, L, eos)
    got = ps.decode(model, prompt, schedule=schedule, block_size=B, max_new_tokens=L, eos_id=eos)
    assert got.tokens == want.out
    assert got.nfe == want.nfe
    assert got.iterations == len(want.emitted)
    assert got.accept_hist.tolist() == np.bincount(want.emitted, minlength=len(got.accept_hist)).tolist()


# Hand-worked accounting on a drafter that is always right (synthetic model).
ORACLE = model_for(np.ones((65, 65), bool), vocab=24, prompt_len=3)
PROMPT = [3, 4, 5]


def run(schedule, B, L, eos=None):
    return ps.decode(ORACLE, PROMPT, schedule=schedule, block_size=B, max_new_tokens=L,
                     eos_id=eos, cache_size=128)


@pytest.mark.parametrize("schedule", ["ar", "linear", "quadratic", "packed"])
def test_first_call_alone(schedule):
    """L = 1: the prompt call yields the only token and counts as one NFE."""
    r = run(schedule, 4, 1)
    assert (len(r.tokens), r.nfe, r.iterations) == (1, 1, 1)


def test_packed_hand_worked():
    """B = 4, W = 3. Call 1: token 1 + draft of positions 2..4. Call 2 accepts 3 + bonus
    (c = 5) and its proposals (from context 1, positions 2..4) are all consumed, so the
    draft is empty. Call 3: bonus only (c = 6), proposals 7, 8 kept. Call 4: 2 + bonus (9).
    Call 5: bonus (10). Call 6 would reach 13: pruned to L = 12."""
    r = run("packed", 4, 12)
    assert r.nfe == 6 and len(r.tokens) == 12
    assert r.accept_hist.tolist() == [0, 3, 1, 1, 1]  # emitted 1, 4, 1, 3, 1, 2


def test_linear_hand_worked():
    r = run("linear", 4, 12)  # prefill 1, then 4 + 4 + 3 (pruned): 1 + 2 x 3 calls
    assert r.nfe == 7 and r.accept_hist.tolist() == [0, 1, 0, 1, 2]


def test_quadratic_hand_worked():
    r = run("quadratic", 4, 9)  # first call 1, then 4 + 4: the branch keeps a full draft
    assert r.nfe == 3 and r.accept_hist.tolist() == [0, 1, 0, 0, 2]


def test_ar_counts_one_call_per_token():
    r = run("ar", 4, 7)
    assert r.nfe == 7 and r.accept_hist.tolist() == [0, 7]


def test_eos_inside_an_accepted_run():
    """Packed call 2 accepts output positions 2..5; EOS at position 3 prunes 4 and 5."""
    full = run("packed", 4, 12).tokens
    eos = full[2]
    assert eos not in full[:2]
    r = run("packed", 4, 12, eos=eos)
    assert r.tokens == full[:3]
    assert r.nfe == 2 and r.accept_hist.tolist() == [0, 1, 1, 0, 0]
    lin = run("linear", 4, 12, eos=eos)  # prefill + one iteration (accepts 4, keeps 2)
    assert lin.tokens == full[:3] and lin.nfe == 3


def test_eos_as_first_token():
    first = run("ar", 4, 1).tokens[0]
    for schedule in ["ar", "linear", "quadratic", "packed"]:
        r = run(schedule, 4, 10, eos=first)
        assert (r.tokens, r.nfe) == ([first], 1)
