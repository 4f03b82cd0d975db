"""One compile per (schedule, block size, bucket): counts, lengths and EOS are traced, and
so are the sampling values (temperature, top-p): one sampled program serves them all."""

import jax
import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import options
from packed_ss_jax.engine import arguments, to_host
from packed_ss_jax.programs import Key
from test_setdlm_decode import tiny_setdlm
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


def _decodes(engine) -> list:
    """The engine's compiled one-shot decode programs."""
    return [k[1] for k in engine.executables() if k[0] == "decode"]


@pytest.mark.parametrize("schedule", ["ar", "linear", "quadratic", "packed"])
def test_second_decode_does_not_recompile(schedule, compiles):
    model = tiny_model(0)
    engine = ps.Engine(model)  # a fresh engine: nothing compiled yet
    first = engine.decode(engine.request([1, 2, 3], ps.DecodeOptions(
        schedule=schedule, width=3, max_new_tokens=9)))
    assert first.compile_s > 0
    assert len(compiles) >= 1
    compiles.clear()
    # Another prompt in the same bucket (<= 16 tokens), another length, another EOS.
    request = engine.request([4, 5, 6, 7, 8, 9, 1, 2], ps.DecodeOptions(
        schedule=schedule, width=3, max_new_tokens=23, eos_id=4))
    r = engine.decode(request)
    assert r.compile_s == 0.0
    assert compiles == []
    assert list(engine.executables()) == [Key("decode", request.program)]
    # Other weights of the same config: the compiled program takes the params as an
    # argument, so it runs them as it is, and gives their own decode.
    other = tiny_model(1)
    exe = engine.executables()[Key("decode", request.program)]
    out = to_host(exe(other.params, *arguments(request)))
    assert compiles == []
    want = ps.Engine(other).decode(request)
    assert np.asarray(out["tokens"])[: int(out["n_tokens"])].tolist() == want.tokens
    assert int(out["nfe"]) == want.nfe


def test_new_bucket_compiles_once(compiles):
    model = tiny_model(0)
    engine = ps.Engine.of(model)
    # `decode` uses the engine kept with the model, whose programs other tests of this
    # config may have compiled already: count the ones these decodes add.
    before = set(engine.executables())
    ps.decode(model, list(range(1, 10)), schedule="packed", block_size=3, max_new_tokens=5)
    ps.decode(model, list(range(1, 11)) * 2, schedule="packed", block_size=3, max_new_tokens=5)
    ps.decode(model, list(range(1, 11)) * 3, schedule="packed", block_size=3, max_new_tokens=7)
    added = [k for k in engine.executables() if k not in before]
    assert sorted(k[1].bucket for k in added if k[0] == "decode") == [16, 32]
    assert len(added) == 2
    assert options.bucket_for(20, 256) == options.bucket_for(30, 256) == 32


# Ten temperatures, each with its own top-p (all below 1, so every one truncates).
TEMPERATURES = [0.05, 0.2, 0.4, 0.6, 0.8, 1.0, 1.5, 2.0, 4.0, 10.0]
TOP_PS = [0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95]
SAMPLED = {"nemotron": (lambda: tiny_model(0), dict(width=4), [1, 5, 7, 9, 2]),
           "setdlm": (lambda: tiny_setdlm(0), dict(width=3), [3, 4, 5, 6])}


@pytest.mark.parametrize("family", sorted(SAMPLED))
def test_temperature_and_top_p_share_one_sampled_program(family, compiles):
    """Ten temperatures and top-p values of one schedule and shape: one sampled decode
    program compiled for them all (they are traced), and one greedy program; the values
    reach the program (the outputs differ across temperatures)."""
    make, width, prompt = SAMPLED[family]
    model = make()
    engine = ps.Engine(model)  # a fresh engine: its executables are this test's compiles
    base = dict(schedule="packed", max_new_tokens=24, eos_id=None, cache_size=64, **width)
    outputs, compiled = [], []
    for t, p in zip(TEMPERATURES, TOP_PS):
        before = len(compiles)
        r = engine.decode(engine.request(prompt, ps.DecodeOptions(
            temperature=t, top_p=p, **base), seed=5))
        outputs.append(tuple(r.tokens))
        compiled.append((r.compile_s > 0, len(compiles) > before))
    # The first decode compiled; the nine others compiled nothing.
    assert compiled == [(True, True)] + [(False, False)] * 9, compiled
    sampled = _decodes(engine)
    assert len(sampled) == 1 and not sampled[0].sampling.greedy
    # The values reach the program: a different output at different temperatures.
    assert len(set(outputs)) >= 5, outputs
    # The same value again gives the same output (nothing random but the seed).
    again = engine.decode(engine.request(prompt, ps.DecodeOptions(
        temperature=TEMPERATURES[3], top_p=TOP_PS[3], **base), seed=5))
    assert tuple(again.tokens) == outputs[3] and again.compile_s == 0.0
    # Greedy (temperature 0, with or without top-p): one more program, for both.
    greedy = [engine.decode(engine.request(prompt, ps.DecodeOptions(top_p=p, **base)))
              for p in (None, 0.5, 0.9)]
    assert len({tuple(g.tokens) for g in greedy}) == 1
    # The smallest temperature samples the greedy tokens, the largest does not.
    assert outputs[0] == tuple(greedy[0].tokens) != outputs[-1]
    programs = _decodes(engine)
    assert len(programs) == 2 and sum(p.sampling.greedy for p in programs) == 1
    assert len(engine.executables()) == 2


