"""SetDLM schedules against plain-loop references (greedy exactness, Prop. C.1, native)
and their row / NFE accounting against paper Table 2."""

import functools
import inspect

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import packed_ss_jax as ps
from packed_ss_jax import Model, ModelConfig
from packed_ss_jax import engine
from packed_ss_jax.setdlm import layouts
from packed_ss_jax.setdlm.state import Window
from setdlm_reference import native, serial_any_order, serial_ltr
from tiny import _params

W = 3
CACHE = 64
VOCAB = 12
MASK, EOS = VOCAB - 1, 1
PROPERTY = settings(max_examples=5, derandomize=True, deadline=None,
                    suppress_health_check=list(HealthCheck))


def tiny_setdlm_config() -> ModelConfig:
    return ModelConfig(family="setdlm", vocab_size=VOCAB, hidden_size=32, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48,
                       rms_norm_eps=1e-6, mask_token_id=MASK, eos_token_id=EOS, bos_token_id=0,
                       block_size=W, max_position_embeddings=256, rope_theta=10000.0,
                       qk_norm=True, tie_embeddings=True)


@functools.lru_cache(maxsize=None)
def tiny_setdlm(seed: int) -> Model:
    """A random SetDLM-shaped model (Qwen3 q/k norms, tied head) with peaked logits."""
    c = tiny_setdlm_config()
    return Model(config=c, params=_params(c, jax.random.PRNGKey(seed)), source=f"tiny({seed})")


cases = st.fixed_dictionaries({
    "seed": st.integers(0, 40),
    "prompt": st.lists(st.integers(0, VOCAB - 2), min_size=1, max_size=8),
    "length": st.integers(1, 20),
    # Multi-token markers over the few most common tokens, so they do get accepted.
    "markers": st.lists(st.lists(st.integers(2, 5), min_size=1, max_size=3), max_size=2),
    "eos": st.booleans(),
})


def _markers(case):
    return [list(m) for m in case["markers"]] + ([[EOS]] if case["eos"] else [])


def _decode(case, **kw):
    return ps.decode(tiny_setdlm(case["seed"]), case["prompt"], max_new_tokens=case["length"],
                     stop_sequences=case["markers"], eos_id=EOS if case["eos"] else None,
                     cache_size=CACHE, **kw)


# --- LTR: every schedule returns the serial one-token-at-a-time greedy output ------------

@pytest.mark.parametrize("schedule,window", [("serial", 1), ("linear", W), ("quadratic", W),
                                             ("packed", 1), ("packed", W), ("packed", 6),
                                             ("branched", W), ("branched", 6)])
@PROPERTY
@given(case=cases)
def test_ltr_is_the_serial_greedy_output(schedule, window, case):
    r = _decode(case, schedule=schedule, window=window)
    want = serial_ltr(tiny_setdlm(case["seed"]), case["prompt"], case["length"], _markers(case))
    assert r.tokens == want
    assert all(o == sorted(o) for o in r.orders)
    assert serial_any_order(tiny_setdlm(case["seed"]), case["prompt"], case["length"],
                            _markers(case), window, r) == want


# --- any order: the serial reference of Proposition C.1 for the schedule's own orders ----

@pytest.mark.parametrize("schedule,window", [("linear", W), ("quadratic", W), ("packed", W),
                                             ("packed", 6), ("branched", W)])
@PROPERTY
@given(case=cases)
def test_confidence_order_is_the_serial_reference(schedule, window, case):
    r = _decode(case, schedule=schedule, window=window, order="confidence")
    model = tiny_setdlm(case["seed"])
    # Branched-SS's scores come from Packed-SS's R or Quadratic-SS's branch, whichever
    # drafted: its orders are checked as orders of the window, its tokens as the reference's.
    want = serial_any_order(model, case["prompt"], case["length"], _markers(case), window, r,
                            policy=None if schedule == "branched" else schedule)
    assert r.tokens == want
    assert r.orders[0] == sorted(r.orders[0])  # no scores yet: textual order (E.6)


@pytest.mark.parametrize("order", ["ltr", "confidence"])
def test_branched_is_exact_for_every_number_of_branches(order):
    """k = 1 is Packed-SS's program, k = W gives every outcome but the last a branch."""
    for seed, prompt in [(0, [6, 2]), (1, [3, 5, 7, 2, 9, 4]), (2, [5, 5, 5, 1, 2])]:
        model = tiny_setdlm(seed)
        packed = ps.decode(model, prompt, schedule="packed", window=W, order=order,
                           max_new_tokens=20, eos_id=None, cache_size=CACHE)
        for k in range(1, W + 1):
            r = ps.decode(model, prompt, schedule="branched", branches=k, window=W, order=order,
                          max_new_tokens=20, eos_id=None, cache_size=CACHE)
            assert r.tokens == serial_any_order(model, prompt, 20, [], W, r), (seed, k)
            if order == "ltr":
                assert r.tokens == packed.tokens
            if k == 1:
                assert (r.nfe, r.orders, r.rows) == (packed.nfe, packed.orders, packed.rows)


