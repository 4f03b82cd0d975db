"""Converting and loading never hold a second copy of the weights.

Real-size memory cannot be measured here (benchmarks/real_size.py does, at the 3B and
8B shapes); these tests pin down the structure that bounds it, on a small synthetic
release-layout checkpoint (bf16 shards, several layers):

- the Hugging Face reader takes one tensor at a time and drops it before the next, and
  builds the decoding layout (`layer_{i}`) directly: no weight stacked over the layers;
- a converted directory holds params/ per layer, and is read back a layer at a time;
- the NumPy memory in flight (tracemalloc traces NumPy's buffers) stays within the
  weights plus a few tensors, for convert and both loads: orbax's default deep copy, a
  stacked copy or a NumPy copy before each device transfer would each exceed it.
"""

import gc
import json
import tracemalloc
import weakref

import jax
import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import loading
from packed_ss_jax.checkpoints import marker, restoring, store
from packed_ss_jax.checkpoints.assemble import Progress
from packed_ss_jax.checkpoints.errors import CheckpointError
from packed_ss_jax.checkpoints.safetensors_io import SafetensorsDir
from packed_ss_jax.config import ModelConfig
from packed_ss_jax.nemotron import checkpoint as nemotron
from packed_ss_jax.training import export
from tools import synthetic_checkpoint as synthetic

LAYERS = 4


def _config() -> ModelConfig:
    return ModelConfig(family="nemotron", vocab_size=2048, hidden_size=256, num_layers=LAYERS,
                       num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=768,
                       rms_norm_eps=1e-5, mask_token_id=2047, eos_token_id=2, bos_token_id=1,
                       block_size=4, max_position_embeddings=256, rope_theta=10000.0,
                       dtype="bfloat16")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A release-layout directory: bf16 tensors in three shards with an index."""
    c = _config()
    out = tmp_path_factory.mktemp("bounded") / "hf"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(export.hf_config(c)))
    specs = synthetic.tensors(c, nemotron.table(c))
    shards = synthetic.shard_plan(specs, 3 * 2**20)
    assert len(shards) >= 3
    weight_map = {}
    for i, part in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        synthetic.write_safetensors(out / name, part, seed=5)
        weight_map.update({n: name for n, _, _ in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


@pytest.fixture(scope="module")
def converted(checkpoint, tmp_path_factory):
    return ps.convert(checkpoint, tmp_path_factory.mktemp("bounded") / "converted",
                      dtype="bfloat16", progress=False)


def _weight_bytes(c) -> int:
    from packed_ss_jax import model as model_lib

    return sum(x.size * 2 for x in jax.tree.leaves(model_lib.abstract_params(c)))


def _largest(c) -> int:
    from packed_ss_jax import model as model_lib

    return max(x.size // (c.num_layers if n.startswith("layers/") else 1) * 2
               for n, x in marker.array_names(model_lib.abstract_params(c)).items())


def test_reader_takes_one_tensor_at_a_time_into_the_decoding_layout(checkpoint, monkeypatch):
    real_get = SafetensorsDir.get
    handed_out: list = []  # NumPy arrays are freed by reference counting, no gc needed
    overlaps = []

    def get(self, name):
        alive = [n for n, ref in handed_out if ref() is not None]
        if alive:
            overlaps.append((name, alive))
        a = real_get(self, name)
        assert isinstance(a, np.memmap)  # read lazily: nothing is read before it is used
        handed_out.append((name, weakref.ref(a)))
        return a

    monkeypatch.setattr(SafetensorsDir, "get", get)
    c = loading.hf_config(checkpoint, "bfloat16", None)
    params = loading.read_weights(checkpoint, c, place=jax.device_put)
    assert not overlaps, f"source tensors still alive at the next read: {overlaps[:3]}"
    assert len(handed_out) == 3 + 9 * LAYERS
    assert "layers" not in params
    assert sorted(k for k in params if k.startswith("layer_")) == [f"layer_{i}" for i in range(LAYERS)]
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
    # The same weights as the stacked (stored) layout describes.
    up = SafetensorsDir(checkpoint).get("encoder.layers.2.mlp.up_proj.weight")
    np.testing.assert_array_equal(np.asarray(params["layer_2"]["mlp"]["up_proj"]), up.T)


def test_converted_params_are_stored_and_read_per_layer(converted, monkeypatch):
    meta = json.loads((converted / store.MARKER).read_text())
    assert meta["version"] == marker.VERSION == 3
    # The marker speaks the stored layout; params/ holds one array per layer weight.
    assert meta["arrays"]["layers/mlp/up_proj"]["shape"] == [LAYERS, 256, 768]
    names = marker.array_names(restoring._metadata(converted / "params"))
    assert "layer_3/mlp/up_proj" in names and not any(n.startswith("layers/") for n in names)
    reads, refs, late = [], [], []
    real_read = restoring._read

    def read(params_dir, item):
        # While group k is read, group k-1 may still be hashed: nothing older is alive.
        late.extend(n for k, group in enumerate(refs[:-1]) for n, r in group if r() is not None)
        got = real_read(params_dir, item)
        reads.append(sorted(got))
        refs.append([(n, weakref.ref(a)) for n, a in got.items()])
        return got

    monkeypatch.setattr(restoring, "_read", read)
    # A device array may adopt its host array (on the CPU, when aligned) and so keep it
    # alive: copy first, so that whatever stays alive is held by the reader.
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **kw: real_put(np.array(x), *a, **kw))
    m = ps.load(converted, dtype="bfloat16")
    assert not late, f"restored arrays kept past the next group: {late[:3]}"
    assert "layers" not in m.params
    for names_read in reads:  # one whole-model array, or the arrays of one layer
        heads = {n.split("/")[0] for n in names_read}
        assert len(names_read) == 1 or (len(heads) == 1 and heads.pop().startswith("layer_")), \
            names_read
    assert len(reads) == 3 + LAYERS


def _numpy_peak(fn):
    """fn's result and the peak of traced allocations (NumPy's buffers included) above
    what was traced before."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return out, peak


