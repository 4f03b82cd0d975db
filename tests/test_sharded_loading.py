"""On a mesh spanning several processes each reads only the slices of the weights its
own devices hold (checkpoints.assemble.read, SafetensorsDir.get_slice).

One process cannot hold only some devices of a mesh, so `Half` plays a process of a
two-process mesh whose "model" axis (2) spans the processes: it holds one half of each
weight the sharding rules split and all of the others, as `sharding.Placer` reports it.
The two-process run itself is tests/test_multihost.py.
"""

import types

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from packed_ss_jax import loading, sharding
from packed_ss_jax.checkpoints.assemble import slice_shape
from packed_ss_jax.checkpoints.errors import CheckpointError
from packed_ss_jax.checkpoints.safetensors_io import SafetensorsDir, _runs
from packed_ss_jax.nemotron import checkpoint as nemotron
from packed_ss_jax.setdlm import checkpoint as setdlm
from checkpoint_copies import copy_checkpoint

UP = "encoder.layers.1.mlp.up_proj.weight"  # stored [mlp, hidden]: split over its rows
DOWN = "encoder.layers.1.mlp.down_proj.weight"  # stored [hidden, mlp]: over its columns


class Half:
    """The placer of process `which` (0 or 1) of a model=2 mesh over two processes:
    `lazy` returns the one slice it read instead of a device array."""

    with_path = True

    def __init__(self, c, which: int):
        self.config, self.which = c, which
        self.mesh = types.SimpleNamespace(shape={"data": 1, "model": 2})

    def slices(self, shape, path):
        spec = sharding.param_spec(self.config, self.mesh, tuple(path), len(shape))
        spec = tuple(spec) + (None,) * (len(shape) - len(spec))
        return [tuple(slice(self.which * n // 2, (self.which + 1) * n // 2) if a else slice(0, n)
                      for a, n in zip(spec, shape))]

    def lazy(self, shape, path, read):
        (index,) = self.slices(shape, path)
        return read(index)


class Spy:
    """A safetensors directory that records what is read of each tensor."""

    def __init__(self, path):
        self.inner, self.whole, self.sliced = SafetensorsDir(path), [], []

    def names(self):
        return self.inner.names()

    def shape(self, name):
        return self.inner.shape(name)

    def get(self, name):
        self.whole.append(name)
        return self.inner.get(name)

    def get_slice(self, name, index):
        self.sliced.append((name, index))
        return self.inner.get_slice(name, index)


def _read(path, c, place, monkeypatch, progress=False):
    spies = []

    def spy(p):
        spies.append(Spy(p))
        return spies[-1]

    monkeypatch.setattr(nemotron, "SafetensorsDir", spy)
    params = nemotron.read(path, c, progress=progress, place=place)
    return params, spies[0]


def _leaves(tree, path=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, path + (k,))
        else:
            yield path + (k,), v


def test_each_process_reads_only_its_slices_and_together_they_read_the_checkpoint(
        nemotron_dir, monkeypatch):
    c = loading.read_config(nemotron_dir).replace(lora_rank=0)
    whole, _ = _read(nemotron_dir, c, None, monkeypatch)
    halves = [_read(nemotron_dir, c, Half(c, which), monkeypatch) for which in (0, 1)]
    for which, (params, spy) in enumerate(halves):
        # Each tensor is read once, by its slice in the stored layout (a transposed
        # tensor with the index reversed), none through a memory mapping (whose faults
        # read the pages around them too).
        read = dict(spy.sliced)
        assert len(read) == len(spy.sliced) == 21 and spy.whole == []
        assert read[UP] == (slice(80 * which, 80 * (which + 1)), slice(0, 64))  # rows
        assert read[DOWN] == (slice(0, 64), slice(80 * which, 80 * (which + 1)))  # columns
        assert read["encoder.norm.weight"] == (slice(0, 64),)  # replicated: all of it
        split = [n for n, i in read.items() if slice_shape(i, spy.shape(n)) != spy.shape(n)]
        assert len(split) == 2 * 7 + 2  # q, k, v, o, gate, up, down; embedding, head
    # Put together, the two halves are the whole-tensor read, bit for bit.
    halves = [dict(_leaves(params)) for params, _ in halves]
    for path, full in _leaves(whole):
        a, b = (h[path] for h in halves)
        assert a.dtype == b.dtype == full.dtype
        if a.shape == full.shape:
            assert np.array_equal(a, full) and np.array_equal(b, full), path
        else:
            axis = next(i for i in range(full.ndim) if a.shape[i] != full.shape[i])
            assert np.array_equal(np.concatenate([a, b], axis), full), path


def test_non_finite_values_are_reported_by_the_process_that_reads_them(
        nemotron_dir, tmp_path, monkeypatch):
    def poison(w):
        up = w[UP].copy()
        up[3, 5] = np.nan  # a stored row of the first half
        up[100, 7] = np.inf  # and one of the second
        w[UP] = up

    bad = copy_checkpoint(nemotron_dir, tmp_path / "bad", poison)
    c = loading.read_config(bad).replace(lora_rank=0)
    for which, kind in [(0, "1 NaN, 0 Inf"), (1, "0 NaN, 1 Inf")]:
        with pytest.raises(CheckpointError) as e:
            _read(bad, c, Half(c, which), monkeypatch)
        assert f"{UP}: 1 of 5120 values read by this process ({kind})" in str(e.value)


def test_progress_ends_with_the_bytes_this_process_read(nemotron_dir, monkeypatch, capsys):
    c = loading.read_config(nemotron_dir).replace(lora_rank=0)
    whole = sum(a.nbytes for _, a in _leaves(_read(nemotron_dir, c, None, monkeypatch)[0]))
    params, _ = _read(nemotron_dir, c, Half(c, 0), monkeypatch, progress=True)
    read = sum(a.nbytes for _, a in _leaves(params))
    assert read < whole
    last = capsys.readouterr().err.split("\r")[-1]
    assert last.endswith(f"(this process read the slices its devices hold: {read} of "
                         f"{whole} bytes)\n"), last


def test_a_stored_tied_head_is_compared_in_this_process_rows(setdlm_safetensors_dir, tmp_path):
    from safetensors.numpy import load_file

    w = load_file(setdlm_safetensors_dir / "model.safetensors")
    w[setdlm.HEAD] = w[setdlm.HEAD].copy()
    w[setdlm.HEAD][200] += 1.0  # a row of the second half of the vocabulary
    d = tmp_path / "tied"
    d.mkdir()
    save_file(w, d / "model.safetensors")
    (d / "config.json").write_text((setdlm_safetensors_dir / "config.json").read_text())
    c = loading.read_config(d)
    with pytest.raises(CheckpointError, match="differs from"):
        setdlm.read(d, c)  # one process: every row
    with pytest.raises(CheckpointError, match="differs from"):
        setdlm.read(d, c, place=Half(c, 1))
    setdlm.read(d, c, place=Half(c, 0))  # the first half's rows agree


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_get_slice_reads_the_slice(tmp_path, dtype):
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3,)).astype(dtype),  # shifts the others' offsets
               "m": rng.standard_normal((9, 13)).astype(dtype),
               "t": rng.standard_normal((4, 6, 5)).astype(dtype)}
    save_file(tensors, tmp_path / "model.safetensors")
    src = SafetensorsDir(tmp_path)
    for name, index in [("m", (slice(0, 9), slice(0, 13))), ("m", (slice(2, 5), slice(0, 13))),
                        ("m", (slice(0, 9), slice(4, 11))), ("m", (slice(3, 4), slice(6, 7))),
                        ("m", (slice(5, 5), slice(0, 13))), ("a", (slice(1, 3),)),
                        ("t", (slice(1, 3), slice(0, 6), slice(2, 4))),
                        ("t", (slice(0, 4), slice(2, 5), slice(0, 5)))]:
        got = src.get_slice(name, index)
        want = tensors[name][index]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (name, index)
    # One read per row of a slice of columns, one in all for a slice of whole rows.
    shape, item = (9, 13), np.dtype(dtype).itemsize
    assert len(_runs(shape, (slice(0, 9), slice(4, 11)), item)[0]) == 9
    assert len(_runs(shape, (slice(2, 5), slice(0, 13)), item)[0]) == 1
    assert slice_shape((slice(2, 5), slice(0, 13)), shape) == (3, 13)


