"""The `.bin` reader against handcrafted hostile records: refused, never read past a storage.

Every file here is read through `read_checked`, which compares each accepted view with
the bytes really stored *before* reading it: a reader that let a bad record through
fails these tests with an assertion instead of reading (or crashing on) foreign memory.
"""

import collections
import io
import pickle
import sys
import types
import zipfile

import numpy as np
import pytest

from packed_ss_jax.checkpoints.errors import CheckpointError
from packed_ss_jax.checkpoints.torch_bin import LazyTensor, TorchBin
from tools.fuzz_torch_bin import (ORDERED_DICT, REBUILD, outside, p_global, p_int, p_str,
                                  p_tuple, p_value, patch_sizes)

DATA = np.arange(16, dtype=np.float32)


def record(key="0", numel=16, offset=0, size=(4, 4), stride=(4, 1), kind="FloatStorage"):
    """`_rebuild_tensor_v2(('storage', torch.<kind>, key, 'cpu', numel), offset, size, stride,
    False, OrderedDict())`, opcode for opcode as `torch.save` writes it."""
    pid = p_tuple([p_str("storage"), p_global("torch", kind), p_str(key), p_str("cpu"),
                   p_int(numel)])
    return REBUILD + p_tuple([pid + b"Q", p_value(offset), p_value(size), p_value(stride),
                              b"\x89", ORDERED_DICT]) + b"R"


def state_dict(*entries: bytes) -> bytes:
    """PROTO 2, EMPTY_DICT, MARK, <name, record>..., SETITEMS, STOP."""
    return b"\x80\x02}q\x00(" + b"".join(entries) + b"u."


def write(path, pkl, storages=None, byteorder=b"little"):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", byteorder)
        for key, data in (storages or {"0": DATA.tobytes()}).items():
            z.writestr(f"archive/data/{key}", data)
    return path


