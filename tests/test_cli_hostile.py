"""`packed-ss` given hostile input: malformed multi-host addresses, numbers far past
every bound, empty strings, bytes that are not UTF-8, a checkpoint whose logits turn to
NaN, a missing peer, a compile cache directory others can write to. Each is one line on
stderr (`packed-ss <command>: error: ...`) and exit status 2, refused before any work
where the command line alone is wrong, or (the cache) a one-line warning and a run
without the cache. Processes are started only where a real one is needed (argv bytes,
a peer that never comes), and are always stopped."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packed_ss_jax import arguments, cli, compile_cache, loading
import compiles

ROOT = Path(__file__).resolve().parents[1]
HUGE = str(2**70)
DIGITS = "9" * 5000  # past Python's 4300-digit limit for int()


def _env(**extra) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", PACKED_SS_COMPILE_CACHE="off",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                **extra)


def _one_line(rc, err: str, command: str = "generate") -> str | None:
    """What is wrong with a failure's exit status and stderr (None: one error line)."""
    lines = err.splitlines()
    if rc != 2 or len(lines) != 1 or not lines[0].startswith(f"packed-ss {command}: error: ") \
            or "Traceback" in err:
        return f"status {rc}, stderr {err[-2000:]!r}"
    if len(lines[0]) > 600:  # hostile values are quoted cut short
        return f"a {len(lines[0])}-character line"
    return None


