"""What a checkpoint's files say about the model is checked before it runs.

A converted checkpoint's config (the `config` of packed_ss_config.json, which the loader
uses, and the copied config.json) is covered by checksums written at conversion: any
edit is refused while verifying, as an edited array is. Every number of a config is
range-checked at load, named as its file spells it, for Hugging Face directories of
both families. A truncated params file fails the load with one line and nothing else
on stderr.
"""

import asyncio
import copy
import json
import math
import shutil
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import packed_ss_jax as ps
from packed_ss_jax import families, rope
from packed_ss_jax import model as model_lib
from packed_ss_jax.checkpoints import store
from packed_ss_jax.checkpoints.orbax_noise import OrbaxNoise
from packed_ss_jax.checkpoints.errors import CheckpointError
from packed_ss_jax.cli import generate_main
from packed_ss_jax.config import (FLOAT_MAX, FLOAT_TINY, INT_MAX, MATMUL_PRECISION_NAMES,
                                  MIN_BLOCK, ConfigError, ModelConfig, read_hf_config)
from packed_ss_jax.nemotron import checkpoint as nemotron

REFUSED = (ConfigError, CheckpointError)
NAN, INF = float("nan"), float("inf")
EXAMPLES = settings(max_examples=40, derandomize=True, deadline=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def converted(nemotron_dir, setdlm_dir, tmp_path_factory):
    """A converted copy of each family's fixture (one conversion each, shared)."""
    root = tmp_path_factory.mktemp("converted")
    return {family: ps.convert(src, root / family, dtype="float32", progress=False)
            for family, src in (("nemotron", nemotron_dir), ("setdlm", setdlm_dir))}


class Marker:
    """The marker of a converted directory, edited for one load and then put back."""

    def __init__(self, out: Path):
        self.file = out / store.MARKER
        self.text = self.file.read_text()

    def meta(self) -> dict:
        return json.loads(self.text)

    def write(self, meta: dict):
        self.file.write_text(json.dumps(meta, indent=2))

    def restore(self):
        self.file.write_text(self.text)


def _load_refused(out: Path, **kw) -> str:
    with pytest.raises(REFUSED) as e:
        ps.load(out, **kw)
    return str(e.value)


# -- the converted config is covered by checksums -----------------------------------------

def _config_values(field: str, value):
    """Values a config field might be edited to: its type's, valid or not."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, str):
        return st.sampled_from(["nemotron", "setdlm", "default", "yarn", "linear", "float32",
                                "bfloat16", "high", "highest", ""])
    if isinstance(value, float):
        return st.floats(allow_nan=False, allow_infinity=False, width=32) | st.sampled_from(
            [value * 2, value / 2, -value, 0.0])
    ints = st.integers(-2, 2 ** 33) | st.sampled_from([2 ** 70, 0, 1, 2])
    return ints | st.none() if value is None or field.endswith("token_id") else ints


@pytest.mark.parametrize("family", ["nemotron", "setdlm"])
@EXAMPLES
@given(data=st.data())
def test_any_edit_of_the_converted_config_is_refused(converted, family, data):
    """Whatever field changes to whatever value, the load is refused naming the marker,
    by the range checks or by the config checksum, before the params are looked at."""
    out = converted[family]
    m = Marker(out)
    meta = m.meta()
    field = data.draw(st.sampled_from(sorted(meta["config"])), label="field")
    old = meta["config"][field]
    new = data.draw(_config_values(field, old).filter(
        lambda v: v != old or type(v) is not type(old)), label="value")
    meta["config"][field] = new
    m.write(meta)
    try:
        msg = _load_refused(out)
    finally:
        m.restore()
    assert msg.startswith(f"{out / store.MARKER}: "), msg


# The fields the loaded model decodes with, edited to other valid values: only the
# checksum can tell (the arrays are unchanged).
SILENT_EDITS = {
    "nemotron": dict(rope_theta=10000.0, rms_norm_eps=1e-6, rope_factor=8.0,
                     rope_type="default", eos_token_id=3, mask_token_id=101, lora_alpha=8.0,
                     max_position_embeddings=64, block_size=4, llama4_scaling_beta=0.0,
                     rope_original_max_position=16, rope_beta_fast=16.0, rope_mscale=0.5),
    "setdlm": dict(rope_theta=10000.0, rms_norm_eps=1e-5, eos_token_id=1, mask_token_id=298,
                   bos_token_id=0, block_size=8, max_position_embeddings=256),
}
SILENT_CASES = [(f, k, v) for f, edits in SILENT_EDITS.items() for k, v in edits.items()]


@pytest.mark.parametrize("family,field,value", SILENT_CASES,
                         ids=[f"{f}-{k}" for f, k, _ in SILENT_CASES])
def test_a_valid_edit_of_the_converted_config_fails_its_checksum(converted, family, field,
                                                                  value):
    out = converted[family]
    m = Marker(out)
    meta = m.meta()
    assert meta["config"][field] != value
    meta["config"][field] = value
    m.write(meta)
    try:
        msg = _load_refused(out)
        assert msg.startswith(f"{out / store.MARKER}: its 'config' changed after conversion "
                              "(checksum mismatch)"), msg
        assert "convert again, or pass verify=False / --no-verify" in msg and "\n" not in msg
        # verify=False loads it, with the edit
        assert getattr(ps.load(out, verify=False).config, field) == value
    finally:
        m.restore()


CONFIG_JSON_EDITS = {
    "nemotron": [("rope_parameters", "rope_theta", 10000.0), (None, "rms_norm_eps", 1e-6),
                 ("rope_parameters", "factor", 8.0), ("rope_parameters", "rope_type", "default"),
                 (None, "eos_token_id", 3), (None, "mask_token_id", 101),
                 (None, "max_position_embeddings", 64), (None, "block_size", 4)],
    "setdlm": [("qwen3_config", "rope_theta", 10000.0), ("qwen3_config", "rms_norm_eps", 1e-5),
               (None, "eos_token_id", 1), (None, "mask_token_id", 298),
               ("noise_config", "desired_block_size", 8)],
}
JSON_CASES = [(f, *e) for f, edits in CONFIG_JSON_EDITS.items() for e in edits]


@pytest.mark.parametrize("family,section,key,value", JSON_CASES,
                         ids=[f"{f}-{k}" for f, _, k, _ in JSON_CASES])
def test_an_edit_of_the_copied_config_json_is_refused(converted, family, section, key, value):
    """The copied config.json does not configure a converted model (the marker does), so
    an edit there would silently not take effect: it is refused, naming config.json."""
    out = converted[family]
    file = out / "config.json"
    original = file.read_text()
    cfg = json.loads(original)
    node = cfg[section] if section else cfg
    assert node[key] != value
    node[key] = value
    file.write_text(json.dumps(cfg, indent=2))
    try:
        msg = _load_refused(out)
        assert msg.startswith(f"{file}: changed after conversion (checksum mismatch)"), msg
        assert "\n" not in msg
        ps.load(out, verify=False)
    finally:
        file.write_text(original)


def test_reformatting_the_marker_or_losing_config_json(converted):
    out = converted["nemotron"]
    m = Marker(out)
    try:
        # The same values in another layout: the checksum is of the values.
        meta = m.meta()
        meta["config"] = dict(reversed(list(meta["config"].items())))
        m.file.write_text(json.dumps(meta, separators=(",", ":")))
        ps.load(out)
    finally:
        m.restore()
    held = out.parent / "held-config.json"
    shutil.move(out / "config.json", held)
    try:
        msg = _load_refused(out)
        assert msg.startswith(f"{out / 'config.json'}: missing"), msg
        ps.load(out, verify=False)
    finally:
        shutil.move(held, out / "config.json")


def test_no_verify_on_the_command_line(converted, capsys):
    out = converted["nemotron"]
    m = Marker(out)
    meta = m.meta()
    meta["config"]["rope_theta"] = 10000.0
    m.write(meta)
    # An out-of-vocabulary prompt fails right after loading: no decode program is compiled.
    args = ["--model", str(out), "--ids", "99999", "--max-new-tokens", "2", "--schedule", "ar"]
    try:
        assert generate_main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "'config' changed after conversion" in err[0]
        assert generate_main(args + ["--no-verify"]) == 2
        err = capsys.readouterr().err
        assert "changed" not in err and "outside the vocabulary" in err
    finally:
        m.restore()


def test_a_conversion_from_before_config_checksums_loads_with_one_warning(converted):
    out = converted["setdlm"]
    m = Marker(out)
    meta = m.meta()
    del meta["checksums"], meta["sizes"]
    meta["config"]["rope_theta"] = 10000.0  # not detected: nothing to compare with
    m.write(meta)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert ps.load(out).config.rope_theta == 10000.0
        (only,) = _checksum_warnings(w)
        msg = str(only.message)
        assert "records no checksum of its config" in msg and "convert again" in msg
        assert "\n" not in msg and only.filename == __file__  # points at the caller's load
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            ps.load(out, verify=False)
        assert not _checksum_warnings(w)
    finally:
        m.restore()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ps.load(out)  # a current conversion: no warning
    assert not _checksum_warnings(w)


def _checksum_warnings(caught) -> list:
    return [w for w in caught if "checksum" in str(w.message)]


@pytest.mark.parametrize("key,value,match", [
    ("checksums", {"config": "xyz"}, "'checksums' must be"),
    ("checksums", {"config.json": "0" * 64}, "'checksums' must be"),
    ("checksums", {"config": "0" * 64, "../etc/passwd": "0" * 64}, "'checksums' must be"),
    ("checksums", [], "'checksums' must be"),
    ("sizes", {"params/a": -1}, "'sizes' must map"),
    ("sizes", {"params/../../a": 1}, "'sizes' must map"),
    ("sizes", {"config.json": 1}, "'sizes' must map"),
    ("sizes", {"params/a": 1.5}, "'sizes' must map"),
])
def test_damaged_checksum_entries(converted, key, value, match):
    out = converted["nemotron"]
    m = Marker(out)
    meta = m.meta()
    meta[key] = value
    m.write(meta)
    try:
        with pytest.raises(CheckpointError, match=match) as e:
            ps.load(out)
        assert str(out / store.MARKER) in str(e.value)
    finally:
        m.restore()


# -- every number of a Hugging Face config.json is range-checked ---------------------------

DELETE = object()
# (family, {dotted key: value or DELETE}, key the message must name). Each value is at or
# past the bound of its field (fixtures: Nemotron vocab 320, 4 heads over 2 KV heads,
# hidden 64, head_dim 32, block 8 of 128 positions, YaRN x4 over 32; SetDLM vocab 300,
# window 4 of 512 positions, 2 layers).
_N, _S = "nemotron", "setdlm"
_Q = "qwen3_config."
_R = "rope_parameters."
BAD_INTS = [0, -1, INT_MAX + 1, 2 ** 70, 1.5, True, "8", 1e30]
REFUSED_CASES = (
    [(_N, {k: v}, k) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                               "vocab_size", "intermediate_size") for v in BAD_INTS]
    + [(_N, {k: v}, k) for k in ("head_dim", "num_key_value_heads", "max_position_embeddings")
       for v in (0, -1, INT_MAX + 1, 2 ** 70)]
    + [(_N, {k: v}, k) for k in ("mask_token_id", "eos_token_id", "bos_token_id")
       for v in (-1, 320, INT_MAX + 1, 2 ** 70, True, 1.5)]
    + [(_N, {"eos_token_id": [320, 2]}, "eos_token_id"),
       (_N, {"vocab_size": 100}, "vocab_size"),  # the MASK id 100 is now outside it
       (_N, {"num_attention_heads": 3}, "num_key_value_heads"),
       (_N, {"num_key_value_heads": 3}, "num_key_value_heads"),
       (_N, {"num_key_value_heads": 8}, "num_key_value_heads"),
       (_N, {"head_dim": 33}, "head_dim"),
       (_N, {"head_dim": DELETE, "num_attention_heads": 6}, "num_attention_heads"),
       (_N, {"head_dim": DELETE, "num_attention_heads": 128, "num_key_value_heads": 128},
        "num_attention_heads"),
       (_N, {"max_position_embeddings": 7}, "max_position_embeddings")]  # < block 8
    + [(_N, {"block_size": v}, "block_size") for v in (0, 1, 129, INT_MAX + 1, 2.5)]
    + [(_N, {"rms_norm_eps": v}, "rms_norm_eps")
       for v in (0, 0.0, -1e-5, FLOAT_TINY / 2, 1e-45, 2.0, 1e39, NAN, INF, -INF, "1e-5")]
    + [(_N, {_R + "rope_theta": v}, "rope_theta")
       for v in (1, 1.0, 0.5, 0, -1e6, NAN, INF, 1e39)]
    + [(_N, {_R + "factor": v}, "factor") for v in (0, -4.0, NAN, INF, 1e39)]
    + [(_N, {_R + "rope_type": v}, "rope_type") for v in ("linear", "dynamic", "llama3", 5)]
    + [(_N, {_R + "beta_fast": v}, "beta_fast") for v in (0, -1.0, 0.5, NAN)]
    + [(_N, {_R + "beta_slow": v}, "beta_slow") for v in (0, -1.0, 33.0, INF)]
    + [(_N, {_R + k: v}, k) for k in ("mscale", "mscale_all_dim") for v in (-1.0, -1e-9, NAN)]
    + [(_N, {_R + "llama_4_scaling_beta": v}, "llama_4_scaling_beta")
       for v in (-0.1, NAN, 1e39)]
    + [(_N, {_R + "original_max_position_embeddings": v}, "original_max_position_embeddings")
       for v in (0, -1, INT_MAX + 1)]
    + [(_S, {_Q + k: v}, k) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                                      "vocab_size", "intermediate_size") for v in BAD_INTS]
    + [(_S, {_Q + k: v}, k) for k in ("head_dim", "num_key_value_heads",
                                      "max_position_embeddings")
       for v in (0, -1, INT_MAX + 1)]
    + [(_S, {k: v}, k) for k in ("mask_token_id", "eos_token_id", "bos_token_id")
       for v in (-1, 300, INT_MAX + 1, 2 ** 70)]
    + [(_S, {_Q + "vocab_size": 299}, "vocab_size"),  # the MASK id 299 is now outside it
       (_S, {_Q + "num_attention_heads": 3}, "num_key_value_heads"),
       (_S, {_Q + "head_dim": 15}, "head_dim"),
       (_S, {_Q + "head_dim": DELETE, _Q + "num_attention_heads": 6}, "num_attention_heads"),
       (_S, {_Q + "max_position_embeddings": 3}, "max_position_embeddings"),  # < window 4
       (_S, {_Q + "num_hidden_layers": 1}, "num_layers"),  # below the 2 layers kept
       (_S, {_Q + "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
       (_S, {_Q + "rope_parameters": {"rope_type": "yarn"}}, "rope_type"),
       (_S, {"mask_token_id": DELETE, "tokenization_config.mask_token_id": 300},
        "tokenization_config.mask_token_id"),
       (_S, {"eos_token_id": DELETE, "tokenization_config.eos_token_id": -1},
        "tokenization_config.eos_token_id")]
    + [(_S, {"backbone_config.num_layers": v}, "num_layers") for v in (0, -1, 3, 2 ** 70)]
    + [(_S, {"noise_config.desired_block_size": v}, "desired_block_size")
       for v in (0, -1, 513, INT_MAX + 1)]
    + [(_S, {_Q + "rms_norm_eps": v}, "rms_norm_eps")
       for v in (0, -1e-6, FLOAT_TINY / 2, 1e39, NAN, INF)]
    + [(_S, {_Q + "rope_theta": v}, "rope_theta") for v in (1, 0.5, 0, -1.0, NAN, INF, 1e39)]
)
# Values at the bounds from the other side: accepted.
ACCEPTED_CASES = [
    (_N, {"block_size": 2}), (_N, {"block_size": 128}), (_N, {"max_position_embeddings": 8}),
    (_N, {"eos_token_id": 319}), (_N, {"mask_token_id": 319}), (_N, {"bos_token_id": 0}),
    (_N, {"eos_token_id": [2, 320]}),  # only the first of a list is used
    (_N, {"rms_norm_eps": FLOAT_TINY}), (_N, {"rms_norm_eps": 1.0}),
    (_N, {_R + "rope_theta": 1.0000001}), (_N, {_R + "rope_theta": FLOAT_MAX}),
    (_N, {_R + "factor": 1e-30}), (_N, {_R + "beta_fast": 1.0}),
    (_N, {_R + "mscale": 0}), (_N, {_R + "llama_4_scaling_beta": 0}),
    (_N, {_R + "original_max_position_embeddings": 1}),
    (_N, {_R + "original_max_position_embeddings": 0, _R + "llama_4_scaling_beta": 0,
          _R + "factor": 1.0}),
    (_N, {"head_dim": DELETE}), (_N, {"max_position_embeddings": 128.0}),
    (_N, {"vocab_size": INT_MAX, "max_position_embeddings": INT_MAX}),
    (_S, {"noise_config.desired_block_size": 1}), (_S, {"noise_config.desired_block_size": 512}),
    (_S, {"mask_token_id": 0}), (_S, {"eos_token_id": 299}),
    (_S, {"backbone_config.num_layers": 1}), (_S, {_Q + "rms_norm_eps": FLOAT_TINY}),
]


def _edited(base: dict, edits: dict) -> dict:
    cfg = copy.deepcopy(base)
    for dotted, value in edits.items():
        *parents, key = dotted.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        if value is DELETE:
            node.pop(key, None)
        else:
            node[key] = value
    return cfg


@pytest.fixture(scope="module")
def hf_configs(nemotron_dir, setdlm_dir):
    return {_N: json.loads((nemotron_dir / "config.json").read_text()),
            _S: json.loads((setdlm_dir / "config.json").read_text())}


def _case_id(case):
    family, edits = case[0], case[1]
    return f"{family}-" + ",".join(f"{k}={v!r}"[:40] for k, v in edits.items()
                                   if v is not DELETE)


@pytest.mark.parametrize("case", REFUSED_CASES, ids=[_case_id(c) for c in REFUSED_CASES])
def test_a_hugging_face_config_out_of_range_is_refused_naming_the_field(hf_configs, tmp_path,
                                                                        case):
    family, edits, key = case
    (tmp_path / "config.json").write_text(json.dumps(_edited(hf_configs[family], edits)))
    with pytest.raises(ConfigError) as e:
        ps.load(tmp_path)  # refused before any weight is looked for
    msg = str(e.value)
    assert key in msg and str(tmp_path / "config.json") in msg and "\n" not in msg, msg


@pytest.mark.parametrize("case", ACCEPTED_CASES, ids=[_case_id(c) for c in ACCEPTED_CASES])
def test_a_hugging_face_config_at_its_bounds_is_accepted(hf_configs, tmp_path, case):
    family, edits = case
    (tmp_path / "config.json").write_text(json.dumps(_edited(hf_configs[family], edits)))
    families.parse_hf_config(read_hf_config(tmp_path))


@pytest.mark.parametrize("alpha", [NAN, INF, -INF, 1e39, "16", True])
def test_a_bad_adapter_alpha_is_refused(nemotron_dir, tmp_path, alpha):
    shutil.copyfile(nemotron_dir / "config.json", tmp_path / "config.json")
    shutil.copytree(nemotron_dir / nemotron.LORA_DIR, tmp_path / nemotron.LORA_DIR)
    file = tmp_path / nemotron.LORA_DIR / "adapter_config.json"
    adapter = json.loads(file.read_text())
    adapter["lora_alpha"] = alpha
    file.write_text(json.dumps(adapter))
    with pytest.raises(CheckpointError) as e:
        ps.load(tmp_path)
    assert "'lora_alpha'" in str(e.value) and str(file) in str(e.value)


def test_the_config_knows_the_names_the_rest_of_the_package_uses():
    assert MIN_BLOCK == {f.name: f.min_width for f in families.FAMILIES.values()}
    assert MATMUL_PRECISION_NAMES == tuple(model_lib.MATMUL_PRECISIONS)


# Fields whose value feeds RoPE, with values from far past both ends of their ranges.
_WIDE_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                         st.sampled_from([0.0, 1.0, -0.0, FLOAT_TINY, FLOAT_MAX, 1e39]))
ROPE_FIELDS = {"rope_theta": _WIDE_FLOATS, "rope_factor": _WIDE_FLOATS,
               "rope_beta_fast": _WIDE_FLOATS, "rope_beta_slow": _WIDE_FLOATS,
               "rope_mscale": _WIDE_FLOATS, "rope_mscale_all_dim": _WIDE_FLOATS,
               "llama4_scaling_beta": _WIDE_FLOATS, "rms_norm_eps": _WIDE_FLOATS,
               "rope_original_max_position": st.integers(-2, 2 ** 40) | st.just(2 ** 70)}


@settings(max_examples=150, derandomize=True, deadline=None)
@given(changes=st.fixed_dictionaries({}, optional=ROPE_FIELDS))
def test_every_accepted_config_gives_finite_rope_tables(hf_configs, changes):
    """Refused, naming a field; or accepted, and then RoPE's tables are finite (no value
    reaches NumPy that makes a NaN, an Inf or a division by zero there)."""
    base = families.parse_hf_config(hf_configs[_N])
    try:
        c = ModelConfig.from_dict(dict(base.to_dict(), **changes))
    except ConfigError as e:
        assert any(k in str(e) for k in changes), str(e)
        return
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        freq = rope.inv_freq(c)
    assert np.isfinite(freq).all() and (freq >= 0).all()
    factor = rope.attention_factor(c)
    assert math.isfinite(factor) and factor > 0
    assert np.float32(c.rms_norm_eps) > 0


# -- a truncated params file: one line, nothing else on stderr -----------------------------

@pytest.fixture
def plain_unraisable_hook(monkeypatch):
    """Python's own unraisable hook, which prints to stderr as a user's process does
    (pytest's turns what reaches it into warnings instead)."""
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)


