"""The committed fixture set (tests/fixtures) is what its manifest says it is.

Fast checks: every file has the recorded size and SHA-256, every array the tests read
is there with its recorded shape and dtype, and every recorded transformers-vs-NumPy
difference is within the tolerance. The slow check reruns the generator and compares
the files byte for byte (it needs the `reference` extra and the recorded versions).
"""

import hashlib
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
TOLERANCE = 1e-4

# Every array the tests (and the external set's conventions) rely on, per family.
_WHOLE = ["tokens", "positions", "mask", "logits"]
_FULL = ["full_tokens", "full_positions", "full_mask", "rows"]
REQUIRED = {
    "nemotron_tiny": (
        ["rope_inv_freq", "rope_attention_scaling", "ar_tokens", "ar_logits", "long_tokens",
         "long_logits", "long_llama4_q_scale", "prefix_tokens", "prefix_logits",
         "packed_half", "lora_block_logits", "lora_all_block_logits", "greedy_prompt",
         "greedy_continuation", "greedy_margins"]
        + [f"{x}_{s}" for x in ("block", "packed") for s in _WHOLE + _FULL]),
    "setdlm_tiny": (
        ["train_tokens", "train_order", "train_input_tokens", "train_positions", "train_mask",
         "train_targets", "train_logits", "train_logits_clean", "prefix_tokens",
         "prefix_logits", "packed_segments"]
        + [f"{x}_{s}" for x in ("window", "step", "packed") for s in _WHOLE + _FULL]
        + [f"train_{s}" for s in _FULL]),
}
FAMILY = {"nemotron_tiny": "nemotron", "setdlm_tiny": "setdlm"}


@pytest.fixture(scope="module")
def manifest():
    return json.loads((FIXTURES / "manifest.json").read_text())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_files_match_the_manifest(manifest):
    listed = manifest["files"]
    on_disk = {p.relative_to(FIXTURES).as_posix() for p in FIXTURES.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts} - {"manifest.json"}
    assert on_disk == set(listed), "files not in the manifest or missing from disk"
    for rel, entry in listed.items():
        path = FIXTURES / rel
        assert path.stat().st_size == entry["bytes"], rel
        assert _sha256(path) == entry["sha256"], rel
    assert manifest["total_bytes"] == sum(e["bytes"] for e in listed.values())
    assert manifest["total_bytes"] < 8 << 20  # a few MB at most in the repository


@pytest.mark.parametrize("folder", sorted(REQUIRED))
def test_arrays_are_present_as_recorded(manifest, folder):
    ref = np.load(FIXTURES / folder / "reference.npz")
    recorded = manifest[FAMILY[folder]]["arrays"]
    assert set(ref.files) == set(recorded)
    assert set(REQUIRED[folder]) <= set(ref.files), set(REQUIRED[folder]) - set(ref.files)
    for name, want in recorded.items():
        assert list(ref[name].shape) == want["shape"], name
        assert str(ref[name].dtype) == want["dtype"], name


def test_recorded_differences_are_within_tolerance(manifest):
    assert manifest["tolerance"] == TOLERANCE
    for family in ("nemotron", "setdlm"):
        m = manifest[family]
        assert m["diffs"], family
        for table in ("diffs", "route_diffs", "identities"):
            for name, value in m[table].items():
                assert 0 <= value <= TOLERANCE, (family, table, name, value)
    assert manifest["worst_diff"] == max(v for f in ("nemotron", "setdlm")
                                         for v in manifest[f]["diffs"].values())


def test_greedy_continuation_is_clear(manifest):
    """No MASK or EOS in it, and top-2 gaps far above float32 noise."""
    p = manifest["params"]["nemotron"]
    ref = np.load(FIXTURES / "nemotron_tiny" / "reference.npz")
    cont = ref["greedy_continuation"]
    assert len(cont) == p["greedy_new"] and len(ref["greedy_prompt"]) == p["greedy_prompt_len"]
    assert not np.isin(cont, [p["mask_id"], p["eos_id"]]).any()
    assert ref["greedy_margins"].min() >= 1e-3


def _installed(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.mark.slow
def test_generator_reproduces_the_committed_files(manifest, tmp_path):
    if _installed("torch") is None or _installed("transformers") is None:
        pytest.skip("torch and transformers are not installed (pip install -e '.[reference]')")
    # Other versions may round the reference logits differently in the last bit.
    packages = ("numpy", "safetensors", "torch", "transformers")
    have = {k: _installed(k) for k in packages}
    recorded = {k: manifest["versions"][k].split("+")[0] for k in packages}
    if have != recorded:
        pytest.skip(f"the fixtures were made with {recorded}; installed: {have}")
    out = tmp_path / "fixtures"
    proc = subprocess.run([sys.executable, "-m", "tools.fixtures", "--out", str(out),
                           "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    made = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert made == sorted(list(manifest["files"]) + ["manifest.json"])
    for rel in made:
        assert (out / rel).read_bytes() == (FIXTURES / rel).read_bytes(), rel
