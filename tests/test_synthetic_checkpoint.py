"""The synthetic release-layout checkpoint writer, on its tiny shape."""

import json

import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax.nemotron import checkpoint as nemotron
from tools import synthetic_checkpoint as synthetic


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return synthetic.write("tiny", tmp_path_factory.mktemp("synthetic") / "nld-tiny", seed=3)


def test_release_layout(written):
    index = json.loads((written / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    data = sum((written / f).stat().st_size - _header_bytes(written / f) for f in files)
    assert index["metadata"]["total_size"] == data
    c = synthetic.model_config("tiny")
    assert set(index["weight_map"]) == {name for e in nemotron.table(c) for name in
                                        ([e.name.format(i=i) for i in range(c.num_layers)]
                                         if e.layer else [e.name])}
    adapter = json.loads((written / nemotron.LORA_DIR / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["target_modules"]) == (4, 16, ["o_proj"])


def _header_bytes(file):
    with open(file, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_loads_with_finite_spread_logits(written):
    m = ps.load(written, dtype="bfloat16")
    c = m.config
    assert (c.lora_rank, c.lora_alpha, c.head_dim, c.hidden_size) == (4, 16.0, 32, 64)
    T = 16
    logits = ps.logits(m, np.arange(T) * 7 % c.vocab_size, np.arange(T),
                       np.tril(np.ones((T, T), bool)))
    assert np.isfinite(logits).all()
    spread = logits.std(axis=-1)
    assert np.all((spread > 1.0) & (spread < 20.0)), spread  # neither flat nor one-hot
    top = logits.argmax(axis=-1)
    assert len(set(top.tolist())) > 1  # not the same token everywhere


def test_seeded_and_never_overwrites(written, tmp_path):
    again = synthetic.write("tiny", tmp_path / "again", seed=3, lora=False)
    name = "encoder.layers.1.mlp.down_proj.weight"
    a, b = (nemotron.SafetensorsDir(d).get(name) for d in (written, again))
    np.testing.assert_array_equal(a, b)
    assert not (again / nemotron.LORA_DIR).exists()
    with pytest.raises(FileExistsError):
        synthetic.write("tiny", written)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]  # no partial directory left
