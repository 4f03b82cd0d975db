"""Decode programs at the Nemotron 3B shape in bf16, compiled on abstract params.

No weight is allocated: the params are `jax.ShapeDtypeStruct`s (3.8B of them), and the
checks read the compiled programs (the HLO text and XLA's memory analysis) on this
machine's backend. Each program is compiled once and shared by the checks.

What they guard: a backend that widens bf16 dots to float32 (XLA's CPU) used to get a
float32 copy of every weight, hoisted out of the decode loop and carried through it
(15 GB of temporaries for this shape); the bf16 cache write used to convert the whole
buffer to float32 and back in every layer of every step.
"""

import jax
import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import cache as cache_lib, inspection
from packed_ss_jax import model as model_lib
from packed_ss_jax.model import Model
from tools.synthetic_checkpoint import model_config
from hlo import USER_CODEGEN, body_results, hlo_dtype, loop_state, rebuilt

B = 32
ITEMSIZE = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "u16": 2, "s16": 2, "pred": 1,
            "u8": 1, "s8": 1}
CAPACITY = model_lib.LIVE_MIN_POSITIONS  # long enough for the live-length read, where used


@pytest.fixture(scope="module")
def model():
    c = model_config("3B", "bfloat16")
    params = jax.eval_shape(model_lib.unstack_layers, model_lib.abstract_params(c))
    return Model(config=c, params=params, source="abstract 3B")


@pytest.fixture(scope="module", params=["packed", "ar"])
def program(request, model):
    engine = ps.Engine(model)
    req = engine.request([1], ps.DecodeOptions(schedule=request.param, width=B,
                                               cache_size=CAPACITY, max_new_tokens=1))
    exe = inspection.lower(engine, req).compile(USER_CODEGEN)  # the HLO a user's process compiles
    return request.param, exe, exe.as_text()


def _bytes(leaves):
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)


def _cache(model, name):
    c = model.config
    # capacity + one block of headroom (cache.py); AR's block is one row
    shape = (c.num_kv_heads, CAPACITY + (1 if name == "ar" else B), c.head_dim)
    stored = cache_lib.storage_dtype(model_lib.param_dtype(c))
    return shape, stored, 2 * c.num_layers * int(np.prod(shape)) * np.dtype(stored).itemsize


def test_config_is_the_3b_release(model):
    c = model.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, c.vocab_size) == (3072, 26, 32, 8, 128, 9216, 131072)
    assert 3.8e9 < sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.params)) < 3.9e9


def test_loop_carries_no_float32_weights(model, program):
    name, _, hlo = program
    leaves = jax.tree.leaves(model.params)
    matrices = {tuple(x.shape) for x in leaves if len(x.shape) == 2}
    matrices |= {s[::-1] for s in matrices}
    state = loop_state(hlo)
    widened = [s for s in state if s[0] == "f32" and s[1] in matrices]
    assert not widened, f"{name}: float32 weight copies in the loop state: {widened}"
    # Nothing weight-sized besides the weights and the cache travels with the loop.
    carried = sum(int(np.prod(dims)) * ITEMSIZE[t] for t, dims in state)
    limit = _bytes(leaves) + _cache(model, name)[2] + 64 * 2**20
    assert carried < limit, f"{name}: {carried} bytes"


def test_memory_analysis(model, program):
    name, exe, _ = program
    mem = exe.memory_analysis()
    weights = _bytes(jax.tree.leaves(model.params))
    assert weights <= mem.argument_size_in_bytes < weights + 2**20
    # Temporaries: the cache and one call's activations and logits. Before, every weight
    # had a float32 copy (1.9x the weights' bytes).
    assert mem.temp_size_in_bytes < _cache(model, name)[2] + weights // 16, (
        f"{name}: {mem.temp_size_in_bytes / 1e9:.2f} GB of temporaries")


def test_cache_written_in_place(model, program):
    name, _, hlo = program
    shape, stored, _ = _cache(model, name)
    state = loop_state(hlo)
    assert state.count((hlo_dtype(stored), shape)) == 2 * model.config.num_layers, name
    bad = rebuilt(body_results(hlo), shape)
    assert not bad, f"{name}: the decode loop rebuilds the cache: {bad[:4]}"


def test_attention_reads_live_chunks(model, program):
    """Where attention reads the live part only (model.attend), the cache buffers are read
    through chunk-sized slices, never whole: what a step reads grows with the live
    length (one chunk per CHUNK live slots), not with the capacity."""
    if jax.default_backend() not in model_lib.LIVE_ATTENTION:
        pytest.skip("this backend reads the whole cache buffer")
    name, _, hlo = program
    c = model.config
    shape, _, _ = _cache(model, name)
    chunks = [dims for _, _, dims, op in body_results(hlo) if op == "dynamic-slice"
              and len(dims) == 3 and dims[0] == c.num_kv_heads and dims[2] == c.head_dim]
    assert len(chunks) >= 2 * c.num_layers, f"{name}: {len(chunks)} chunk reads"
    assert all(dims[1] <= model_lib.CHUNK < shape[1] for dims in chunks), chunks[:4]