def read_checked(path) -> dict:
    t = TorchBin(path)
    z = zipfile.ZipFile(path)
    out = {}
    for name in t.names():
        r = t.tensors[name]
        stored = z.getinfo(f"archive/data/{r.storage.key}").file_size
        why = outside(r.offset, r.shape, r.stride, stored // np.dtype(r.storage.dtype).itemsize)
        assert why is None, f"the reader accepted {name!r}: {why}; reading it leaves the buffer"
        out[name] = t.get(name)
    return out


# --- the BUILD attack ----------------------------------------------------------------------

@pytest.mark.parametrize("state", [{"shape": (64, 64)}, {"stride": (4096, 1)},
                                   {"offset": 10**6}, {"shape": (2**31, 2**31)}],
                         ids=["shape", "stride", "offset", "huge"])
def test_build_after_a_record_is_refused(state, tmp_path):
    good = write(tmp_path / "good.bin", state_dict(p_str("w") + record()))
    np.testing.assert_array_equal(read_checked(good)["w"], DATA.reshape(4, 4))
    # The same record, then EMPTY_DICT 'shape' (64, 64) SETITEM BUILD: pickle would set
    # the state on the returned object (a frozen dataclass's __dict__ included).
    f = write(tmp_path / "x.bin", state_dict(p_str("w") + record() + p_value(state) + b"b"))
    with pytest.raises(CheckpointError, match=r"x\.bin: refusing to load \(tensor 'w'\): the "
                                              r"pickle uses BUILD .* nothing from it was executed"):
        read_checked(f)


@pytest.mark.parametrize("snippet", [
    p_str("shape") + p_value((64, 64)) + b"s",                          # SETITEM into it
    b"(" + p_str("shape") + p_value((64, 64)) + b"u",                   # SETITEMS
    p_int(64) + b"a",                                                   # APPEND
    b"(" + p_int(64) + b"e",                                            # APPENDS
    b"N" + p_value({"shape": (64, 64)}) + b"\x86b",                     # BUILD (None, slots)
    b"(" + p_str("touch pwned") + b"ios\nsystem\n0",                    # INST
    b"(" + p_global("os", "system") + p_str("touch pwned") + b"o0",     # OBJ
    p_global("collections", "OrderedDict") + b")\x810",                 # NEWOBJ
    p_global("collections", "OrderedDict") + b")}\x920",                # NEWOBJ_EX
    p_global("builtins", "eval") + p_str("1") + b"\x85R0",              # REDUCE of a global
    p_str("os") + p_str("system") + b"\x93" + p_str("true") + b"\x85R0",  # STACK_GLOBAL
], ids=["setitem", "setitems", "append", "appends", "build_slots", "inst", "obj", "newobj",
        "newobj_ex", "eval", "stack_global"])
def test_state_changes_and_other_callables_after_a_record_are_refused(snippet, tmp_path):
    f = write(tmp_path / "x.bin", state_dict(p_str("w") + record() + snippet))
    with pytest.raises(CheckpointError, match=r"x\.bin: refusing to load.*nothing from it was "
                                              "executed"):
        read_checked(f)
    assert not (tmp_path / "pwned").exists()


def test_a_list_from_the_memo_cannot_become_a_size(tmp_path):
    # size = a list memoized as 5, appended to after the record was built.
    size = b"]q\x05(" + p_int(4) + p_int(4) + b"e"
    f = write(tmp_path / "x.bin", state_dict(p_str("w") + record(size=size) + b"h\x05"
                                             + p_int(64) + b"a0"))
    with pytest.raises(CheckpointError, match="refusing to load.*EMPTY_LIST"):
        read_checked(f)


@pytest.mark.parametrize("field,value,match", [
    ("offset", -1, "malformed offset"),
    ("offset", 2**64, "malformed offset"),
    ("size", (4, -4), "malformed size"),
    ("size", ("4", 4), "malformed size"),
    ("size", (4, 4, 1), "inconsistent size"),
    ("stride", (2**63, 1), "malformed stride"),
    ("stride", (5, 1), "runs past its storage"),
    ("size", (4, 2**62), "runs past its storage"),
    ("offset", 1, "runs past its storage"),
    ("numel", 2**62, r"has 64 bytes, expected .* \(the storage of tensor 'w'"),
    ("numel", 8, "runs past its storage"),
])
def test_bad_sizes_strides_offsets_and_numels(field, value, match, tmp_path):
    f = write(tmp_path / "x.bin", state_dict(p_str("w") + record(**{field: value})))
    with pytest.raises(CheckpointError, match=match):
        read_checked(f)


# --- records are data, checked again when read -------------------------------------------

def test_records_are_immutable_python_ints(tmp_path):
    t = TorchBin(write(tmp_path / "x.bin", state_dict(p_str("w") + record(
        offset=p_int(0), size=b"\x8a\x01\x04" + p_int(4) + b"\x86"))))  # LONG1 4 too
    r = t.tensors["w"]
    assert isinstance(r, LazyTensor) and not hasattr(r, "__dict__")
    assert all(type(v) is int for v in (r.offset, *r.shape, *r.stride, r.storage.numel))
    with pytest.raises(AttributeError):
        r.shape = (64, 64)


def test_get_checks_the_view_against_the_bytes_it_read(tmp_path):
    t = TorchBin(write(tmp_path / "x.bin", state_dict(p_str("w") + record())))
    s = t.tensors["w"].storage
    for offset, shape, stride in [(0, (64, 64), (64, 1)), (16, (1,), (1,)), (-1, (2,), (1,)),
                                  (2**70, (1,), (1,)), (0, (2, 2), (-1, 1)), (0, (17,), (0,))]:
        t.tensors["w"] = LazyTensor(s, offset, shape, stride)  # as if the record had changed
        with pytest.raises(CheckpointError, match=r"x\.bin: tensor 'w': .*storage 0 of 16"):
            t.get("w")


def test_storage_sizes_are_checked_before_anything_is_read(tmp_path):
    short = write(tmp_path / "short.bin", state_dict(p_str("w") + record()),
                  {"0": DATA[:8].tobytes()})
    with pytest.raises(CheckpointError, match=r"data/0 has 32 bytes, expected 64 \(the storage "
                                              r"of tensor 'w': 16 x 4 bytes\)"):
        TorchBin(short)
    # A 2 GiB storage declared alike in the pickle and in the zip headers (a zip bomb).
    bomb = tmp_path / "bomb.bin"
    bomb.write_bytes(patch_sizes(write(tmp_path / "b0.bin", state_dict(
        p_str("w") + record(numel=2**29))).read_bytes(), "archive/data/0", 2**31))
    with pytest.raises(CheckpointError, match="declares 2147483648 bytes past the end"):
        TorchBin(bomb)


def test_shared_storages_and_the_tied_head(tmp_path):
    f = write(tmp_path / "x.bin", state_dict(
        p_str("embed") + record() + b"q\x01",
        p_str("head") + b"h\x01",                                   # the same record (memo)
        p_str("rows") + record(offset=8, size=(2, 4)),              # another view of it
        p_str("cols") + record(size=(4, 4), stride=(1, 4))))
    t = TorchBin(f)
    out = read_checked(f)
    m = DATA.reshape(4, 4)
    np.testing.assert_array_equal(out["head"], m)
    np.testing.assert_array_equal(out["rows"], m[2:])
    np.testing.assert_array_equal(out["cols"], m.T)
    assert t.shares_storage("head", "embed") and not t.shares_storage("rows", "embed")


def test_zero_dim_and_empty_tensors(tmp_path):
    f = write(tmp_path / "x.bin", state_dict(p_str("scalar") + record(offset=3, size=(), stride=()),
                                             p_str("empty") + record(offset=16, size=(0, 4))))
    out = read_checked(f)
    assert out["scalar"].shape == () and out["scalar"] == 3.0
    assert out["empty"].shape == (0, 4)


def test_keys_must_be_unique_strings(tmp_path):
    for entries, match in [((p_int(1) + record(),), "dict key is a int"),
                           ((p_str("w") + record(), p_str("w") + record()), "'w' appears twice")]:
        with pytest.raises(CheckpointError, match=match):
            TorchBin(write(tmp_path / "x.bin", state_dict(*entries)))


def test_big_endian_storages(tmp_path):
    f = write(tmp_path / "x.bin", state_dict(p_str("w") + record()),
              {"0": DATA.astype(">f4").tobytes()}, byteorder=b"big")
    out = read_checked(f)["w"]
    np.testing.assert_array_equal(out, DATA.reshape(4, 4))
    assert out.dtype == np.dtype("=f4")


def test_legacy_torch_files_are_named(tmp_path):
    f = tmp_path / "old.bin"
    f.write_bytes(b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.")  # torch's legacy magic number
    with pytest.raises(CheckpointError, match=r"legacy \(pre-1.6, non-zip\) torch file"):
        TorchBin(f)


# --- what torch writes, through Python's own pickler ---------------------------------------

class _Storage:
    pass


class _Tensor:
    def __init__(self, storage, size, stride):
        self.args = (storage, 0, size, stride, False, collections.OrderedDict())

    def __reduce__(self):
        return sys.modules["torch._utils"]._rebuild_tensor_v2, self.args


def _torch_pickle(obj, protocol, monkeypatch) -> bytes:
    """`obj` pickled as torch.save does (names resolvable through stand-in modules)."""
    torch, utils = types.ModuleType("torch"), types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):
        raise AssertionError("never called")

    _rebuild_tensor_v2.__module__ = "torch._utils"
    _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    torch.FloatStorage = type("FloatStorage", (), {"__module__": "torch"})
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch._utils", utils)

    class Pickler(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, _Storage):
                return ("storage", torch.FloatStorage, "0", "cpu", 16)
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_module_state_dict_with_metadata(protocol, tmp_path, monkeypatch):
    # `module.state_dict()` is an OrderedDict carrying `_metadata`: pickled, that is SETITEMS
    # and then a BUILD of {'_metadata': OrderedDict(prefix -> {'version': n})}.
    s = _Storage()
    sd = collections.OrderedDict(w=_Tensor(s, (4, 4), (4, 1)), t=_Tensor(s, (4, 4), (1, 4)))
    sd._metadata = collections.OrderedDict([("", {"version": 1}), ("w", {"version": 2})])
    out = read_checked(write(tmp_path / "x.bin", _torch_pickle(sd, protocol, monkeypatch)))
    assert list(out) == ["w", "t"]
    np.testing.assert_array_equal(out["t"], DATA.reshape(4, 4).T)
    # Any other state on it is refused.
    sd.extra = 1
    with pytest.raises(CheckpointError, match=r"BUILD .* \(OrderedDict\); only the _metadata"):
        TorchBin(write(tmp_path / "y.bin", _torch_pickle(sd, protocol, monkeypatch)))


@pytest.mark.parametrize("flag", [1 << 6, 1 << 5], ids=["strong-encryption", "patch-data"])
def test_an_entry_marked_as_zipfile_cannot_read_it_is_refused(flag, tmp_path):
    """zipfile raises NotImplementedError (a RuntimeError) for an entry flagged as strongly
    encrypted or as patch data: the reader names the file as unreadable instead of passing
    it on."""
    raw = bytearray(write(tmp_path / "x0.bin", state_dict(p_str("w") + record())).read_bytes())
    name = b"archive/data/0"
    for header, flags_at, name_at in ((b"PK\x03\x04", 6, 30), (b"PK\x01\x02", 8, 46)):
        at = raw.find(header)
        while raw[at + name_at: at + name_at + len(name)] != name:
            at = raw.find(header, at + 1)
        raw[at + flags_at: at + flags_at + 2] = flag.to_bytes(2, "little")
    path = tmp_path / "x.bin"
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"x\.bin is not a readable PyTorch zip "
                                              r"checkpoint .*NotImplementedError"):
        TorchBin(path).get("w")