def test_memory_in_flight_is_the_weights_plus_a_few_tensors(checkpoint, converted, tmp_path,
                                                              monkeypatch):
    c = _config()
    weights, largest = _weight_bytes(c), _largest(c)
    slack = 2 * largest + 2**20  # the tensor being copied, and Python's own bookkeeping
    assert weights > 8 * largest  # so that a second copy of the weights would show

    # (`converted` has run one conversion already: imports are not counted.)
    _, peak = _numpy_peak(lambda: ps.convert(checkpoint, tmp_path / "out", dtype="bfloat16",
                                             progress=False))
    assert peak < weights + slack, f"convert: {peak / weights:.2f}x the weights in flight"

    ps.load(checkpoint, dtype="bfloat16")  # imports
    if jax.default_backend() == "cpu":
        # The device arrays adopt the host copies (no second copy anywhere), so the traced
        # host memory is all the memory the weights take.
        adopted = []
        real_put = jax.device_put

        def device_put(x, *a, **kw):
            y = real_put(x, *a, **kw)
            adopted.append(y.unsafe_buffer_pointer() == x.ctypes.data)
            return y

        monkeypatch.setattr(jax, "device_put", device_put)
    _, peak = _numpy_peak(lambda: ps.load(checkpoint, dtype="bfloat16"))
    assert peak < weights + slack, f"load: {peak / weights:.2f}x the weights"
    if jax.default_backend() == "cpu":
        assert len(adopted) == 3 + 9 * LAYERS and all(adopted), adopted


def test_loads_agree_and_stored_layout_still_available(checkpoint, converted):
    direct, restored = ps.load(checkpoint, dtype="bfloat16"), ps.load(converted, dtype="bfloat16")
    for a, b in zip(jax.tree.leaves(direct.params), jax.tree.leaves(restored.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    stored = restored.stored_params
    assert stored["layers"]["mlp"]["up_proj"].shape == (LAYERS, 256, 768)
    # The marker's checksum of a stacked weight is that of the stack's bytes.
    meta = json.loads((converted / store.MARKER).read_text())
    assert meta["arrays"]["layers/attn/q_proj"]["sha256"] == marker.checksum(
        np.asarray(stored["layers"]["attn"]["q_proj"]))


def test_progress_reports_bytes_elapsed_and_rate(capsys):
    bar = Progress(3, "weights", True, total_bytes=3 * 10**9, every=0.0)
    for _ in range(3):
        bar.step(nbytes=10**9)
    err = capsys.readouterr().err
    last = err.split("\r")[-1]
    assert last.startswith("weights: 3/3 tensors, 3.00 GB of 3.00 GB (100.0%),"), last
    assert last.rstrip().endswith("/s") and last.endswith("\n")
    quiet = Progress(3, "weights", False, total_bytes=3)
    quiet.step(nbytes=3)
    assert capsys.readouterr().err == ""


def test_stacked_params_are_refused(converted, tmp_path):
    """params/ stacked over the layers (`layers/...`) is the layout of an earlier format:
    a version-3 marker over it is refused before any array is read, naming the arrays."""
    import orbax.checkpoint as ocp

    good = ps.load(converted, dtype="bfloat16")
    old = tmp_path / "stacked"
    old.mkdir()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(old / "params", jax.tree.map(np.asarray, good.stored_params))
    checkpointer.wait_until_finished()
    (old / "config.json").write_bytes((converted / "config.json").read_bytes())
    meta = json.loads((converted / store.MARKER).read_text())
    del meta["sizes"]  # of the per-layer files
    (old / store.MARKER).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"params/ holds arrays stacked over the layers "
                                              r"\(.*layers/mlp/up_proj.*\).*convert again"):
        ps.load(old, dtype="bfloat16")
