"""The decode loop reads and writes the KV cache where it lies, in every dtype.

Inside the compiled decode loop, no instruction may make a buffer of a cache layer's
shape (in any dtype) except the commit's in-place dynamic-update-slice: no copy,
transpose, convert or whole-buffer rewrite. (A copy of the whole cache per step cost
more than the forward itself on small models; in bf16, a write that converted the
buffer to float32 and back moved the whole cache twice per layer and step.)
"""

import pytest

from packed_ss_jax import cache as cache_lib
from packed_ss_jax import engine
from packed_ss_jax import model as model_lib
from packed_ss_jax.sampling import Sampler
from hlo import body_results, hlo_dtype, loop_state, rebuilt
from tiny import tiny_model

CAPACITY = 96
# bf16 programs get a cache long enough for the live-length read (model.attend), where
# this backend uses it: that is the read checked.
BF16_CAPACITY = model_lib.LIVE_MIN_SLOTS


@pytest.mark.parametrize("schedule", ["ar", "linear", "quadratic", "packed"])
@pytest.mark.parametrize("sampler", [Sampler(), Sampler(temperature=1.0)], ids=["greedy", "t1"])
def test_decode_loop_never_copies_the_cache(schedule, sampler):
    m = tiny_model(0)
    B = 4
    p = engine.Program(schedule, B, 16, CAPACITY, sampler)
    exe, _ = engine.compiled(m, m.params, p)
    # The cache holds capacity + B slots (one block of headroom, see cache.py).
    _check(exe.as_text(), m.config, CAPACITY + B, schedule)


@pytest.mark.parametrize("schedule", ["ar", "linear", "quadratic", "packed"])
def test_bf16_decode_loop_never_copies_the_cache(schedule):
    m = tiny_model(0, dtype="bfloat16")
    B = 4
    p = engine.Program(schedule, B, 16, BF16_CAPACITY, Sampler())
    exe, _ = engine.compiled(m, m.params, p)
    _check(exe.as_text(), m.config, BF16_CAPACITY + B, schedule)


def _check(hlo: str, c, slots: int, schedule: str) -> None:
    shape = (c.num_kv_heads, slots, c.head_dim)
    stored = hlo_dtype(cache_lib.storage_dtype(model_lib.param_dtype(c)))
    state = loop_state(hlo)
    assert state.count((stored, shape)) == 2 * c.num_layers, (
        f"{schedule}: the loop does not carry one {stored}{list(shape)} buffer per layer "
        f"for k and v: {state}")
    bad = rebuilt(body_results(hlo), shape)
    assert not bad, f"{schedule}: the decode loop rebuilds the cache: {bad}"


SETDLM_CASES = [("serial", "ltr", 0.0), ("native", "ltr", 0.0), ("linear", "confidence", 0.0),
                ("quadratic", "confidence", 0.0), ("packed", "confidence", 0.0),
                ("linear", "ltr", 1.0), ("packed", "ltr", 1.0)]


@pytest.mark.parametrize("schedule,order,temperature", SETDLM_CASES)
def test_setdlm_loop_never_copies_the_cache(schedule, order, temperature):
    from packed_ss_jax.setdlm import decode as setdlm_decode
    from test_setdlm_decode import tiny_setdlm

    m = tiny_setdlm(0)
    W, cache_size = 3, 64
    setdlm_decode.decode(m, [3, 4, 5, 6], schedule=schedule, order=order, window=W,
                         max_new_tokens=20, cache_size=cache_size, temperature=temperature)
    p, exe = next((key[2], exe) for key, exe in reversed(engine._compiled.items())
                  if key[0] == "setdlm" and key[2].schedule == schedule
                  and key[2].order == order and key[2].sampler.temperature == temperature)
    # The buffer holds capacity + 2W + 2 slots (see setdlm/decode.py; serial runs W = 1).
    _check(exe.as_text(), m.config, p.capacity + 2 * p.window + 2, schedule)


def test_setdlm_bf16_loop_never_copies_the_cache():
    import jax

    from packed_ss_jax import Model
    from packed_ss_jax.setdlm import decode as setdlm_decode
    from test_setdlm_decode import tiny_setdlm_config
    from tiny import _params

    c = tiny_setdlm_config().replace(dtype="bfloat16")
    m = Model(config=c, params=_params(c, jax.random.PRNGKey(0)), source="tiny bf16")
    W = 3
    setdlm_decode.decode(m, [3, 4, 5, 6], schedule="packed", order="confidence", window=W,
                         max_new_tokens=20, cache_size=BF16_CAPACITY)
    p, exe = next((key[2], exe) for key, exe in reversed(engine._compiled.items())
                  if key[0] == "setdlm" and key[1] == m.key and key[2].schedule == "packed")
    _check(exe.as_text(), c, p.capacity + 2 * p.window + 2, "setdlm packed")