def _truncated_copy(converted, tmp_path, fraction: float, legacy: bool) -> tuple[Path, Path]:
    """A copy of the converted Nemotron fixture whose largest params file is cut short;
    `legacy`: its marker without the file sizes (a conversion from before they were
    recorded), so that orbax itself meets the cut."""
    out = shutil.copytree(converted["nemotron"], tmp_path / "cut")
    if legacy:
        m = Marker(out)
        meta = m.meta()
        del meta["sizes"]
        m.write(meta)
    f = max((p for p in (out / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = f.read_bytes()
    f.write_bytes(data[:int(len(data) * fraction)])
    return out, f


@pytest.mark.parametrize("verify", [True, False])
def test_a_truncated_params_file_is_named_before_orbax_reads_it(converted, tmp_path, capfd,
                                                                plain_unraisable_hook, verify):
    out, cut = _truncated_copy(converted, tmp_path, 0.5, legacy=False)
    capfd.readouterr()
    with pytest.raises(CheckpointError) as e:
        ps.load(out, verify=verify)
    msg = str(e.value)
    assert msg.startswith(f"{cut}: ") and "(truncated)" in msg and "\n" not in msg, msg
    assert capfd.readouterr() == ("", "")


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 0.75])
def test_a_truncated_params_file_of_an_older_conversion_is_one_line(converted, tmp_path, capfd,
                                                                    plain_unraisable_hook,
                                                                    fraction):
    """orbax meets the cut: its failed read is one CheckpointError, and neither the
    tracebacks tensorstore prints for the reads still in flight nor orbax's log lines
    reach stderr (loaded a few times: those come from other threads, when they come)."""
    out, _ = _truncated_copy(converted, tmp_path, fraction, legacy=True)
    capfd.readouterr()
    for _ in range(3):
        with pytest.raises(CheckpointError) as e:
            ps.load(out)
        assert "\n" not in str(e.value) and "damaged params files" in str(e.value), str(e.value)
    assert capfd.readouterr() == ("", "")


def test_a_truncated_params_file_on_the_command_line(converted, tmp_path, capfd,
                                                     plain_unraisable_hook):
    out, cut = _truncated_copy(converted, tmp_path, 0.5, legacy=True)
    args = ["--model", str(out), "--ids", "1", "--max-new-tokens", "2", "--schedule", "ar"]
    capfd.readouterr()
    assert generate_main(args) == 2
    captured = capfd.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured.err
    assert "cannot read" in captured.err


def _late_callback_to_a_closed_loop(delay: float) -> threading.Timer:
    """What a failed orbax read leaves behind: a tensorstore future awaited on an event
    loop that is closed before the future completes; when it does (`delay` seconds on,
    from another thread), tensorstore's callback meets the closed loop and reports an
    unraisable RuntimeError."""
    import tensorstore as ts

    promise, future = ts.Promise.new()
    loop = asyncio.new_event_loop()

    async def start():
        task = asyncio.ensure_future(future)
        task._log_destroy_pending = False  # the test's own leftover task, not the point
        await asyncio.sleep(0)

    loop.run_until_complete(start())
    loop.close()
    timer = threading.Timer(delay, promise.set_result, args=(None,))
    timer.start()
    return timer


def test_late_callbacks_after_a_failed_read_are_not_printed(capfd, plain_unraisable_hook):
    capfd.readouterr()
    hook = sys.unraisablehook
    with pytest.raises(CheckpointError):
        with OrbaxNoise():
            timer = _late_callback_to_a_closed_loop(0.05)
            raise CheckpointError("a read failed")
    timer.join()
    assert sys.unraisablehook is hook
    assert capfd.readouterr().err == ""
    # Outside a read they are not filtered: the filter is not left behind.
    seen = []
    sys.unraisablehook = seen.append
    try:
        _late_callback_to_a_closed_loop(0.0).join()
        for _ in range(100):
            if seen:
                break
            threading.Event().wait(0.01)
    finally:
        sys.unraisablehook = hook
    assert seen and "Event loop is closed" in str(seen[0].exc_value)
