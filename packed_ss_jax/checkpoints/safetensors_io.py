"""Sharded or single-file safetensors directories, read lazily as memory-mapped NumPy arrays.

Each file's header is checked once by the safetensors library (`safe_open` rejects a
header whose offsets do not tile the data exactly, or a truncated file); a tensor is then
a read-only `np.memmap` of its own bytes. Nothing is read until the caller touches it,
and the mapping goes away with the array, so a reader that takes one tensor at a time
holds one tensor at a time, whatever the checkpoint's size.
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

    def get(self, name: str) -> np.ndarray:
        kind, shape, begin, end = self.entries[name]
        if kind not in DTYPES:
            raise CheckpointError(f"tensor {name} in {self.file} has dtype {kind}, which this "
                                  f"reader does not support (expected one of {sorted(DTYPES)})")
        dtype = np.dtype(DTYPES[kind])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"tensor {name} in {self.file}: {end - begin} bytes for "
                                  f"shape {list(shape)} {kind}")
        if end == begin:
            return np.zeros(shape, dtype)
        try:
            # Checked again right before mapping: a file cut short since it was opened
            # would otherwise raise SIGBUS on the first read past its new end.
            size = os.stat(self.file).st_size
            if size < end:
                raise CheckpointError(f"cannot read tensor {name} from {self.file}: the file "
                                      f"has {size} bytes, the tensor ends at byte {end}")
            return np.memmap(self.file, dtype=dtype, mode="r", offset=begin, shape=shape)
        except OSError as e:
            raise CheckpointError(f"cannot read tensor {name} from {self.file}: {e}") from None


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

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self.files:
            yield name, self.get(name)


def _open(file: Path):
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None
