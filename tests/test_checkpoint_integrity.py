"""Damaged weights are caught: NaN/Inf tensors, changed params files, broken markers."""

import json
import shutil

import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax.checkpoints import marker, store
from packed_ss_jax.checkpoints.assemble import count_non_finite
from packed_ss_jax.checkpoints.errors import CheckpointError
from packed_ss_jax.checkpoints.store import DestinationError
from packed_ss_jax.cli import convert_main
from packed_ss_jax.config import ConfigError
from checkpoint_copies import copy_checkpoint, snapshot

UP = "encoder.layers.1.mlp.up_proj.weight"
HEAD = "diffusion_head.weight"


def _poison(w):
    up = w[UP].copy()
    up.flat[[3, 70, 500]] = np.nan
    w[UP] = up
    head = w[HEAD].copy()
    head.flat[7] = np.inf
    head.flat[9] = -np.inf
    w[HEAD] = head


@pytest.fixture(scope="module")
def converted(nemotron_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "out"
    ps.convert(nemotron_dir, out, dtype="float32", progress=False)
    return out


def _copy(converted, tmp_path):
    return shutil.copytree(converted, tmp_path / "copy")


# -- NaN / Inf -------------------------------------------------------------------------

def test_non_finite_tensors_fail_load_and_convert(nemotron_dir, tmp_path, capsys):
    bad = copy_checkpoint(nemotron_dir, tmp_path / "bad", _poison)
    with pytest.raises(CheckpointError) as e:
        ps.load(bad)
    msg = str(e.value)
    assert "non-finite weights (NaN/Inf) in 2 tensor(s)" in msg
    assert f"{UP}: 3 of 10240 values (3 NaN, 0 Inf)" in msg
    assert f"{HEAD}: 2 of 20480 values (0 NaN, 2 Inf)" in msg
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=UP):
        ps.convert(bad, tmp_path / "out", progress=False)
    assert convert_main([str(bad), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and UP in err[0] and HEAD in err[0]
    assert snapshot(tmp_path) == before  # no output, no hidden directory


def test_float32_too_large_for_bfloat16_is_caught(nemotron_dir, tmp_path):
    def huge(w):
        up = w[UP].copy()
        up.flat[0] = 3.4e38  # finite in float32, Inf once rounded to bfloat16
        w[UP] = up

    big = copy_checkpoint(nemotron_dir, tmp_path / "big", huge)
    ps.load(big)  # fine in float32
    with pytest.raises(CheckpointError, match=rf"{UP}: 1 of 10240 values \(0 NaN, 1 Inf\)"):
        ps.convert(big, tmp_path / "out", dtype="bfloat16", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_count_non_finite(dtype):
    import ml_dtypes

    dt = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    a = np.linspace(-3e38, 3e38, 1001).astype(np.float32)  # finite, but the sum overflows
    assert count_non_finite(a.astype(dt) if dtype == "float32" else (a / 1e30).astype(dt)) == 0
    b = np.zeros(64, dt)
    b[[1, 5]] = np.nan
    b[9] = -np.inf
    assert count_non_finite(b) == 3
    assert count_non_finite(np.zeros(0, dt)) == 0


# -- checksums -------------------------------------------------------------------------

def _flip(converted_copy, fraction):
    """Flips one byte in the largest params data file; returns it."""
    files = [p for p in (converted_copy / "params").rglob("*") if p.is_file()]
    f = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[int(len(data) * fraction)] ^= 0xFF
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.5, 0.9])
def test_changed_params_file_is_detected(converted, tmp_path, fraction):
    """A flipped byte either changes an array's values (the checksum names it) or breaks
    the compressed stream orbax reads (the array it cannot read is named)."""
    out = _copy(converted, tmp_path)
    _flip(out, fraction)
    with pytest.raises(CheckpointError) as e:
        ps.load(out)
    msg = str(e.value)
    names = set(marker.array_names(ps.load(converted).stored_params))
    try:
        changed = ps.load(out, verify=False).stored_params
    except CheckpointError as unread:
        # Not decodable: both loads name the same arrays.
        assert str(unread) == msg and "cannot read " in msg
        named = msg.split("cannot read ")[1].split(" (damaged")[0].split(", ")
        assert named and set(named) <= names, msg
        return
    good = marker.array_names(ps.load(converted).stored_params)
    differ = [n for n, a in marker.array_names(changed).items()
              if not np.array_equal(np.asarray(a), np.asarray(good[n]))]
    assert differ and f"checksum mismatch in {', '.join(differ)}:" in msg, msg


def test_generate_no_verify_flag(converted, tmp_path, capsys):
    from packed_ss_jax.cli import generate_main

    out = _copy(converted, tmp_path)
    _flip(out, 0.5)
    # An out-of-vocabulary prompt fails right after loading: no decode program is compiled.
    args = ["--model", str(out), "--ids", "99999", "--max-new-tokens", "2", "--schedule", "ar"]
    assert generate_main(args) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    assert generate_main(args + ["--no-verify"]) == 2
    err = capsys.readouterr().err
    assert "checksum" not in err and "outside the vocabulary" in err


# -- damaged markers -------------------------------------------------------------------

def _set(path, value):
    def edit(meta):
        d = meta
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return edit


def _drop(path):
    def edit(meta):
        d = meta
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]
    return edit


def _unchecked(path, value):
    """`_set` in a marker without the config checksum."""
    def edit(meta):
        _set(path, value)(meta)
        del meta["checksums"]
    return edit


def _first_array(meta):
    return next(iter(meta["arrays"].values()))


