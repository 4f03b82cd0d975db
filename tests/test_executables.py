"""Programs kept on disk (executables.py): a new process loads a decode program instead
of tracing and compiling it, with the tokens a compiled one gives; an entry that is
damaged, truncated, from other versions, writable by others or over the size bound is
compiled anew with one warning line, and replaced."""

import json
import logging
import os
import stat
import time
from pathlib import Path

import pytest

import packed_ss_jax
import packed_ss_jax as ps
from packed_ss_jax import compile_cache, executables, programs
from test_compile_cache import _run as run_child

# The child decodes with both embedded models, greedy and sampled, and reports JAX's
# trace and XLA compile events of those decodes (not of the loads): none when every
# program was read from disk.
CHILD = """
import json, jax, packed_ss_jax as ps
events, counting = {}, [False]
def count(name, secs, **kw):
    if counting[0]:
        events[name] = events.get(name, 0) + 1
jax.monitoring.register_event_duration_secs_listener(count)
out = {}
for name, width in (("nld-tiny", {"block_size": 8}), ("setdlm-tiny", {"window": 4})):
    model = ps.load(name)
    counting[0] = True
    for temperature in (0.0, 0.9):
        r = ps.decode(model, "12+34=", schedule="packed", max_new_tokens=8,
                      temperature=temperature, seed=3, **width)
        out[f"{name} {temperature}"] = r.tokens
    counting[0] = False
print(json.dumps({"tokens": out,
                  "traced": events.get("/jax/core/compile/jaxpr_trace_duration", 0),
                  "compiled": events.get("/jax/core/compile/backend_compile_duration", 0)}))
"""


def _child(cache: Path, tmp_path: Path, executables_on: bool = True) -> dict:
    return run_child(str(cache), tmp_path, CHILD,
                     PACKED_SS_EXECUTABLES="on" if executables_on else "off")


def test_loaded_programs_give_the_compiled_tokens(tmp_path):
    cache = tmp_path / "xla"
    first = _child(cache, tmp_path)
    assert first["traced"] > 0 and first["compiled"] > 0, first
    assert list((cache / "executables").glob("*/*.pssx")), "nothing was kept"
    second = _child(cache, tmp_path)
    assert second["tokens"] == first["tokens"]
    assert second["traced"] == 0 and second["compiled"] == 0, second   # loaded, not compiled
    # The same decodes compiled with nothing on disk.
    assert _child(tmp_path / "none", tmp_path, executables_on=False)["tokens"] == first["tokens"]


@pytest.fixture
def kept(tmp_path, monkeypatch, run_compile_cache):
    """Programs kept on disk in a directory of this test's own."""
    monkeypatch.setenv(compile_cache.EXECUTABLES_ENV, "on")
    programs.clear_programs()
    compile_cache.set_compile_cache(tmp_path / "xla")
    yield tmp_path / "xla" / "executables"
    programs.clear_programs()
    compile_cache.set_compile_cache(run_compile_cache)


def _decode(model):
    programs.clear_programs()   # a new process's view: nothing held
    return ps.decode(model, "12+34=", schedule="packed", block_size=8, max_new_tokens=8).tokens


def _damage_header(path: Path, field: str, value) -> None:
    data = path.read_bytes()
    magic, header, payload = data.split(b"\n", 2)
    header = json.loads(header)
    header[field] = value
    path.write_bytes(magic + b"\n" + json.dumps(header).encode() + b"\n" + payload)