def test_the_process_holds_at_most_max_programs(monkeypatch):
    """Every engine's programs count toward one bound; past it the least recently used
    program of any engine goes, and is compiled again when asked for."""
    from packed_ss_jax import programs

    monkeypatch.setenv("PACKED_SS_MAX_PROGRAMS", "2")
    monkeypatch.setattr(programs, "_floor", 0)   # a server of this process may have raised it
    a, b = ps.Engine(tiny_model(0)), ps.Engine(tiny_model(1))
    options_ = ps.DecodeOptions(schedule="ar", max_new_tokens=3)

    def decode(engine, n):
        return engine.decode(engine.request([1 + i % 9 for i in range(n)], options_))

    decode(a, 3)                     # a: bucket 16
    decode(b, 3)                     # b: bucket 16
    assert decode(a, 3).compile_s == 0.0     # a's is now the most recently used
    decode(b, 20)                    # b: bucket 32; b's bucket 16 was the least recent
    assert len(a.executables()) + len(b.executables()) == 2
    assert [k[1].bucket for k in b.executables()] == [32]
    assert [k[1].bucket for k in a.executables()] == [16]
    assert decode(a, 3).compile_s == 0.0
    assert decode(b, 3).compile_s > 0          # compiled again
    assert len(a.executables()) + len(b.executables()) == 2
    programs.clear_programs()
    assert a.executables() == b.executables() == {}
    assert decode(a, 3).compile_s > 0
    monkeypatch.setenv("PACKED_SS_MAX_PROGRAMS", "many")
    with pytest.raises(ValueError, match="PACKED_SS_MAX_PROGRAMS must be a positive integer"):
        programs.max_programs()
    monkeypatch.setenv("PACKED_SS_MAX_PROGRAMS", "2")
    programs.keep_at_least(5)   # a server holding every program it compiled at startup
    assert programs.max_programs() == 5


def test_a_warm_up_notes_its_own_thread_s_programs_and_a_store_drops_what_it_is_told():
    """A server readies its next choice on one thread while its decoder runs on another:
    the warm-up's note holds the programs it asked for, not the decoder's; and the
    previous choice's programs can be let go."""
    import threading

    from packed_ss_jax import programs

    store = programs.Programs()
    a, b = Key("generate", "old"), Key("generate", "new")
    store.hold(a, object())
    store.hold(b, object())
    store.recording = programs.Warming()
    other = threading.Thread(target=store.used, args=(a,))
    other.start()
    other.join()
    store.used(b)
    assert store.recording.asked == {b}
    store.recording = None
    store.drop(lambda key: key.program != "old")
    assert list(store) == [b] and store.used(a) is None and store.used(b) is not None


def test_a_warm_up_runs_its_tasks_side_by_side_and_compiles_a_program_once(caplog,
                                                                          monkeypatch):
    """Engine.warm's tasks run on several threads (XLA compiles outside the interpreter's
    lock); a program two of them ask for at once is compiled by one while the other
    waits; each program compiled is one progress line, counted against the total; the
    keys asked for on every thread of the warm-up are its note; a task's error is
    raised once all have ended."""
    import logging
    import threading
    import time

    from packed_ss_jax import executables, programs

    store = programs.Programs()
    made, threads = [], set()
    compiled = executables.compiled

    def slow_compile(identity, key, *args):
        made.append(key)
        time.sleep(0.3)    # the other task asks for it meanwhile
        return compiled(identity, key, *args)

    monkeypatch.setattr(executables, "compiled", slow_compile)

    def fn(x):
        return x * 2

    def task(key):
        def run():
            threads.add(threading.get_ident())
            exe, _ = store.compiled(key, fn, np.ones(3, np.float32))
            assert np.array_equal(np.asarray(exe(np.ones(3, np.float32))), [2, 2, 2])
        return run

    store.recording = warming = programs.Warming(total=2)
    with caplog.at_level(logging.INFO, logger=programs.log.name):
        warming.run([task(Key("same")), task(Key("same")), task(Key("other"))], workers=2)
    store.recording = None
    assert len(threads) == 2 and sorted(made) == [Key("other"), Key("same")]
    assert warming.asked == {Key("same"), Key("other")}
    lines = sorted(r.getMessage() for r in caplog.records)
    assert [line.split(":")[0] for line in lines] == ["other", "same"]
    assert sorted(line.split("(")[-1] for line in lines) == ["1 of 2 ready)", "2 of 2 ready)"]

    ended = []

    def failing():
        raise RuntimeError("no room")

    with pytest.raises(RuntimeError, match="no room"):
        programs.Warming().run([failing, lambda: (time.sleep(0.2), ended.append(1))],
                               workers=2)
    assert ended == [1]


def test_compile_threads_are_the_cores_on_a_cpu_or_what_the_environment_says(monkeypatch):
    import os

    from packed_ss_jax import programs

    monkeypatch.delenv("PACKED_SS_COMPILE_THREADS", raising=False)
    assert jax.default_backend() == "cpu" and programs.compile_threads() == os.cpu_count()
    monkeypatch.setenv("PACKED_SS_COMPILE_THREADS", "1")
    assert programs.compile_threads() == 1
    monkeypatch.setenv("PACKED_SS_COMPILE_THREADS", "two")
    with pytest.raises(ValueError, match="PACKED_SS_COMPILE_THREADS must be a positive"):
        programs.compile_threads()
    monkeypatch.setenv("PACKED_SS_COMPILE_THREADS", "4")
    monkeypatch.setattr(jax, "process_count", lambda: 2)   # programs spanning processes
    assert programs.compile_threads() == 1
