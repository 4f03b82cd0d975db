"""The converter: orbax output, dtype choice, atomic overwrite, CLI."""

import numpy as np
import pytest
import jax

import packed_ss_jax as ps
from packed_ss_jax.cli import convert_main


def leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_roundtrip_float32(nemotron_dir, tmp_path):
    out = ps.convert(nemotron_dir, tmp_path / "f32", dtype="float32", progress=False)
    direct, converted = ps.load(nemotron_dir), ps.load(out)
    assert converted.config == direct.config
    assert converted.config.lora_rank == 4  # the adapter is picked up by default
    assert leaves_equal(direct.params, converted.params)


def test_bfloat16_storage_and_cast(nemotron_dir, tmp_path):
    out = ps.convert(nemotron_dir, tmp_path / "bf16", dtype="bfloat16", lora=False, progress=False)
    m = ps.load(out, dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(m.params)} == {np.dtype("bfloat16")}
    f32 = ps.load(out)  # stored bf16, restored as float32
    assert {x.dtype for x in jax.tree.leaves(f32.params)} == {np.dtype("float32")}
    ref = ps.load(nemotron_dir, lora=False)
    err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
              for a, b in zip(jax.tree.leaves(f32.params), jax.tree.leaves(ref.params)))
    assert 0 < err < 2e-2  # bf16 rounding, nothing worse


def test_existing_output_needs_overwrite(nemotron_dir, tmp_path):
    out = tmp_path / "out"
    ps.convert(nemotron_dir, out, dtype="float32", lora=False, progress=False)
    with pytest.raises(FileExistsError, match="already exists"):
        ps.convert(nemotron_dir, out, dtype="float32", progress=False)
    ps.convert(nemotron_dir, out, dtype="float32", lora=True, overwrite=True, progress=False)
    assert ps.load(out).config.lora_rank == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_cli(nemotron_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    assert convert_main([str(nemotron_dir), str(out), "--dtype", "float32", "--no-lora"]) == 0
    err = capsys.readouterr().err
    assert "weights: 21/21 tensors" in err and f"wrote {out}" in err
    assert ps.load(out).config.lora_rank == 0
    assert convert_main([str(nemotron_dir), str(out), "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert convert_main([str(tmp_path / "missing"), str(tmp_path / "x"), "--quiet"]) == 2