DAMAGE = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-1000]), "truncated or damaged"),
    "corrupted": (lambda p: p.write_bytes(p.read_bytes()[:-50] + b"\0" * 50),
                  "truncated or damaged"),
    "foreign version": (lambda p: _damage_header(p, "jax", "0.4.1"), "made with jax '0.4.1'"),
    "another program": (lambda p: _damage_header(p, "program", "0" * 64), "another program"),
    "not an entry": (lambda p: p.write_bytes(b"hello"), "not an entry"),
    "world-writable": (lambda p: p.chmod(0o666), "writable by group or others"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_an_unusable_entry_is_compiled_anew(kept, damage, caplog):
    model = ps.load()
    want = _decode(model)
    (entry,) = kept.glob("*/*.pssx")
    spoil, words = DAMAGE[damage]
    spoil(entry)
    with caplog.at_level(logging.WARNING, logger="packed_ss_jax.executables"):
        assert _decode(model) == want
    lines = [r.getMessage() for r in caplog.records if r.name == "packed_ss_jax.executables"]
    assert len(lines) == 1 and words in lines[0] and "compiling it anew" in lines[0], lines
    # Replaced by the program compiled anew: loaded next time, silently.
    caplog.clear()
    mode = stat.S_IMODE(entry.stat().st_mode)
    assert not mode & (stat.S_IWGRP | stat.S_IWOTH), oct(mode)
    with caplog.at_level(logging.WARNING, logger="packed_ss_jax.executables"):
        assert _decode(model) == want
    assert not [r for r in caplog.records if r.name == "packed_ss_jax.executables"]


def test_over_the_bound_is_neither_kept_nor_read(kept, monkeypatch, caplog):
    model = ps.load()
    want = _decode(model)
    (entry,) = kept.glob("*/*.pssx")
    monkeypatch.setenv(executables.MAX_BYTES_ENV, str(entry.stat().st_size - 1))
    with caplog.at_level(logging.WARNING, logger="packed_ss_jax.executables"):
        assert _decode(model) == want
    assert any("over the bound" in r.getMessage() for r in caplog.records)


def test_least_recently_used_entries_go_past_the_bound(tmp_path):
    """Only this module's entries count and go, the least recently used first; a
    temporary file a killed writer left goes after an hour, a live writer's stays."""
    group = tmp_path / "a model's"
    group.mkdir()
    now = time.time()
    files = {"old.pssx": 3600 * 5, "mid.pssx": 3600 * 4, "new.pssx": 0,
             ".tmp-dead.pssx": 3600 * 2, ".tmp-live.pssx": 0, "other.bin": 3600 * 9}
    for name, age in files.items():
        (group / name).write_bytes(b"x" * 100)
        os.utime(group / name, (now - age, now - age))
    executables._bound(tmp_path, 250)
    assert sorted(p.name for p in group.iterdir()) == [
        ".tmp-live.pssx", "mid.pssx", "new.pssx", "other.bin"]


def test_off_keeps_nothing(kept, monkeypatch):
    monkeypatch.setenv(compile_cache.EXECUTABLES_ENV, "off")
    _decode(ps.load())
    assert not kept.exists() or not list(kept.glob("*/*.pssx"))


def test_preload_holds_what_an_earlier_process_kept(kept, caplog):
    model = ps.load()
    want = {s: ps.decode(model, "12+34=", schedule=s, max_new_tokens=8).tokens
            for s in ("ar", "packed")}
    entries = sorted(kept.glob("*/*.pssx"))
    assert len(entries) == 2
    entries[0].write_bytes(b"damaged")
    programs.clear_programs()
    engine = ps.Engine(model)   # a store of its own: nothing held
    with caplog.at_level(logging.WARNING, logger="packed_ss_jax.executables"):
        assert engine.preload() == 1
    assert sum("not an entry" in r.getMessage() for r in caplog.records) == 1
    held = {key.program.schedule for key in engine.executables()}
    assert len(held) == 1
    # What was held runs with no compile; the other is compiled anew and kept again.
    for schedule, tokens in want.items():
        r = engine.decode(engine.request("12+34=", ps.DecodeOptions(schedule=schedule,
                                                                     max_new_tokens=8)))
        assert r.tokens == tokens
        assert (r.compile_s == 0) == (schedule in held), (schedule, r.compile_s)
    programs.clear_programs()
    assert ps.Engine(model).preload() == 2


def test_a_second_server_start_reads_its_programs_and_runs_none(kept, monkeypatch):
    """The first start compiles by running each program and notes them; the next reads
    exactly those, runs none, and serves `decode`'s tokens."""
    from packed_ss_jax.client import EngineClient
    from packed_ss_jax.server import create_app
    from servers import in_process, request

    settings = dict(schedule="packed", cache_size=64)
    first = EngineClient(ps.load(), settings, 2)
    first.warm()
    assert first.loaded == 0
    held = set(first.engine.executables())
    programs.clear_programs()
    ran = []
    tasks = EngineClient._tasks
    monkeypatch.setattr(EngineClient, "_tasks", lambda self, *a: [
        lambda t=t: (ran.append(1), t()) for t in tasks(self, *a)])
    model = ps.load()
    app = create_app(model, "nld-tiny", max_model_len=64, slots=2)
    d = app.app.state.decoder
    assert not ran and d.loaded == len(held) == d.programs, (d.loaded, len(held))
    assert set(d.engine.executables()) == held
    prompt = "Question: Ava has 3 apples. She gets 4 more. How many?\nAnswer:"
    with in_process(app) as base:
        code, body = request(base, "POST", "/v1/completions",
                             {"model": "nld-tiny", "prompt": prompt, "max_tokens": 8,
                              "temperature": 0})
    assert code == 200, body
    assert set(d.engine.executables()) == held   # the request compiled nothing more
    assert body["packed_ss"]["token_ids"] == ps.decode(model, prompt, max_new_tokens=8).tokens


def test_a_cache_that_cannot_be_written_costs_one_warning(kept, monkeypatch, caplog):
    import errno

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(executables, "_write", full)
    model = ps.load()
    with caplog.at_level(logging.WARNING, logger="packed_ss_jax.executables"):
        tokens = _decode(model)
        assert _decode(model) == tokens
    lines = [r.getMessage() for r in caplog.records if r.name == "packed_ss_jax.executables"]
    assert len(lines) == 1 and "No space left on device" in lines[0], lines