@pytest.fixture
def no_load(monkeypatch):
    """The command line alone is wrong: nothing may be loaded (or compiled) first."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load", refuse)
    monkeypatch.setattr(loading, "read_config", refuse)


# --- --coordinator, checked while parsing ---------------------------------------------------------

VALID_HOSTS = ["127.0.0.1", "localhost", "node-0.cluster.local", "h_1", "[::1]",
               "[fe80::1%eth0]", "[::ffff:10.0.0.1]"]
INVALID_HOSTS = ["", " ", "::1", "fe80::1", "[::1", "::1]", "[zz::1]", "[]", "a b", "-x",
                 "x-", "host/path", "user@host", "h\u00e9", "\udcff", "\n", "a" * 300,
                 "unix:/tmp/s", "dns:///h"]


@pytest.mark.parametrize("port, ok", [("1", True), ("65535", True), ("01234", True),
                                      ("0", False), ("65536", False), ("99999", False),
                                      (HUGE, False), (DIGITS, False), ("-1", False),
                                      ("+1", False), (" 1", False), ("1 ", False),
                                      ("", False), ("abc", False), ("1.5", False),
                                      ("\u0661\u0662", False), ("0x10", False)])
def test_coordinator_ports_at_and_past_the_bounds(port, ok):
    for host in VALID_HOSTS[:2]:
        if ok:
            assert arguments.coordinator(f"{host}:{port}") == f"{host}:{int(port)}"
        else:
            with pytest.raises(Exception) as e:
                arguments.coordinator(f"{host}:{port}")
            assert e.type.__name__ == "ArgumentTypeError", e.value


@pytest.mark.parametrize("host", INVALID_HOSTS)
def test_coordinator_hosts_that_are_refused(host):
    with pytest.raises(Exception) as e:
        arguments.coordinator(f"{host}:1234")
    assert e.type.__name__ == "ArgumentTypeError", e.value


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(host=st.one_of(st.sampled_from(VALID_HOSTS + INVALID_HOSTS), st.text(max_size=30)),
       port=st.one_of(st.integers(-2**70, 2**70).map(str), st.text(max_size=8)),
       colon=st.booleans())
def test_coordinator_accepts_exactly_host_and_port(host, port, colon):
    """Generated addresses: accepted (as HOST:PORT with the port's leading zeros gone)
    exactly when the host is a host name, IPv4 or bracketed IPv6 address and the port an
    integer in [1, 65535]; refused with ArgumentTypeError otherwise, never anything else."""
    text = f"{host}:{port}" if colon else host + port
    try:
        got = arguments.coordinator(text)
    except Exception as e:  # noqa: BLE001 - the type is the point
        assert type(e).__name__ == "ArgumentTypeError", repr(e)
        return
    h, _, p = got.rpartition(":")
    assert p.isascii() and p.isdigit() and 1 <= int(p) <= 65535 and str(int(p)) == p
    assert h and "\n" not in h and h.isascii()
    if h.startswith("["):
        ipaddress.IPv6Address(h[1:-1])
    else:
        assert ":" not in h and " " not in h
    if colon and host in VALID_HOSTS + INVALID_HOSTS:
        assert host in VALID_HOSTS


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.text(max_size=40))
def test_any_coordinator_is_one_line_before_any_work(value, no_load, capsys):
    """Whatever --coordinator says, alone (the other two flags missing) or with them, the
    command line is refused in one line and nothing is loaded."""
    for extra in ([], ["--num-processes", "2", "--process-id", "5"]):
        rc = cli.main(["generate", "--ids", "1", f"--coordinator={value}", *extra])
        assert _one_line(rc, capsys.readouterr().err) is None, value


# --- every generate argument, hostile -------------------------------------------------------------

PARSE_TIME = {
    "max-new-tokens-digits": ["hi", "--max-new-tokens", DIGITS],
    "seed-huge": ["hi", "--seed", HUGE],
    "seed-digits": ["hi", "--seed", DIGITS],
    "ids-huge": ["--ids", f"1,{HUGE}"],
    "ids-int32": ["--ids", f"1,{2**31}"],
    "ids-digits": ["--ids", f"1,{DIGITS}"],
    "ids-negative": ["--ids", "-5"],
    "ids-empty": ["--ids", ""],
    "stop-huge-id": ["hi", "--stop", HUGE],
    "top-k-digits": ["hi", "--top-k", DIGITS],
    "top-p-0": ["hi", "--top-p", "0"],
    "top-p-neg-tiny": ["hi", "--top-p", "-1e-320"],
    "temperature-digits": ["hi", "--temperature", DIGITS],
    "block-size-digits": ["hi", "--block-size", DIGITS],
    "num-processes-huge": ["hi", "--coordinator", "127.0.0.1:1234", "--num-processes", HUGE,
                           "--process-id", "0"],
    "num-processes-int32": ["hi", "--coordinator", "127.0.0.1:1234",
                            "--num-processes", str(2**31 - 1), "--process-id", "0"],
    "process-id-huge": ["hi", "--coordinator", "127.0.0.1:1234", "--num-processes", "2",
                        "--process-id", HUGE],
    "process-id-past-count": ["hi", "--coordinator", "127.0.0.1:1234", "--num-processes", "2",
                              "--process-id", "2"],
    "coordinator-alone": ["hi", "--coordinator", "127.0.0.1:1234"],
    "timeout-0": ["hi", "--coordinator-timeout", "0"],
    "timeout-neg": ["hi", "--coordinator-timeout", "-1"],
    "timeout-nan": ["hi", "--coordinator-timeout", "nan"],
    "timeout-inf": ["hi", "--coordinator-timeout", "inf"],
    "timeout-overflow": ["hi", "--coordinator-timeout", "1e309"],
    "timeout-huge": ["hi", "--coordinator-timeout", HUGE],
    "prompt-empty": [""],
    "prompt-surrogate": ["caf\udce9"],
    "stop-surrogate": ["hi", "--stop", "\udcff"],
    "system-surrogate": ["hi", "--chat", "--system", "\udcff\udcfe"],
    "compile-cache-surrogate": ["hi", "--compile-cache", "/tmp/\udcff"],
    "stop-empty": ["hi", "--stop", ""],
    "system-without-chat": ["hi", "--system", ""],
    "mesh-digits": ["hi", "--mesh", f"data={DIGITS}"],
    "schedule-empty": ["hi", "--schedule", ""],
    "dtype-empty": ["hi", "--dtype", ""],
}


@pytest.mark.parametrize("name", PARSE_TIME)
def test_hostile_arguments_are_one_line_before_any_work(name, no_load, capsys):
    rc = cli.main(["generate", *PARSE_TIME[name]])
    problem = _one_line(rc, capsys.readouterr().err)
    assert problem is None, problem


def test_hostile_values_the_model_judges_are_one_line(capsys, monkeypatch):
    """Values only the loaded model can judge (the cache, the vocabulary): one line, and
    nothing compiled."""
    compiled = compiles.record(monkeypatch)
    for argv in (["hi", "--max-new-tokens", HUGE], ["hi", "--block-size", HUGE],
                 ["--ids", f"1,{2**31 - 1}"], ["hi", "--model", ""], ["hi", "--tokenizer", ""],
                 ["hi", "--order", ""]):
        rc = cli.main(["generate", *argv])
        problem = _one_line(rc, capsys.readouterr().err)
        assert problem is None, (argv, problem)
    assert compiled == []


def test_tiniest_top_p_decodes(capsys):
    """--top-p 1e-320 (0 in float32) is a valid nucleus: the most likely token alone."""
    rc = cli.main(["generate", "--ids", "1,2,3", "--max-new-tokens", "3", "--no-eos",
                   "--schedule", "ar", "--temperature", "1", "--top-p", "1e-320"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert len(out.splitlines()[0].split()) == 3


# --- bytes that are not UTF-8, through a real argv ------------------------------------------------

# Runs each command line of its own argv (separated by "--next") through cli.main, with
# loading refused: Python decodes the argv bytes as it does for `packed-ss`.
DRIVER = """
import sys
from packed_ss_jax import cli, loading

def refuse(*a, **k):
    raise AssertionError("the model was loaded before the arguments were checked")

loading.load = loading.read_config = refuse
case = []
for a in sys.argv[1:]:
    if a != "--next":
        case.append(a)
        continue
    rc = cli.main(case)
    print(f"== {rc}", file=sys.stderr, flush=True)
    case = []
"""

NOT_UTF8 = [
    [b"generate", b"caf\xe9"],
    [b"generate", b"hi", b"--stop", b"\xff"],
    [b"generate", b"hi", b"--stop", b"ok\xc3"],
    [b"generate", b"hi", b"--chat", b"--system", b"\xff\xfe"],
    [b"generate", b"hi", b"--compile-cache", b"/tmp/\xff"],
    [b"generate", b"hi", b"--coordinator", b"h\xff:1234", b"--num-processes", b"2",
     b"--process-id", b"0"],
    [b"generate", b"--ids", b"1,\xff"],
    [b"generate", b"hi", b"--schedule", b"\xff"],
    [b"bench", b"--task", b"\xff"],
    [b"bench", b"--coordinator", b"\xff:1", b"--num-processes", b"1", b"--process-id", b"0"],
]


def test_argv_that_is_not_utf8_is_one_line():
    """`packed-ss generate $'\\xff\\xfe'`: one line, no traceback (the prompt, --stop and
    --system reached the tokenizer as lone surrogates and raised TypeError)."""
    p = subprocess.run([sys.executable, "-m", "packed_ss_jax", "generate", b"\xff\xfe"],
                       env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    problem = _one_line(p.returncode, p.stderr)
    assert problem is None, problem
    argv = [sys.executable, "-c", DRIVER]
    for case in NOT_UTF8:
        argv += [*case, b"--next"]
    p = subprocess.run(argv, env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    outcomes, lines = [], []
    for line in p.stderr.splitlines():
        if re.fullmatch(r"== -?\d+", line):
            outcomes.append((int(line[3:]), "".join(x + "\n" for x in lines)))
            lines = []
        else:
            lines.append(line)
    assert len(outcomes) == len(NOT_UTF8), p.stderr[-3000:]
    for case, (rc, err) in zip(NOT_UTF8, outcomes):
        problem = _one_line(rc, err, case[0].decode())
        assert problem is None, (case, problem)


# --- a checkpoint whose logits are NaN ------------------------------------------------------------

def _broken_load(monkeypatch, **params):
    """`loading.load` with some weights replaced by `params(model)` (names -> functions)."""
    real = loading.load

    def load(*a, **k):
        model = real(*a, **k)
        new = {name: f(model) for name, f in params.items()}
        return dataclasses.replace(model, params={**model.params, **new})

    monkeypatch.setattr(loading, "load", load)


def test_nan_checkpoint_is_one_line(monkeypatch, capsys):
    """NaN logits stop the decode with a NonFiniteError: one line saying where, for
    `generate` (one schedule, streamed) and `bench`."""
    _broken_load(monkeypatch, head=lambda m: m.params["head"] * jnp.nan)
    rc = cli.main(["generate", "--ids", "1,2,3", "--max-new-tokens", "4", "--schedule", "ar"])
    err = capsys.readouterr().err
    assert _one_line(rc, err) is None, err
    assert "non-finite logits" in err
    rc = cli.main(["bench", "--limit", "1", "--schedules", "ar", "--max-new-tokens", "4",
                   "--resamples", "10"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "error" in x or "Traceback" in x]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("packed-ss bench: error: non-finite logits"), err


def test_nan_drafter_under_schedule_all_is_one_line(monkeypatch, capsys, nemotron_dir):
    """--schedule all: AR (first, streamed) never reads the broken draft-only adapter and
    prints its tokens; the first speculative schedule raises, in one line."""
    def nan_lora(model):
        layer = model.params["layer_0"]
        return {**layer, "attn": {**layer["attn"], "lora_b": layer["attn"]["lora_b"] * jnp.nan}}

    _broken_load(monkeypatch, layer_0=nan_lora)
    rc = cli.main(["generate", "--model", str(nemotron_dir), "--ids", "5,9,14",
                   "--max-new-tokens", "6", "--no-eos", "--schedule", "all"])
    out, err = capsys.readouterr()
    assert _one_line(rc, err) is None, err
    assert "non-finite logits" in err
    assert len(out.split()) == 6  # AR's tokens, streamed before the failure


# --- the compile cache directory ------------------------------------------------------------------

@pytest.fixture
def cache_check(run_compile_cache, caplog):
    """Sets a cache directory and returns (the directory in use, warnings given); the run's
    own cache is restored afterwards."""
    compile_cache._warned.clear()

    def use(path):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
            got = compile_cache.set_compile_cache(path)
        return got, [r.getMessage() for r in caplog.records]

    yield use
    compile_cache.set_compile_cache(run_compile_cache)
    compile_cache._warned.clear()


def test_run_cache_is_accepted(cache_check, run_compile_cache):
    assert cache_check(run_compile_cache) == (Path(os.path.realpath(run_compile_cache)), [])


def test_private_directory_is_used(cache_check, tmp_path):
    for mode in (0o700, 0o755):
        good = tmp_path / f"good{mode:o}"
        good.mkdir(mode=mode)
        good.chmod(mode)
        assert cache_check(good) == (good, [])
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "good700")
    assert cache_check(link) == (tmp_path / "good700", [])  # JAX gets the real directory


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702], ids=oct)
def test_directory_others_can_write_is_refused(cache_check, tmp_path, mode):
    bad = tmp_path / "shared"
    bad.mkdir()
    bad.chmod(mode)
    got, warned = cache_check(bad)
    assert got is None and compile_cache.ensure() is None
    assert len(warned) == 1 and str(bad) in warned[0] and "chmod go-w" in warned[0]
    assert cache_check(bad) == (None, [])  # once per directory
    link = tmp_path / "link"
    link.symlink_to(bad)
    got, warned = cache_check(link)
    assert got is None and len(warned) == 1 and "chmod go-w" in warned[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_directory_of_another_user_is_refused(cache_check, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, -1)
    got, warned = cache_check(theirs)
    assert got is None
    assert len(warned) == 1 and "owned by user 65534" in warned[0] and str(theirs) in warned[0]


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o2775], ids=oct)
def test_directory_inside_one_others_can_write_is_refused(cache_check, tmp_path, mode):
    """Whoever can write to a (not sticky) parent can put their own directory in its place
    (a group-writable, setgid project directory included)."""
    parent = tmp_path / f"open{mode:o}"
    parent.mkdir()
    parent.chmod(mode)
    got, warned = cache_check(parent / "xla")
    assert got is None and len(warned) == 1 and f"chmod go-w {parent}" in warned[0]
    parent.chmod(0o1777)  # sticky, as /tmp: nobody else can rename it
    assert cache_check(parent / "xla") == (parent / "xla", [])


def test_directory_inside_another_users_is_refused(cache_check, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    (parent / "xla").mkdir(mode=0o700)
    os.chown(parent, 65534, 65534)
    got, warned = cache_check(parent / "xla")
    assert got is None and len(warned) == 1 and "owned by user 65534" in warned[0]


def test_refused_cache_is_one_warning_line_on_stderr(tmp_path):
    bad = tmp_path / "shared"
    bad.mkdir()
    bad.chmod(0o777)
    code = ("import sys; from packed_ss_jax import compile_cache as c; "
            "print(c.set_compile_cache(sys.argv[1]), c.set_compile_cache(sys.argv[1]))")
    p = subprocess.run([sys.executable, "-c", code, str(bad)], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "None None\n", p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "chmod go-w" in lines[0], p.stderr


# --- a multi-host run whose peer never comes ------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TIMEOUT_S = 2


def test_missing_peer_is_one_line_at_the_timeout():
    """Two processes asked for, one started: process 0 (which serves the coordinator) and,
    on another port, process 1 (whose coordinator never comes) each end with one line and
    status 2 at --coordinator-timeout, not JAX's native abort 300 s on. A process 0 whose
    port is taken ends at once (gRPC crashed on it)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    procs, started = {}, time.monotonic()
    try:
        for name, port, pid in [("process 0", _free_port(), 0), ("process 1", _free_port(), 1),
                                ("port taken", taken.getsockname()[1], 0)]:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "packed_ss_jax", "generate", "--ids", "1,2",
                 "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                 "--process-id", str(pid), "--coordinator-timeout", str(TIMEOUT_S)],
                env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True)
        ended = {}
        while len(ended) < len(procs) and time.monotonic() < started + 120:
            ended.update({name: time.monotonic() - started for name, p in procs.items()
                          if name not in ended and p.poll() is not None})
            time.sleep(0.05)
        outs = {name: (*p.communicate(timeout=10), ended.get(name)) for name, p in procs.items()}
    finally:
        taken.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    for name, (out, err, elapsed) in outs.items():
        problem = _one_line(procs[name].returncode, err)
        assert problem is None, (name, problem)
        print(f"{name}: status 2 after {elapsed:.1f}s: {err.strip()}")
    for name in ("process 0", "process 1"):
        assert "not all 2 processes joined" in outs[name][1]
        assert TIMEOUT_S <= outs[name][2] < TIMEOUT_S + 60
    assert "cannot serve on port" in outs["port taken"][1]
