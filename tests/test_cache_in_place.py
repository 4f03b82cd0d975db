"""The decode loop reads and writes the KV cache where it lies, in every dtype.

Inside the compiled decode loop, no instruction may make a buffer of a cache layer's
shape (in any dtype) except the commit's in-place dynamic-update-slice: no copy,
transpose, convert or whole-buffer rewrite. (A copy of the whole cache per step cost
more than the forward itself on small models; in bf16, a write that converted the
buffer to float32 and back moved the whole cache twice per layer and step.)
"""

import dataclasses

import pytest

import packed_ss_jax as ps
from packed_ss_jax import cache as cache_lib
from packed_ss_jax import model as model_lib, scheduler
from packed_ss_jax.api import decode_options
from packed_ss_jax.programs import Key
from packed_ss_jax.sampling import Sampler
from hlo import body_results, hlo_dtype, loop_state, rebuilt
from tiny import tiny_model

# Every program here is compiled as a user's process compiles it (conftest.user_codegen).
pytestmark = pytest.mark.usefixtures("user_codegen")

CAPACITY = 96
# bf16 programs get a cache long enough for the live-length read (model.attend), where
# this backend uses it: that is the read checked.
BF16_CAPACITY = model_lib.LIVE_MIN_POSITIONS


def _options(engine, width, **options) -> ps.DecodeOptions:
    return ps.DecodeOptions(width=width, **options)


def _slots(family, p) -> int:
    """The cache slots a program holds: capacity plus the headroom its family keeps
    (Nemotron: one block, B = 1 for AR, see cache.py; SetDLM: 2W + 2, see
    setdlm/program.py)."""
    return p.capacity + (p.width if family.width_counts_x else 2 * p.width + 2)


def compiled(m, prompt, width, **options):
    """The compiled decode program of a request (the one `decode` runs), and the cache
    slots it holds."""
    engine = ps.Engine.of(m)
    request = engine.request(prompt, _options(engine, width, **options))
    engine.decode(request)
    return engine.executables()[Key("decode", request.program)].as_text(), _slots(
        engine.family, request.program)


@pytest.mark.parametrize("schedule", ["ar", "linear", "quadratic", "packed"])
@pytest.mark.parametrize("sampler", [Sampler(), Sampler(temperature=1.0)], ids=["greedy", "t1"])
def test_decode_loop_never_copies_the_cache(schedule, sampler):
    m = tiny_model(0)
    B = 4
    hlo, slots = compiled(m, [1, 2, 3], schedule=schedule, width=B, cache_size=CAPACITY,
                          max_new_tokens=8, temperature=sampler.temperature)
    _check(hlo, m.config, slots, schedule)


@pytest.mark.parametrize("schedule", ["ar", "linear", "quadratic", "packed"])
def test_bf16_decode_loop_never_copies_the_cache(schedule):
    m = tiny_model(0, dtype="bfloat16")
    B = 4
    hlo, slots = compiled(m, [1, 2, 3], schedule=schedule, width=B, cache_size=BF16_CAPACITY,
                          max_new_tokens=8)
    _check(hlo, m.config, slots, schedule)


def _check(hlo: str, c, slots: int, schedule: str, batch: tuple[int, ...] = ()) -> None:
    shape = batch + (c.num_kv_heads, slots, c.head_dim)
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
    from test_setdlm_decode import tiny_setdlm

    m = tiny_setdlm(0)
    hlo, slots = compiled(m, [3, 4, 5, 6], schedule=schedule, order=order, width=3,
                          max_new_tokens=20, cache_size=64, temperature=temperature)
    _check(hlo, m.config, slots, schedule)


def test_setdlm_bf16_loop_never_copies_the_cache():
    import jax

    from packed_ss_jax import Model
    from test_setdlm_decode import tiny_setdlm_config
    from tiny import _params

    c = tiny_setdlm_config().replace(dtype="bfloat16")
    m = Model(config=c, params=_params(c, jax.random.PRNGKey(0)), source="tiny bf16")
    hlo, slots = compiled(m, [3, 4, 5, 6], schedule="packed", order="confidence", width=3,
                          max_new_tokens=20, cache_size=BF16_CAPACITY)
    _check(hlo, c, slots, "setdlm packed")


@pytest.mark.parametrize("family", ["nemotron", "setdlm"])
def test_batched_loop_never_copies_the_cache(family):
    """The batched loop (`generate`, batched.py) of a sampled Packed-SS batch, the programs of
    tests/test_batched.py: one [N, kv_heads, slots, head_dim] buffer per layer, written in
    place by the step's scatter, finished sequences included."""
    from test_batched import MAX_NEW, SEEDS, SETUPS

    setup = SETUPS[family]
    m = setup["model"]()
    engine = ps.Engine.of(m)
    batch = engine.batch(setup["prompts"], decode_options(
        engine.family, schedule="packed", max_new_tokens=MAX_NEW, temperature=1.0,
        **setup["options"]), seed=SEEDS)
    scheduler.decode_batch(engine, batch)
    n = len(batch.members)
    slot_program = dataclasses.replace(batch.program, bucket=0)
    exe = engine.executables()[Key("generate", slot_program, n)]
    _check(exe.as_text(), m.config, _slots(engine.family, batch.program),
           f"batched {family} packed", batch=(n,))