def test_confidence_order_changes_the_verification_order():
    """Guard against a vacuous any-order test: some run checks out of textual order."""
    out_of_order = 0
    for seed in range(6):
        r = ps.decode(tiny_setdlm(seed), [2, 3, 4], schedule="packed", window=W,
                      order="confidence", max_new_tokens=20, eos_id=None, cache_size=CACHE)
        out_of_order += sum(o != sorted(o) for o in r.orders)
    assert out_of_order > 0


# --- the release's native decoder ----------------------------------------------------------

@PROPERTY
@given(case=cases)
def test_native_matches_the_plain_loop(case):
    r = _decode(case, schedule="native", window=W)
    want, nfe = native(tiny_setdlm(case["seed"]), case["prompt"], case["length"],
                       _markers(case), W)
    assert (r.tokens, r.nfe) == (want, nfe)


# --- stop markers (App. E.2) -----------------------------------------------------------------

def test_multi_token_marker_ends_the_output_at_its_last_token():
    model = tiny_setdlm(3)
    free = serial_ltr(model, [2, 3], 20, [])
    # A marker made of two consecutive generated tokens ends the output there; one that
    # is never completed does not stop anything.
    marker = free[5:7]
    first_end = min(i + 2 for i in range(len(free) - 1) if free[i: i + 2] == marker)
    for schedule in ("serial", "packed", "linear", "quadratic"):
        window = 1 if schedule == "serial" else W
        r = ps.decode(model, [2, 3], schedule=schedule, window=window, max_new_tokens=20,
                      eos_id=None, stop_sequences=[marker, [MASK - 1] * 3 + [0]],
                      cache_size=CACHE)
        assert r.tokens == free[:first_end], schedule


# --- Table 2: NFE and rows per call ------------------------------------------------------------

ROWS = {  # uncached rows of one iteration, from p = |N| and u = |U_t| (paper Table 2)
    "serial": (1, lambda p, u: p + 1, lambda p, u: p + 1),
    "native": (1, lambda p, u: p + u, lambda p, u: p + u),
    "linear": (2, lambda p, u: p + 3 * u, lambda p, u: max(p + u, 2 * u)),
    "quadratic": (1, lambda p, u: p + 2 * u + u * u, lambda p, u: p + 2 * u + u * u),
    "packed": (1, lambda p, u: p + 3 * u, lambda p, u: p + 3 * u),
}


@pytest.mark.parametrize("schedule", sorted(ROWS))
def test_rows_and_nfe_follow_table_2(schedule):
    window = 1 if schedule == "serial" else W
    r = ps.decode(tiny_setdlm(5), [4, 2, 7, 3], schedule=schedule, window=window,
                  max_new_tokens=20, eos_id=None, cache_size=CACHE)
    calls, rows, call_rows = ROWS[schedule]
    ps_ = [0] + r.fed[:-1]  # p_t: what the previous iteration left to feed
    us = [len(o) for o in r.orders]
    assert r.nfe == 1 + calls * r.iterations  # the prompt call counts (App. E.2)
    assert r.rows == sum(rows(p, u) for p, u in zip(ps_, us))
    assert r.max_rows == max(call_rows(p, u) for p, u in zip(ps_, us))
    assert len(r.tokens) == 20 and sum(r.accepted) >= 20
    if schedule in ("linear", "quadratic", "packed"):
        assert us[0] == W and ps_[0] == 0 and r.iterations < 20  # speculation pays off


def test_worked_example_packed_iterations():
    """Packed-SS, W = 3, prompt of 4: the first call has no draft (A_1 = 1, 9 rows); a
    later call with a correction to feed and a full window evaluates 1 + 3W = 10 rows."""
    r = ps.decode(tiny_setdlm(5), [4, 2, 7, 3], schedule="packed", window=W, max_new_tokens=20,
                  eos_id=None, cache_size=CACHE)
    assert r.orders[0] == [0, 1, 2] and r.accepted[0] == 1 and r.fed[0] == 1
    assert r.orders[1] == [1, 2, 3]  # the window slides to the left-most unresolved position
    assert r.max_rows == 1 + 3 * W


