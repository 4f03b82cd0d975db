"""Sharded or single-file safetensors directories, read lazily as memory-mapped NumPy arrays.

Each file's header is checked once by the safetensors library (`safe_open` rejects a
header whose offsets do not tile the data exactly, or a truncated file); a tensor is then
a read-only `np.memmap` of its own bytes. Nothing is read until the caller touches it,
and the mapping goes away with the array, so a reader that takes one tensor at a time
holds one tensor at a time, whatever the checkpoint's size. `get_slice` reads part of a
tensor (the slices of a device mesh a process holds) and only the file pages holding it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# safetensors dtype names -> NumPy dtypes (ml_dtypes for the 16- and 8-bit floats)
DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
          "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
          "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


class _File:
    """One safetensors file: name -> (dtype name, shape, absolute byte range)."""

    def __init__(self, file: Path):
        self.file = file
        with _open(file) as f:  # the library's own header checks
            names = list(f.keys())
        try:
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None
        start = 8 + n
        self.entries = {}
        for name in names:
            h = header[name]
            begin, end = h["data_offsets"]
            self.entries[name] = (h["dtype"], tuple(h["shape"]), start + begin, start + end)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def _checked(self, name: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
        """(dtype, shape, begin, end) of a tensor whose bytes are all in the file."""
        kind, shape, begin, end = self.entries[name]
        if kind not in DTYPES:
            raise CheckpointError(f"tensor {name} in {self.file} has dtype {kind}, which this "
                                  f"reader does not support (expected one of {sorted(DTYPES)})")
        dtype = np.dtype(DTYPES[kind])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"tensor {name} in {self.file}: {end - begin} bytes for "
                                  f"shape {list(shape)} {kind}")
        if end > begin:
            # Checked again right before mapping: a file cut short since it was opened
            # would otherwise raise SIGBUS on the first read past its new end.
            size = self._size(name)
            if size < end:
                raise CheckpointError(f"cannot read tensor {name} from {self.file}: the file "
                                      f"has {size} bytes, the tensor ends at byte {end}")
        return dtype, shape, begin, end

    def _size(self, name: str) -> int:
        try:
            return os.stat(self.file).st_size
        except OSError as e:
            raise CheckpointError(f"cannot read tensor {name} from {self.file}: {e}") from None

    def get(self, name: str) -> np.ndarray:
        dtype, shape, begin, end = self._checked(name)
        if end == begin:
            return np.zeros(shape, dtype)
        try:
            return np.memmap(self.file, dtype=dtype, mode="r", offset=begin, shape=shape)
        except OSError as e:
            raise CheckpointError(f"cannot read tensor {name} from {self.file}: {e}") from None

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """A copy of `tensor[index]` (slices of step 1), read from the file in one read
        per contiguous run of the slice with the kernel's read-ahead off for the file
        (POSIX_FADV_RANDOM), so only the pages holding the slice are read. (A memory
        mapping reads around every page it faults in: on a disk with 8 MB of read-ahead,
        copying a quarter of the columns of a 64 MB tensor through one read all 64 MB, a
        quarter of its rows 24 MB; this reads 32 MB and 16 MB, the pages they touch.)"""
        dtype, shape, begin, end = self._checked(name)
        lens = [len(range(*s.indices(n))) for s, n in zip(index, shape)]
        out = np.empty(lens, dtype)
        if out.size == 0:
            return out
        starts, length = _runs(shape, index, dtype.itemsize)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        try:
            with open(self.file, "rb", buffering=0) as f:
                fd = f.fileno()
                offsets = (begin + starts).tolist()
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_RANDOM)
                    if len(offsets) > 1:
                        # Every run asked for at once, so the many small reads of a slice
                        # of columns overlap instead of waiting one after the other.
                        for start in offsets:
                            os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)
                for i, start in enumerate(offsets):
                    _pread_into(fd, buf[i * length:(i + 1) * length], start)
        except OSError as e:
            raise CheckpointError(f"cannot read tensor {name} from {self.file}: {e}") from None
        return out


def _runs(shape: tuple[int, ...], index: tuple[slice, ...],
          itemsize: int) -> tuple[np.ndarray, int]:
    """The byte offsets of the contiguous runs of `tensor[index]` in a C-ordered tensor
    of `shape` (in order), and their common length."""
    bounds = [s.indices(n)[:2] for s, n in zip(index, shape)]
    strides = [math.prod(shape[j + 1:]) * itemsize for j in range(len(shape))]
    # Axes after `m` are whole, so each index of the axes before it is one run.
    m = max((j for j, (a, b) in enumerate(bounds) if b - a != shape[j]), default=0)
    length = (bounds[m][1] - bounds[m][0]) * strides[m] if shape else itemsize
    first = sum(a * st for (a, _), st in zip(bounds, strides))
    if m == 0:
        return np.array([first], np.int64), length
    grid = np.indices([b - a for a, b in bounds[:m]]).reshape(m, -1)
    return first + np.asarray(strides[:m], np.int64) @ grid, length


def _pread_into(fd: int, buf: memoryview, offset: int):
    while buf:  # one read returns at most ~2 GiB on Linux
        n = os.preadv(fd, [buf], offset)
        if n == 0:
            raise OSError(f"the file ends before byte {offset + len(buf)}")
        buf, offset = buf[n:], offset + n


class SafetensorsDir:
    """Tensor name -> file map over `model.safetensors` or an index with shards."""

    def __init__(self, path: str | Path, single: str = SINGLE):
        self.path = Path(path)
        self._files: dict[Path, _File] = {}
        index = self.path / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a safetensors index: {e}") from None
            missing = sorted({f for f in weight_map.values() if not (self.path / f).exists()})
            if missing:
                raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
            self.files = {name: self.path / f for name, f in weight_map.items()}
        elif (self.path / single).exists():
            self.files = {name: self.path / single for name in self._file(self.path / single).entries}
        else:
            raise CheckpointError(f"no {single} or {INDEX} in {self.path}")

    def _file(self, file: Path) -> _File:
        if file not in self._files:
            self._files[file] = _File(file)
        return self._files[file]

    def _entry(self, name: str) -> _File:
        f = self._file(self.files[name])
        if name not in f.entries:
            raise CheckpointError(f"{self.path / INDEX} places {name} in {f.file.name}, "
                                  "which does not hold it")
        return f

    def names(self) -> list[str]:
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape(name)

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only memory-mapped array (read when touched)."""
        return self._entry(name).get(name)

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """A copy of `get(name)[index]`, reading only the pages that hold the slice."""
        return self._entry(name).get_slice(name, index)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self.files:
            yield name, self.get(name)


def _open(file: Path):
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None
