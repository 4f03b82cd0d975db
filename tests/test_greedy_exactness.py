"""Every schedule returns exactly the AR greedy tokens."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import packed_ss_jax as ps
from tiny import tiny_model

SPECULATIVE = ["linear", "quadratic", "packed", "branched"]


@pytest.mark.parametrize("schedule", ["ar"] + SPECULATIVE)
@pytest.mark.parametrize("B", [2, 3, 5, 8])
def test_fixture_greedy_continuation(nemotron, nemotron_ref, schedule, B):
    if schedule == "ar" and B != 2:
        pytest.skip("AR has no block size")
    want = nemotron_ref["greedy_continuation"].tolist()
    r = ps.decode(nemotron, nemotron_ref["greedy_prompt"].tolist(), schedule=schedule,
                  block_size=B, max_new_tokens=len(want), eos_id=None)
    assert r.tokens == want


@pytest.mark.parametrize("schedule", SPECULATIVE)
def test_fixture_with_draft_adapter(nemotron_lora, nemotron_ref, schedule):
    """The LoRA changes drafts only; the output is still the base model's AR output."""
    want = nemotron_ref["greedy_continuation"].tolist()
    r = ps.decode(nemotron_lora, nemotron_ref["greedy_prompt"].tolist(), schedule=schedule,
                  block_size=4, max_new_tokens=len(want), eos_id=None)
    assert r.tokens == want


BLOCKS = [2, 3, 5]  # few distinct shapes: each (schedule, B) is one compile


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), B=st.sampled_from(BLOCKS), prompt_len=st.integers(1, 14),
       L=st.integers(1, 40), eos_pick=st.integers(-1, 40), data=st.data())
def test_speculative_equals_ar(seed, B, prompt_len, L, eos_pick, data):
    model = tiny_model(seed)
    vocab = model.vocab_size
    prompt = data.draw(st.lists(st.integers(0, vocab - 2), min_size=prompt_len,
                                max_size=prompt_len))
    free = ps.decode(model, prompt, schedule="ar", max_new_tokens=L, eos_id=None).tokens
    assert len(free) == L
    # EOS: none, or a token the free-running continuation really produces.
    eos = None if eos_pick < 0 else free[eos_pick % L]
    want = free if eos is None else free[: free.index(eos) + 1]
    assert ps.decode(model, prompt, schedule="ar", max_new_tokens=L, eos_id=eos).tokens == want
    # Branched-SS at two branches and at one per outcome (k = B).
    runs = [(s, {}) for s in SPECULATIVE] + [("branched", {"branches": B})]
    for schedule, extra in runs:
        r = ps.decode(model, prompt, schedule=schedule, block_size=B, max_new_tokens=L,
                      eos_id=eos, **extra)
        assert r.tokens == want, (schedule, extra)
        assert int((np.arange(len(r.accept_hist)) * r.accept_hist).sum()) == len(want)
        assert r.accept_hist.sum() == r.iterations