@pytest.mark.parametrize("w,linear,quadratic,packed", [(8, 16, 81, 25), (16, 32, 289, 49)])
def test_maximum_rows_per_call(w, linear, quadratic, packed):
    """App. F.5: maximum rows/call (u = W, p = 1) for W = 8 and 16."""
    full = Window(np.arange(w), np.ones(w, bool), np.ones(w, bool))
    args = (10, 5, 0, 1, full)
    d = np.zeros(w, np.int32)

    def rows(f):  # shapes only: nothing is computed
        return jax.eval_shape(f).tokens.shape[0]

    assert rows(lambda: layouts.packed(*args, d, MASK)) == packed
    assert rows(lambda: layouts.quadratic(*args, d, MASK)) == quadratic
    assert max(rows(lambda: layouts.draft(*args, MASK)),
               rows(lambda: layouts.verify(10, full, d, MASK))) == linear


# --- compile once ------------------------------------------------------------------------------

def test_second_decode_does_not_recompile():
    """A new prompt, length limit and stop markers reuse the model's compiled program."""
    model = tiny_setdlm(0)
    first = ps.decode(model, [1, 2, 3], schedule="packed", window=W,
                      max_new_tokens=9, cache_size=CACHE)
    r = ps.decode(model, [4, 5, 6, 7, 8, 9], schedule="packed", window=W,
                  max_new_tokens=17, stop_sequences=[[2, 3]], eos_id=None, cache_size=CACHE)
    assert r.compile_s == 0.0
    assert len(first.tokens) >= 1


# --- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(order="random"), "unknown order 'random'"),
    (dict(window=0), "window must be an integer >= 1"),
    (dict(window=2.5), "window must be an integer >= 1"),
    (dict(stop_sequences=[[]]), "empty stop sequence"),
    (dict(stop_sequences=[[2, 99]]), r"stop sequence: ids outside the vocabulary"),
    (dict(stop_sequences=[[2] * 17]), "longer than 16"),
    (dict(stop_sequences=[[2]] * 8), "9 stop markers"),
    (dict(stop_sequences=["ab"]), "no tokenizer"),
    (dict(schedule="native", order="confidence"), "has no verification order"),
    (dict(schedule="ar"), "unknown schedule 'ar' for SetDLM"),
    (dict(block_size=4), "take window="),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(max_new_tokens=70), "exceeds the cache"),
])
def test_bad_arguments(kwargs, match):
    kwargs = {"cache_size": CACHE, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        ps.decode(tiny_setdlm(0), [1, 2, 3], **kwargs)


def test_unsupported_sampling_is_refused():
    if "temperature" not in inspect.signature(ps.decode).parameters:
        pytest.skip("this decode has no sampling arguments")
    with pytest.raises(ValueError, match="any-order sampling is not supported"):
        ps.decode(tiny_setdlm(0), [1, 2, 3], temperature=1.0, order="confidence",
                  cache_size=CACHE)
    with pytest.raises(ValueError, match="greedy only"):
        ps.decode(tiny_setdlm(0), [1, 2, 3], schedule="native", temperature=1.0,
                  cache_size=CACHE)


def test_setdlm_arguments_are_refused_for_nemotron():
    from tiny import tiny_config

    nemotron = Model(config=tiny_config(), params=None)  # refused before any computation
    with pytest.raises(ValueError, match="models take block_size=, not window="):
        ps.decode(nemotron, [1, 2, 3], window=4)
    with pytest.raises(ValueError, match="verify in one order only"):
        ps.decode(nemotron, [1, 2, 3], order="confidence")
    setdlm = Model(config=tiny_setdlm_config(), params=None)
    with pytest.raises(ValueError, match="SetDLM models take window=, not block_size="):
        ps.decode(setdlm, [1, 2, 3], block_size=4)


# Cases where a step accepts positions past a marker that ends earlier while earlier
# positions are still unresolved: those entries must leave the context (Alg. 3 line 12)
# for the remaining calls. Found by search: in each the output changes if they stay.
PAST_THE_END = [(26, [5], [2]), (0, [9], [4]), (38, [5, 7, 4, 4], [4])]


@pytest.mark.parametrize("seed,prompt,marker", PAST_THE_END)
def test_entries_past_the_end_leave_the_context(seed, prompt, marker):
    r = ps.decode(tiny_setdlm(seed), prompt, schedule="native", window=W, max_new_tokens=16,
                  stop_sequences=[marker], eos_id=None, cache_size=CACHE)
    want, nfe = native(tiny_setdlm(seed), prompt, 16, [marker], W)
    assert (r.tokens, r.nfe) == (want, nfe)
    assert len(r.tokens) < 16 and r.tokens[-1] == marker[-1]
