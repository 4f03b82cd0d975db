"""The converter never loses data: what --overwrite may replace, signals, read-only places.

Every test works on copies inside tmp_path: a conversion bug here must not be able to
reach the shared fixtures.
"""

import contextlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax.checkpoints import store
from packed_ss_jax.conversion import DestinationError
from checkpoint_copies import snapshot, writable_copy

ROOT = Path(__file__).resolve().parents[1]


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32)) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def previous_output(nemotron_dir, tmp_path_factory):
    """An earlier conversion output (no adapter), to be copied where a test needs one."""
    out = tmp_path_factory.mktemp("previous") / "out"
    ps.convert(nemotron_dir, out, dtype="float32", lora=False, progress=False)
    return out


@pytest.fixture(scope="module")
def expected(nemotron_dir, previous_output):
    """Params of the new conversion (adapter on) and of the previous output."""
    return {"new": ps.load(nemotron_dir).params, "old": ps.load(previous_output).params}


def _sandbox(tmp_path: Path, nemotron_dir: Path, previous: Path) -> Path:
    """tmp_path/work with a source copy, unrelated data, earlier outputs and links."""
    work = tmp_path / "work"
    work.mkdir()
    src = writable_copy(nemotron_dir, work / "src")
    (work / "other").mkdir()
    (work / "other" / "notes.txt").write_text("not a checkpoint")
    (work / "empty").mkdir()
    (work / "file.txt").write_text("a file")
    shutil.copytree(previous, work / "prev")
    shutil.copytree(previous, work / "prev_extra")
    (work / "prev_extra" / "notes.txt").write_text("added by hand")
    shutil.copytree(previous, work / "prev_damaged")
    (work / "prev_damaged" / store.MARKER).write_text("{")
    shutil.copytree(previous, work / "prev_link")
    (work / "prev_link" / "params" / "data").symlink_to(work / "other")
    (work / "link_src").symlink_to(src)
    (work / "link_in_src").symlink_to(src / "linear_spec_lora")
    (work / "link_empty").symlink_to(work / "empty")
    (work / "dangling").symlink_to(work / "missing")
    (tmp_path / "alias").symlink_to(work)
    return work


# (case, output relative to tmp_path/work): refused with and without --overwrite, and
# nothing anywhere under tmp_path may change.
REFUSED = [
    ("source itself", "src"),
    ("source via ..", "src/linear_spec_lora/.."),
    ("source via a symlinked parent", "../alias/src"),
    ("new directory inside the source", "src/converted"),
    ("existing directory inside the source", "src/linear_spec_lora"),
    ("parent of the source", "."),
    ("parent via ..", "src/.."),
    ("grandparent of the source", ".."),
    ("symlink to the source", "link_src"),
    ("symlink into the source", "link_in_src"),
    ("symlink to an empty directory", "link_empty"),
    ("dangling symlink", "dangling"),
    ("a file", "file.txt"),
    ("non-empty unrelated directory", "other"),
    ("earlier output plus a foreign file", "prev_extra"),
    ("earlier output with a damaged marker", "prev_damaged"),
    ("earlier output holding a symlink", "prev_link"),
]
# (case, output, overwrite, expected params afterwards)
ALLOWED = [
    ("earlier output", "prev", True),
    ("empty directory", "empty", True),
    ("new path", "new", False),
    ("new nested path", "a/b/new", False),
]


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize("case,rel", REFUSED, ids=[c for c, _ in REFUSED])
def test_refused_outputs_touch_nothing(case, rel, overwrite, tmp_path, nemotron_dir, previous_output):
    work = _sandbox(tmp_path, nemotron_dir, previous_output)
    before = snapshot(tmp_path)
    with pytest.raises((DestinationError, FileExistsError)):
        ps.convert(work / "src", work / rel, dtype="float32", overwrite=overwrite, progress=False)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("case,rel,overwrite", ALLOWED, ids=[c[0] for c in ALLOWED])
def test_allowed_outputs(case, rel, overwrite, tmp_path, nemotron_dir, previous_output, expected):
    work = _sandbox(tmp_path, nemotron_dir, previous_output)
    dst = work / rel
    before = {k: v for k, v in snapshot(tmp_path).items()
              if not (tmp_path / k).resolve().is_relative_to(dst.resolve())}
    ps.convert(work / "src", dst, dtype="float32", overwrite=overwrite, progress=False)
    after = snapshot(tmp_path)
    assert {k: after[k] for k in before} == before  # nothing outside the output changed
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(".")]
    assert store.replace_refusal(dst) is None  # holds exactly what its marker lists
    assert leaves_equal(ps.load(dst).params, expected["new"])


