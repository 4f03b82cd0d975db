"""SetDLM checkpoints: config, the torch-free `.bin` reader, safety and clear errors."""

import collections
import io
import json
import os
import pickle
import shutil
import sys
import types
import zipfile
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import packed_ss_jax as ps
from packed_ss_jax.checkpoints.errors import CheckpointError
from packed_ss_jax.checkpoints.torch_bin import TorchBin
from packed_ss_jax.config import ConfigError

EMBED = "backbone.model.model.embed_tokens.weight"
HEAD = "backbone.model.lm_head.weight"


# --- writing torch-format zips without torch -------------------------------------------
# The pickler emits `GLOBAL torch._utils _rebuild_tensor_v2` and `torch.FloatStorage`
# exactly as torch.save does; stand-in modules make those names resolvable while pickling.

class _Storage:
    def __init__(self, key, array):
        self.key, self.array = key, array


class _Tensor:
    def __init__(self, storage, offset, shape, stride):
        self.args = (storage, offset, tuple(shape), tuple(stride), False, collections.OrderedDict())

    def __reduce__(self):
        return sys.modules["torch._utils"]._rebuild_tensor_v2, self.args


_KIND = {np.dtype(np.float32): "FloatStorage", np.dtype(np.float16): "HalfStorage",
         np.dtype(ml_dtypes.bfloat16): "BFloat16Storage"}


def write_torch_zip(file: Path, tensors: dict, monkeypatch, payload: bytes | None = None):
    """tensors: name -> _Tensor (storages shared by identity). `payload` replaces data.pkl."""
    torch = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):
        raise AssertionError("never called while writing")

    _rebuild_tensor_v2.__module__ = "torch._utils"
    _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    for kind in _KIND.values():
        setattr(torch, kind, type(kind, (), {"__module__": "torch", "__qualname__": kind}))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch._utils", utils)
    storages = {}

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, _Storage):
                storages[obj.key] = obj.array
                kind = getattr(torch, _KIND[obj.array.dtype])
                return ("storage", kind, obj.key, "cpu", obj.array.size)
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(dict(tensors))
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.delitem(sys.modules, "torch._utils")
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", payload if payload is not None else buf.getvalue())
        z.writestr("archive/byteorder", "little")
        for key, array in storages.items():
            z.writestr(f"archive/data/{key}", np.ascontiguousarray(array).tobytes())
    return file


def bin_checkpoint(dst: Path, weights: dict, monkeypatch, config_src: Path, share_head=True):
    """A SetDLM directory with a `.bin` written from `weights` (head sharing the embedding)."""
    dst.mkdir()
    shutil.copyfile(config_src / "config.json", dst / "config.json")
    tensors, embed_storage = {}, None
    for i, (name, w) in enumerate(weights.items()):
        if name == HEAD and share_head:
            continue
        s = _Storage(str(i), w.reshape(-1))
        if name == EMBED:
            embed_storage = s
        tensors[name] = _Tensor(s, 0, w.shape, _contiguous_strides(w.shape))
    if share_head and HEAD in weights:
        tensors[HEAD] = _Tensor(embed_storage, 0, weights[EMBED].shape,
                                _contiguous_strides(weights[EMBED].shape))
    write_torch_zip(dst / "pytorch_model.bin", tensors, monkeypatch)
    return dst


def _contiguous_strides(shape):
    return tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))


@pytest.fixture(scope="module")
def weights(setdlm_safetensors_dir):
    return load_file(setdlm_safetensors_dir / "model.safetensors")


def leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# --- the fixture files -------------------------------------------------------------------

def test_bin_and_safetensors_give_identical_params(setdlm, setdlm_safetensors_dir):
    other = ps.load(setdlm_safetensors_dir)
    assert setdlm.config == other.config
    assert leaves_equal(setdlm.params, other.params)


def test_config(setdlm):
    c = setdlm.config
    assert (c.family, c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads,
            c.head_dim, c.intermediate_size) == ("setdlm", 300, 64, 2, 4, 2, 16, 128)
    assert (c.mask_token_id, c.eos_token_id, c.qk_norm, c.tie_embeddings) == (299, 290, True, True)
    assert c.rms_norm_eps == 1e-6 and c.rope_theta == 1e6 and c.rope_type == "default"
    assert "head" not in setdlm.params


def test_bin_reader_shares_the_tied_storage(setdlm_dir):
    t = TorchBin(setdlm_dir / "pytorch_model.bin")
    assert t.shares_storage(HEAD, EMBED)
    assert not t.shares_storage(HEAD, "backbone.model.model.norm.weight")