# (case, edit of the marker JSON or raw text, error type, message fragment)
DAMAGED = [
    ("truncated", "{\"format\": \"packed_ss_jax\"", CheckpointError, "not valid JSON"),
    ("binary", b"\xff\xfe\x00", CheckpointError, "cannot read it"),
    ("a list", "[1, 2]", CheckpointError, "expected a JSON object, found list"),
    ("other format", _set(["format"], "hf"), CheckpointError, "'format' is 'hf'"),
    ("future version", _set(["version"], 99), CheckpointError, "format version 99"),
    ("version as text", _set(["version"], "2"), CheckpointError, "format version '2'"),
    ("no config", _drop(["config"]), CheckpointError, r"missing keys \['config'\]"),
    ("unknown key", _set(["extra"], 1), CheckpointError, r"unknown keys \['extra'\]"),
    ("config not an object", _set(["config"], [1]), ConfigError, "'config' must be an object"),
    ("string for int", _set(["config", "hidden_size"], "64"), ConfigError,
     "config field 'hidden_size' must be int, found '64'"),
    ("float for int", _set(["config", "num_layers"], 2.5), ConfigError,
     "config field 'num_layers' must be int"),
    ("int for bool", _set(["config", "qk_norm"], 1), ConfigError,
     "config field 'qk_norm' must be bool"),
    ("bool for int", _set(["config", "vocab_size"], True), ConfigError,
     "config field 'vocab_size' must be int"),
    ("NaN eps", _set(["config", "rms_norm_eps"], float("nan")), ConfigError,
     "config field 'rms_norm_eps' must be float"),
    ("missing field", _drop(["config", "vocab_size"]), ConfigError,
     r"is missing the fields \['vocab_size'\]"),
    ("unknown field", _set(["config", "color"], "red"), ConfigError,
     r"unknown fields \['color'\]"),
    ("invalid value", _set(["config", "mask_token_id"], 10 ** 6), ConfigError,
     "mask_token_id 1000000 is outside the vocabulary"),
    ("config edited", _set(["config", "intermediate_size"], 96), CheckpointError,
     r"packed_ss_config.json: its 'config' changed after conversion \(checksum mismatch\)"),
    # Without the config checksum (an older conversion), the params' shapes catch it.
    ("config disagrees with params", _unchecked(["config", "intermediate_size"], 96),
     CheckpointError,
     r"(?s)params do not match .*layers/mlp/up_proj: the config gives \[2, 64, 96\] float32, "
     r"params/ has \[2, 64, 160\] float32"),
    ("more layers than stored", _unchecked(["config", "num_layers"], 3), CheckpointError,
     "params do not match"),
    ("arrays list disagrees", lambda m: _first_array(m).update(shape=[1, 2]), CheckpointError,
     r"embed: the config gives \[320, 64\] float32, the arrays list of packed_ss_config.json "
     r"has \[1, 2\]"),
    ("array missing from list", lambda m: m["arrays"].pop("embed"), CheckpointError,
     "missing from the arrays list of packed_ss_config.json: embed"),
    ("bad checksum entry", lambda m: _first_array(m).update(sha256="xyz"), CheckpointError,
     "arrays entry 'embed' must be"),
    ("files not a list", _set(["files"], "params"), CheckpointError, "'files' must be a list"),
]


@pytest.mark.parametrize("case,edit,error,match", DAMAGED, ids=[d[0] for d in DAMAGED])
def test_damaged_marker(converted, tmp_path, case, edit, error, match):
    out = _copy(converted, tmp_path)
    file = out / store.MARKER
    if isinstance(edit, (str, bytes)):
        file.write_bytes(edit.encode() if isinstance(edit, str) else edit)
    else:
        meta = json.loads(file.read_text())
        edit(meta)
        file.write_text(json.dumps(meta))
    with pytest.raises(error, match=match) as e:
        ps.load(out)
    assert str(out) in str(e.value)  # names the directory or the marker file


def test_params_directory_missing(converted, tmp_path):
    out = _copy(converted, tmp_path)
    shutil.rmtree(out / "params")
    with pytest.raises(CheckpointError, match="no params/ directory"):
        ps.load(out)


@pytest.mark.parametrize("version", marker.EARLIER_VERSIONS)
def test_earlier_format_is_refused_naming_the_version(converted, nemotron_dir, tmp_path, version):
    """An output of a pre-release format (version 1: the config alone; version 2: params/
    stacked, no config checksums) is not read: loading names the version found and asks
    for `packed-ss convert` again, and --overwrite leaves it alone (this packed_ss_jax
    cannot check what it holds)."""
    out = _copy(converted, tmp_path)
    meta = json.loads((out / store.MARKER).read_text())
    old = {"format": meta["format"], "version": version, "config": meta["config"]}
    if version == 2:
        old.update(arrays=meta["arrays"], files=meta["files"])
    (out / store.MARKER).write_text(json.dumps(old))
    with pytest.raises(marker.FormatVersionError) as e:
        ps.load(out)
    assert isinstance(e.value, CheckpointError) and e.value.version == version
    assert str(e.value) == (
        f"{out / store.MARKER}: format version {version}, written by a pre-release "
        f"packed_ss_jax; this one reads only version {marker.VERSION}. Run `packed-ss convert` "
        "on the original checkpoint again (into a new directory, or remove this one first)")
    refusal = (f"{out} is a conversion in format version {version}, which this packed_ss_jax "
               "no longer reads, so it is not replaced; remove it, then convert again")
    assert store.replace_refusal(out) == refusal
    before = snapshot(out)
    with pytest.raises(DestinationError) as refused:
        ps.convert(nemotron_dir, out, dtype="float32", overwrite=True, progress=False)
    assert str(refused.value) == refusal
    assert snapshot(out) == before
    shutil.rmtree(out)
    ps.convert(nemotron_dir, out, dtype="float32", progress=False)
    assert json.loads((out / store.MARKER).read_text())["version"] == marker.VERSION
