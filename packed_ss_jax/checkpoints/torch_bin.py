"""PyTorch `torch.save` zip files (`pytorch_model.bin`) read without torch.

A `.bin` is a zip holding `<archive>/data.pkl` (a pickle of the state dict) and one
raw little-endian file `<archive>/data/<key>` per storage. Unpickling normally runs
whatever callables the pickle names, so here every global goes through an
allow-list: only the records a state dict of plain tensors needs are accepted
(`torch._utils._rebuild_tensor_v2`, the `torch.*Storage` dtype markers, which
only ever arrive through `persistent_load`, and an empty `collections.OrderedDict`
for the backward hooks). They map to functions defined here that build NumPy
views; any other global stops loading with a CheckpointError before anything is
called. Tensor data is read lazily, per tensor, from the zip.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import zipfile
import zlib
from pathlib import Path

import numpy as np

from .errors import CheckpointError


def _bf16():
    import ml_dtypes  # a jax dependency

    return np.dtype(ml_dtypes.bfloat16)


# torch storage class name -> NumPy dtype (bf16 resolved lazily).
_STORAGES = {
    "FloatStorage": np.dtype(np.float32),
    "HalfStorage": np.dtype(np.float16),
    "BFloat16Storage": "bfloat16",
    "DoubleStorage": np.dtype(np.float64),
    "LongStorage": np.dtype(np.int64),
    "IntStorage": np.dtype(np.int32),
    "ShortStorage": np.dtype(np.int16),
    "CharStorage": np.dtype(np.int8),
    "ByteStorage": np.dtype(np.uint8),
    "BoolStorage": np.dtype(np.bool_),
}


@dataclasses.dataclass(frozen=True)
class _StorageType:
    name: str

    @property
    def dtype(self) -> np.dtype:
        d = _STORAGES[self.name]
        return _bf16() if d == "bfloat16" else d


@dataclasses.dataclass(frozen=True)
class _Storage:
    key: str
    dtype: np.dtype
    numel: int


@dataclasses.dataclass(frozen=True)
class LazyTensor:
    """A strided view into one storage; nothing is read until `TorchBin.get`."""

    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
    if not isinstance(storage, _Storage):
        raise CheckpointError("tensor record does not refer to a storage")
    try:
        shape = tuple(int(s) for s in size)
        strides = tuple(int(s) for s in stride)
        offset = int(storage_offset)
    except (TypeError, ValueError):
        raise CheckpointError("tensor record has a malformed size/stride/offset") from None
    if len(shape) != len(strides) or offset < 0 or any(s < 0 for s in shape + strides):
        raise CheckpointError(f"tensor record has inconsistent size {shape} / stride {strides}")
    if all(shape):  # an empty tensor touches no element
        last = offset + sum((n - 1) * st for n, st in zip(shape, strides))
        if last >= storage.numel:
            raise CheckpointError(
                f"tensor of size {list(shape)} at offset {offset} runs past its storage "
                f"{storage.key} of {storage.numel} elements")
    return LazyTensor(storage, offset, shape, strides)


def _ordered_dict(*args):
    # Only the (empty) backward-hooks dict of a tensor record is expected here.
    if args and args != ((),) and args != ([],):
        raise CheckpointError("non-empty OrderedDict in a tensor record is not accepted")
    return {}


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("collections", "OrderedDict"): _ordered_dict,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, file: Path):
        super().__init__(io.BytesIO(data))
        self.file = file

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _STORAGES:
            return _StorageType(name)
        raise CheckpointError(
            f"{self.file}: refusing to load: the pickle references {module}.{name}, which is "
            "not a tensor-rebuild record (only torch._utils._rebuild_tensor_v2, torch.*Storage "
            "and collections.OrderedDict are accepted); nothing from it was executed")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)):
            raise CheckpointError(f"{self.file}: unsupported persistent id {pid!r:.80}")
        _, kind, key, _location, numel = pid
        return _Storage(key, kind.dtype, int(numel))


def _corrupt(file: Path, e: Exception) -> CheckpointError:
    return CheckpointError(f"{file} is not a readable PyTorch zip checkpoint "
                           f"(truncated or corrupt?): {type(e).__name__}: {e}")


class TorchBin:
    """Tensor name -> lazy tensor over one `pytorch_model.bin` (a `Source` for assemble)."""

    def __init__(self, file: str | Path):
        self.file = Path(file)
        try:
            self.zip = zipfile.ZipFile(self.file)
            pkls = [n for n in self.zip.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pkls) != 1:
                raise CheckpointError(f"{self.file}: expected one data.pkl in the zip, found {pkls}")
            self.prefix = pkls[0][: -len("data.pkl")]
            data = self.zip.read(pkls[0])
            order = self.prefix + "byteorder"
            big = order in self.zip.namelist() and self.zip.read(order).strip() == b"big"
        except zipfile.BadZipFile as e:
            if self.file.exists() and self.file.read_bytes()[:2] == b"\x80\x02":
                raise CheckpointError(f"{self.file} is a legacy (pre-1.6, non-zip) torch file; "
                                      "re-save it with a current torch") from None
            raise _corrupt(self.file, e) from None
        except (OSError, EOFError, zlib.error) as e:
            raise _corrupt(self.file, e) from None
        self.byteorder = ">" if big else "<"
        try:
            state = _Unpickler(data, self.file).load()
        except CheckpointError:
            raise
        except Exception as e:  # malformed pickle streams raise many types
            raise _corrupt(self.file, e) from None
        if not isinstance(state, dict) or not all(
                isinstance(k, str) and isinstance(v, LazyTensor) for k, v in state.items()):
            raise CheckpointError(f"{self.file}: expected a state dict of tensors")
        self.tensors: dict[str, LazyTensor] = state

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def _storage(self, s: _Storage) -> np.ndarray:
        entry = f"{self.prefix}data/{s.key}"
        try:
            raw = self.zip.read(entry)
        except KeyError:
            raise CheckpointError(f"{self.file}: storage {entry} is missing") from None
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:
            raise _corrupt(self.file, e) from None
        dtype = s.dtype.newbyteorder(self.byteorder) if s.dtype.itemsize > 1 else s.dtype
        if len(raw) != s.numel * dtype.itemsize:
            raise CheckpointError(f"{self.file}: storage {entry} has {len(raw)} bytes, expected "
                                  f"{s.numel} x {dtype.itemsize}")
        return np.frombuffer(raw, dtype)

    def get(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        flat = self._storage(t.storage)
        item = flat.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(
            flat[t.offset:], shape=t.shape, strides=tuple(s * item for s in t.stride),
            writeable=False)
        return np.ascontiguousarray(view).astype(flat.dtype.newbyteorder("="), copy=False)

    def shares_storage(self, a: str, b: str) -> bool:
        """True when two names are the same view of one storage (a tied head)."""
        return self.tensors[a] == self.tensors[b]
