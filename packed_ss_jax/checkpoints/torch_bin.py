"""PyTorch `torch.save` zip files (`pytorch_model.bin`) read without torch.

A `.bin` is a zip holding `<archive>/data.pkl` (a pickle of the state dict) and one
raw file `<archive>/data/<key>` per storage (little-endian unless `<archive>/byteorder`
says big). The pickle is never unpickled: `torch_pickle` reads it as data, accepting
only the records of a state dict of plain tensors, so nothing it names is called and
no record can be changed after it was checked. Tensor data is read lazily, per
tensor, from the zip, and every view is checked against the bytes actually read
before it is taken: a hostile or corrupt file gets a CheckpointError, never a read
outside its storage.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np

from .errors import CheckpointError
from .torch_pickle import LazyTensor, Storage, read_records, view_error

__all__ = ["LazyTensor", "TorchBin"]

# A state dict's pickle is ~100 bytes per tensor; anything near this is not one.
MAX_PICKLE_BYTES = 64 << 20
# Deflate cannot expand data more than ~1032x, so a larger declared size is a lie
# (a zip bomb); torch itself stores entries uncompressed.
_DEFLATE_MAX_RATIO = 1032
# What zipfile and zlib raise on damaged archives (beyond BadZipFile). RuntimeError
# covers its subclass NotImplementedError, zipfile's refusal of an entry flagged as
# strongly encrypted or as patch data.
_ZIP_ERRORS = (
    zipfile.BadZipFile, OSError, EOFError, zlib.error, struct.error, ValueError,
    UnicodeDecodeError, RuntimeError, OverflowError,
)


def _corrupt(file: Path, e: Exception) -> CheckpointError:
    return CheckpointError(f"{file} is not a readable PyTorch zip checkpoint "
                           f"(truncated or corrupt?): {type(e).__name__}: {e}")


class TorchBin:
    """Tensor name -> lazy tensor over one `pytorch_model.bin` (a `Source` for assemble)."""

    def __init__(self, file: str | Path):
        self.file = Path(file)
        try:
            self.zip = zipfile.ZipFile(self.file)
            self.archive_bytes = os.fstat(self.zip.fp.fileno()).st_size
            names = self.zip.namelist()
            if len(set(names)) != len(names):
                raise CheckpointError(f"{self.file}: the zip holds the same entry twice")
            pkls = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pkls) != 1:
                raise CheckpointError(f"{self.file}: expected one data.pkl in the zip, found {pkls}")
            self.prefix = pkls[0][: -len("data.pkl")]
            data = self._read(pkls[0], None, MAX_PICKLE_BYTES)
            order = self.prefix + "byteorder"
            big = order in names and self._read(order, None, 16).strip() == b"big"
        except CheckpointError:
            raise
        except zipfile.BadZipFile as e:
            if _starts_with(self.file, b"\x80\x02"):
                raise CheckpointError(f"{self.file} is a legacy (pre-1.6, non-zip) torch file; "
                                      "re-save it with a current torch") from None
            raise _corrupt(self.file, e) from None
        except _ZIP_ERRORS as e:
            raise _corrupt(self.file, e) from None
        self.byteorder = ">" if big else "<"
        self.tensors: dict[str, LazyTensor] = read_records(data, self.file)
        for name, t in self.tensors.items():
            self._entry(t.storage, name)  # missing, mis-sized or bomb storages fail here

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def _info(self, entry: str, expected: int | None, limit: int | None) -> zipfile.ZipInfo:
        """The zip entry, refused when its declared size is not what the record needs."""
        try:
            info = self.zip.getinfo(entry)
        except KeyError:
            raise CheckpointError(f"{self.file}: {entry} is missing") from None
        size = info.file_size
        if expected is not None and size != expected:
            raise CheckpointError(f"{self.file}: {entry} has {size} bytes, expected {expected}")
        if limit is not None and size > limit:
            raise CheckpointError(f"{self.file}: {entry} declares {size} bytes, more than the "
                                  f"{limit} allowed for it")
        if info.flag_bits & 0x1:
            raise CheckpointError(f"{self.file}: {entry} is encrypted")
        if info.header_offset + info.compress_size > self.archive_bytes:
            raise CheckpointError(f"{self.file}: {entry} declares {info.compress_size} bytes "
                                  "past the end of the file")
        if info.compress_type == zipfile.ZIP_STORED:
            if info.compress_size != size:
                raise CheckpointError(f"{self.file}: {entry} is stored with {info.compress_size} "
                                      f"bytes but declares {size}")
        elif info.compress_type == zipfile.ZIP_DEFLATED:
            if size > _DEFLATE_MAX_RATIO * info.compress_size + 64:
                raise CheckpointError(f"{self.file}: {entry} declares {size} bytes from "
                                      f"{info.compress_size} deflated ones (a zip bomb?)")
        else:
            raise CheckpointError(f"{self.file}: {entry} uses zip compression method "
                                  f"{info.compress_type}, which torch never writes")
        return info

    def _read(self, entry: str, expected: int | None, limit: int | None = None) -> bytes:
        info = self._info(entry, expected, limit)
        with self.zip.open(info) as f:  # zipfile stops at the declared size and checks the CRC
            raw = f.read(info.file_size + 1)
        if len(raw) != info.file_size:
            raise CheckpointError(f"{self.file}: {entry} holds {len(raw)} bytes, "
                                  f"declared {info.file_size}")
        return raw

    def _entry(self, s: Storage, name: str, read: bool = False):
        """The storage's zip entry checked (and its bytes, when `read`)."""
        entry = f"{self.prefix}data/{s.key}"
        expected = s.numel * s.dtype.itemsize
        try:
            return self._read(entry, expected) if read else self._info(entry, expected, None)
        except CheckpointError as e:
            raise CheckpointError(f"{e} (the storage of tensor {name!r}: {s.numel} x "
                                  f"{s.dtype.itemsize} bytes)") from None
        except _ZIP_ERRORS as e:
            raise _corrupt(self.file, e) from None

    def _storage(self, s: Storage, name: str) -> np.ndarray:
        raw = self._entry(s, name, read=True)
        dtype = s.dtype.newbyteorder(self.byteorder) if s.dtype.itemsize > 1 else s.dtype
        return np.frombuffer(raw, dtype)

    def get(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        flat = self._storage(t.storage, name)
        # Checked again here, against the bytes in hand: this is the read that must not
        # leave them, whatever the record claimed when it was parsed.
        why = view_error(t.offset, t.shape, t.stride, flat.size)
        if why:
            raise CheckpointError(f"{self.file}: tensor {name!r}: {why} (storage "
                                  f"{t.storage.key} of {flat.size} elements)")
        native = flat.dtype.newbyteorder("=")
        if 0 in t.shape:
            return np.zeros(t.shape, native)
        n = int(np.prod(t.shape))
        if t.stride == _contiguous(t.shape):  # the usual case: a slice, which cannot overrun
            view = flat[t.offset:t.offset + n].reshape(t.shape)
        else:
            item = flat.dtype.itemsize
            view = np.lib.stride_tricks.as_strided(
                flat[t.offset:], shape=t.shape, strides=tuple(s * item for s in t.stride),
                writeable=False)
        return np.asarray(view, order="C").astype(native, copy=False)  # keeps 0-d tensors 0-d

    def shares_storage(self, a: str, b: str) -> bool:
        """True when two names are the same view of one storage (a tied head)."""
        return self.tensors[a] == self.tensors[b]


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _starts_with(file: Path, magic: bytes) -> bool:
    try:
        with open(file, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False