def test_cli_refusal_is_one_line(tmp_path, nemotron_dir, previous_output, capsys):
    from packed_ss_jax.cli import convert_main

    work = _sandbox(tmp_path, nemotron_dir, previous_output)
    assert convert_main([str(work / "src"), str(work), "--overwrite", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("packed-ss-convert: error: ")
    assert "contains the source" in err[0] and str(work) in err[0]


# -- signals ---------------------------------------------------------------------------

def _state(dst: Path, expected, context=()) -> str:
    """"absent", "old" or "new"; fails on anything in between."""
    leftovers = [p.name for p in dst.parent.iterdir() if p.name != dst.name]
    assert not leftovers, f"left behind: {leftovers} ({context})"
    if not dst.exists():
        return "absent"
    assert store.replace_refusal(dst) is None, "output holds files its marker does not list"
    params = ps.load(dst).params  # verifies every array's checksum
    for name in ("old", "new"):
        if leaves_equal(params, expected[name]):
            return name
    raise AssertionError(f"{dst} loads but matches neither the previous nor the new output")


def test_interrupts_leave_complete_output_or_none(tmp_path, nemotron_dir, previous_output,
                                                   expected):
    """SIGINT/SIGTERM at 20 seeded random moments, each in a fresh process: the output is
    absent or complete, a previous output intact or replaced, and no hidden directory
    remains. The forkserver imports jax once; each child is a fork of it."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["packed_ss_jax", "orbax.checkpoint", "convert_child"])
    import convert_child

    rng = random.Random(20240601)
    children = []

    def start(dst: Path, overwrite: bool):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=convert_child.convert,
                        args=(str(nemotron_dir), str(dst), overwrite, send))
        p.start()
        send.close()  # the child holds the only writing end: EOF once it exits
        children.append(p)
        assert recv.poll(60), "child did not start"
        assert recv.recv() == "ready"
        return p, recv

    def finish(p, recv):
        p.join(60)
        assert not p.is_alive(), "conversion hung after the signal"
        msgs = []
        while True:
            try:
                msgs.append(recv.recv())
            except EOFError:
                break
        assert not [m for m in msgs if m.startswith("error")], msgs
        return msgs

    try:
        # One uninterrupted run sets the time scale of the random moments.
        (tmp_path / "timing").mkdir()
        p, recv = start(tmp_path / "timing" / "out", False)
        t0 = time.monotonic()
        finish(p, recv)
        duration = time.monotonic() - t0
        outcomes = []
        for i in range(20):
            sig = signal.SIGINT if i % 2 == 0 else signal.SIGTERM
            with_previous = i % 4 >= 2
            trial = tmp_path / f"trial{i}"
            trial.mkdir()
            dst = trial / "out"
            if with_previous:
                shutil.copytree(previous_output, dst)
            delay = rng.uniform(0, 1.5 * duration)
            p, recv = start(dst, with_previous)
            time.sleep(delay)
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):  # it may end in between
                    os.kill(p.pid, sig)
            msgs = finish(p, recv)
            state = _state(dst, expected, (sig.name, delay, p.exitcode, msgs))
            assert state in (("old", "new") if with_previous else ("absent", "new")), state
            outcomes.append((sig.name, round(delay, 3), state, msgs[-1] if msgs else p.exitcode))
    finally:
        for p in children:
            if p.is_alive():
                p.kill()
            p.join(5)
    print(f"one conversion: {duration:.2f}s; outcomes: {outcomes}")
    # The moments must really cut conversions short, not only land after them. (How many
    # land late depends on the machine's load, so "new" outcomes are not required.)
    assert any(o[2] in ("absent", "old") for o in outcomes), outcomes


def test_signal_during_the_swap_is_held_until_it_is_done(tmp_path, nemotron_dir,
                                                        previous_output, expected, monkeypatch):
    from packed_ss_jax.checkpoints import atomic
    from packed_ss_jax.conversion import Interrupted

    real_replace = atomic.replace

    def replace_with_signal(new, dst):
        os.kill(os.getpid(), signal.SIGTERM)  # lands in the critical section
        return real_replace(new, dst)

    monkeypatch.setattr(atomic, "replace", replace_with_signal)
    dst = tmp_path / "out"
    shutil.copytree(previous_output, dst)
    with pytest.raises(Interrupted, match="SIGTERM") as e:
        ps.convert(nemotron_dir, dst, dtype="float32", overwrite=True, progress=False)
    assert e.value.exit_status == 128 + signal.SIGTERM
    assert "written completely" in str(e.value)
    assert _state(dst, expected) == "new"


def test_second_signal_during_cleanup(tmp_path, nemotron_dir, monkeypatch):
    from packed_ss_jax.checkpoints import store as store_mod
    from packed_ss_jax.conversion import Interrupted

    real_write, real_abort = store_mod.Writer.write, store_mod.Writer.abort

    # raise_signal sends to this (the main) thread, and the handler runs before it returns:
    # os.kill lets the kernel pick any thread, and the handler then runs whenever the main
    # thread next checks, which made the moment of the signal depend on the machine's load.
    def write(self, *a, **kw):
        real_write(self, *a, **kw)
        signal.raise_signal(signal.SIGINT)  # the handler raises here

    def abort(self):
        signal.raise_signal(signal.SIGTERM)  # must not cut the cleanup short
        real_abort(self)

    monkeypatch.setattr(store_mod.Writer, "write", write)
    monkeypatch.setattr(store_mod.Writer, "abort", abort)
    # The guard takes over only default dispositions (a handler someone installed stays in
    # charge): start from those, whatever earlier code in this process installed or blocked.
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(Interrupted, match="SIGINT: nothing was written"):
            ps.convert(nemotron_dir, tmp_path / "out", dtype="float32", progress=False)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    assert list(tmp_path.iterdir()) == []


def test_replace_without_renameat2(tmp_path, nemotron_dir, previous_output, expected,
                                  monkeypatch):
    """Where the kernel has no RENAME_EXCHANGE: two renames, same result."""
    from packed_ss_jax.checkpoints import atomic

    monkeypatch.setattr(atomic, "_call", lambda src, dst, flags: False)
    dst = tmp_path / "out"
    shutil.copytree(previous_output, dst)
    ps.convert(nemotron_dir, dst, dtype="float32", overwrite=True, progress=False)
    assert _state(dst, expected) == "new"


def test_signal_handlers_are_restored(tmp_path, nemotron_dir):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    ps.convert(nemotron_dir, tmp_path / "out", dtype="float32", progress=False)
    assert {s: signal.getsignal(s) for s in before} == before


def test_conversion_from_another_thread(tmp_path, nemotron_dir):
    """Handlers can only be installed from the main thread; elsewhere it still converts."""
    import threading

    errors = []
    t = threading.Thread(target=lambda: _try(errors, ps.convert, nemotron_dir,
                                             tmp_path / "out", dtype="float32", progress=False))
    t.start()
    t.join(60)
    assert not errors, errors
    assert ps.load(tmp_path / "out").config.lora_rank == 4


def _try(errors, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except BaseException as e:
        errors.append(e)


# -- read-only destinations ------------------------------------------------------------

_RO_SCRIPT = """
import contextlib, io, json, sys
from packed_ss_jax.cli import convert_main
out = []
for args in json.loads(sys.argv[2]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = convert_main([sys.argv[1]] + args + ["--quiet"])
        except BaseException as e:
            rc = repr(e)
    out.append([rc, err.getvalue()])
print(json.dumps(out))
"""


def test_read_only_destination(nemotron_dir, tmp_path):
    """A read-only output directory or parent: one clear line naming it, status 2, no
    traceback. Root ignores permission bits, so as root the converter runs without the
    capabilities that let it (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH)."""
    prefix = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: permission bits cannot bind")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    ro = tmp_path / "ro"
    (ro / "empty").mkdir(parents=True)
    try:
        (ro / "empty").chmod(0o555)
        ro.chmod(0o555)
        runs = [[str(ro / "out")], [str(ro / "sub" / "out")], [str(ro / "empty"), "--overwrite"]]
        cmd = prefix + [sys.executable, "-c", _RO_SCRIPT, str(nemotron_dir), json.dumps(runs)]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 0, r.stderr
        results = json.loads(r.stdout.strip().splitlines()[-1])
        for args, (rc, err) in zip(runs, results):
            lines = [line for line in err.splitlines() if line.strip()]
            assert rc == 2 and "Traceback" not in err, (args, rc, err)
            assert len(lines) == 1 and lines[0].startswith("packed-ss-convert: error: "), err
            assert str(ro) in lines[0], lines[0]
            assert "ermission denied" in lines[0] or "not writable" in lines[0], lines[0]
        assert sorted(p.name for p in ro.iterdir()) == ["empty"]
        assert list((ro / "empty").iterdir()) == []
    finally:
        ro.chmod(0o755)
        (ro / "empty").chmod(0o755)