def test_get_slice_of_a_file_cut_short_names_the_tensor(tmp_path):
    save_file({"w": np.ones((64, 64), np.float32)}, tmp_path / "model.safetensors")
    src = SafetensorsDir(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-4096])
    with pytest.raises(CheckpointError, match="tensor w"):
        src.get_slice("w", (slice(0, 64), slice(0, 8)))


def test_a_converted_checkpoint_places_only_this_process_slices(nemotron_dir, tmp_path,
                                                                monkeypatch):
    """Restored whole (one chunk per array, see store.restore), then cast and placed
    slice by slice: the slices are those of the Hugging Face read."""
    import packed_ss_jax as ps
    from packed_ss_jax.checkpoints import store

    out = tmp_path / "converted"
    ps.convert(nemotron_dir, out, dtype="float32", progress=False, lora=False)
    c = loading.read_config(nemotron_dir).replace(lora_rank=0, dtype="bfloat16")
    want, _ = _read(nemotron_dir, c, Half(c, 1), monkeypatch)
    got = dict(_leaves(store.restore(out, c, place=Half(c, 1))))
    for path, a in _leaves(want):
        assert got[path].dtype == a.dtype == ml_dtypes.bfloat16
        assert np.array_equal(got[path].view(np.uint16), a.view(np.uint16)), path
