"""One compile per (schedule, block size, bucket): counts, lengths and EOS are traced."""

import jax
import pytest

import packed_ss_jax as ps
from packed_ss_jax import engine
from tiny import tiny_model

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@pytest.fixture
def compiles(no_compile_cache):
    events = []

    def listener(name, *args, **kwargs):
        if name == BACKEND_COMPILE:
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield events
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("schedule", ["ar", "linear", "quadratic", "packed"])
def test_second_decode_does_not_recompile(schedule, compiles):
    model = tiny_model(0)
    engine.clear_cache()
    first = ps.decode(model, [1, 2, 3], schedule=schedule, block_size=3, max_new_tokens=9)
    assert first.compile_s > 0
    assert len(compiles) >= 1
    compiles.clear()
    # Another prompt in the same bucket (<= 16 tokens), another length, another EOS,
    # other weights of the same config.
    other = tiny_model(1)
    r = ps.decode(other, [4, 5, 6, 7, 8, 9, 1, 2], schedule=schedule, block_size=3,
                  max_new_tokens=23, eos_id=4)
    assert r.compile_s == 0.0
    assert compiles == []
    assert len(engine._compiled) == 1


def test_new_bucket_compiles_once(compiles):
    model = tiny_model(0)
    engine.clear_cache()
    ps.decode(model, list(range(1, 10)), schedule="packed", block_size=3, max_new_tokens=5)
    ps.decode(model, list(range(1, 11)) * 2, schedule="packed", block_size=3, max_new_tokens=5)
    ps.decode(model, list(range(1, 11)) * 3, schedule="packed", block_size=3, max_new_tokens=7)
    assert len(engine._compiled) == 2  # buckets 16 and 32
    assert engine.bucket_for(20, 256) == engine.bucket_for(30, 256) == 32