def test_convert_roundtrip(setdlm, setdlm_dir, tmp_path):
    out = ps.convert(setdlm_dir, tmp_path / "conv", dtype="float32", progress=False)
    m = ps.load(out)
    assert m.config == setdlm.config
    assert leaves_equal(m.params, setdlm.params)


# --- real checkpoints name their base model ----------------------------------------------

def _released_config(src: Path, dst: Path) -> tuple[Path, dict]:
    """The fixture with its embedded backbone config removed, as the release ships it."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    qwen = cfg.pop("qwen3_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    shutil.copyfile(src / "model.safetensors", dst / "model.safetensors")
    return dst, qwen


def test_base_model_config_from_the_user(setdlm, setdlm_safetensors_dir, tmp_path):
    released, qwen = _released_config(setdlm_safetensors_dir, tmp_path / "released")
    with pytest.raises(ConfigError, match="names its backbone 'Qwen/Qwen3-1.7B-Base'.*base_config="):
        ps.load(released)
    as_dict = ps.load(released, base_config=qwen)
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text(json.dumps(qwen))
    as_dir = ps.load(released, base_config=tmp_path / "base")
    assert as_dict.config == as_dir.config == setdlm.config
    out = ps.convert(released, tmp_path / "conv", dtype="float32", progress=False,
                     base_config=tmp_path / "base" / "config.json")
    assert ps.load(out).config == setdlm.config


def test_vocab_comes_from_the_backbone_not_the_tokenizer(setdlm_safetensors_dir, tmp_path):
    released, qwen = _released_config(setdlm_safetensors_dir, tmp_path / "released")
    cfg = json.loads((released / "config.json").read_text())
    cfg["vocab_size"] = 290  # tokenizer length below the embedding rows, as in Qwen3
    (released / "config.json").write_text(json.dumps(cfg))
    assert ps.load(released, base_config=qwen).config.vocab_size == 300


def test_deeper_base_model_keeps_the_first_layers(setdlm, weights, setdlm_safetensors_dir,
                                                  tmp_path):
    released, qwen = _released_config(setdlm_safetensors_dir, tmp_path / "released")
    deeper = dict(qwen, num_hidden_layers=4)
    cfg = json.loads((released / "config.json").read_text())
    cfg["backbone_config"]["num_layers"] = 1
    (released / "config.json").write_text(json.dumps(cfg))
    m = ps.load(released, base_config=deeper)
    assert m.config.num_layers == 1
    np.testing.assert_array_equal(m.params["layer_0"]["mlp"]["up_proj"],
                                  setdlm.params["layer_0"]["mlp"]["up_proj"])
    cfg["backbone_config"]["num_layers"] = 5
    (released / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"num_layers 5 must be in \[1, 4\]"):
        ps.load(released, base_config=deeper)


def test_missing_head_is_tied_and_a_different_head_is_refused(setdlm, weights,
                                                             setdlm_safetensors_dir, tmp_path):
    for name, edit in [("nohead", lambda w: w.pop(HEAD)),
                       ("badhead", lambda w: w.__setitem__(HEAD, w[HEAD] + 1.0))]:
        d = tmp_path / name
        d.mkdir()
        shutil.copyfile(setdlm_safetensors_dir / "config.json", d / "config.json")
        w = dict(weights)
        edit(w)
        save_file(w, d / "model.safetensors", metadata={"format": "pt"})
        if name == "nohead":
            assert leaves_equal(ps.load(d).params, setdlm.params)
        else:
            with pytest.raises(CheckpointError, match="lm_head.weight differs"):
                ps.load(d)


def test_missing_and_misshaped_tensors_are_listed(weights, setdlm_dir, tmp_path, monkeypatch):
    w = dict(weights)
    del w["backbone.model.model.layers.1.self_attn.q_norm.weight"]
    w["backbone.model.model.layers.0.mlp.up_proj.weight"] = np.zeros((3, 64), np.float32)
    d = bin_checkpoint(tmp_path / "bad", w, monkeypatch, setdlm_dir)
    with pytest.raises(CheckpointError) as e:
        ps.load(d)
    msg = str(e.value)
    assert "missing (1): backbone.model.model.layers.1.self_attn.q_norm.weight [16]" in msg
    assert "layers.0.mlp.up_proj.weight: expected [128, 64], found [3, 64]" in msg


# --- the .bin reader ----------------------------------------------------------------------

def test_hand_written_bin_matches(setdlm, weights, setdlm_dir, tmp_path, monkeypatch):
    d = bin_checkpoint(tmp_path / "hand", weights, monkeypatch, setdlm_dir)
    assert leaves_equal(ps.load(d).params, setdlm.params)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_offsets_strides_and_dtypes(dtype, tmp_path, monkeypatch):
    base = (np.arange(60, dtype=np.float32) / 7).astype(dtype)
    s = _Storage("0", base)
    tensors = {
        "whole": _Tensor(s, 0, (6, 10), (10, 1)),
        "transposed": _Tensor(s, 0, (10, 6), (1, 10)),   # a .T view of the same storage
        "offset_rows": _Tensor(s, 20, (2, 10), (10, 1)),
        "every_other": _Tensor(s, 1, (3, 5), (20, 2)),
        "empty": _Tensor(s, 60, (0, 4), (4, 1)),
    }
    t = TorchBin(write_torch_zip(tmp_path / "x.bin", tensors, monkeypatch))
    m = base.reshape(6, 10)
    np.testing.assert_array_equal(t.get("whole"), m)
    np.testing.assert_array_equal(t.get("transposed"), m.T)
    np.testing.assert_array_equal(t.get("offset_rows"), m[2:4])
    np.testing.assert_array_equal(t.get("every_other"),
                                  base[1 + np.arange(3)[:, None] * 20 + np.arange(5)[None, :] * 2])
    assert t.get("empty").shape == (0, 4)
    assert {t.get(n).dtype for n in tensors} == {np.dtype(dtype)}
    assert t.shares_storage("whole", "whole") and not t.shares_storage("whole", "transposed")


def test_view_past_its_storage_is_refused(tmp_path, monkeypatch):
    s = _Storage("0", np.zeros(10, np.float32))
    f = write_torch_zip(tmp_path / "x.bin", {"w": _Tensor(s, 5, (2, 5), (5, 1))}, monkeypatch)
    with pytest.raises(CheckpointError, match="runs past its storage"):
        TorchBin(f)


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Evaluates:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return eval, (f"open({str(self.marker)!r}, 'w').close()",)


@pytest.mark.parametrize("gadget", [_RunsCode, _Evaluates])
def test_malicious_pickle_is_refused_without_running(gadget, setdlm_dir, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({EMBED: gadget(marker)}, protocol=2)
    # Sanity: a plain unpickler would run it.
    pickle.loads(payload)
    assert marker.exists()
    marker.unlink()

    d = tmp_path / "evil"
    d.mkdir()
    shutil.copyfile(setdlm_dir / "config.json", d / "config.json")
    write_torch_zip(d / "pytorch_model.bin", {}, monkeypatch, payload=payload)
    with pytest.raises(CheckpointError, match=r"refusing to load.*(system|eval).*nothing from it "
                                              r"was executed"):
        ps.load(d)
    with pytest.raises(CheckpointError, match="refusing to load"):
        ps.convert(d, tmp_path / "out", progress=False)
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_malicious_global_inside_a_tensor_record(tmp_path, monkeypatch):
    # A well-formed record whose backward-hooks slot smuggles in another callable.
    marker = tmp_path / "pwned"
    s = _Storage("0", np.zeros(4, np.float32))
    t = _Tensor(s, 0, (4,), (1,))
    t.args = t.args[:5] + (_RunsCode(marker),)
    f = write_torch_zip(tmp_path / "x.bin", {"w": t}, monkeypatch)
    with pytest.raises(CheckpointError, match="refusing to load"):
        TorchBin(f)
    assert not marker.exists()


def test_truncated_and_corrupt_files(setdlm_dir, tmp_path):
    data = (setdlm_dir / "pytorch_model.bin").read_bytes()
    cases = {
        "truncated": data[: len(data) // 2],
        "tail_cut": data[:-100],
        "garbage": b"not a zip at all" * 10,
        "empty": b"",
    }
    # Flip bytes inside the first storage: the zip CRC catches it when the tensor is read.
    flipped = bytearray(data)
    start = data.index(b"data/0") + 200
    flipped[start: start + 16] = bytes(16)
    cases["crc"] = bytes(flipped)
    for name, blob in cases.items():
        d = tmp_path / name
        d.mkdir()
        shutil.copyfile(setdlm_dir / "config.json", d / "config.json")
        (d / "pytorch_model.bin").write_bytes(blob)
        with pytest.raises(CheckpointError, match="pytorch_model.bin"):
            ps.load(d)


def test_no_weights_at_all(setdlm_dir, tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    shutil.copyfile(setdlm_dir / "config.json", d / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors.*pytorch_model.bin"):
        ps.load(d)
