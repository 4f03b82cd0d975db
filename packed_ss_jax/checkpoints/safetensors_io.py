"""Sharded or single-file safetensors directories, read lazily as NumPy arrays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafetensorsDir:
    """Tensor name -> file map over `model.safetensors` or an index with shards."""

    def __init__(self, path: str | Path, single: str = SINGLE):
        self.path = Path(path)
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
            self.files = {name: self.path / single for name in _names(self.path / single)}
        else:
            raise CheckpointError(f"no {single} or {INDEX} in {self.path}")

    def names(self) -> list[str]:
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        with _open(self.files[name]) as f:
            return tuple(f.get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        with _open(self.files[name]) as f:
            try:
                return f.get_tensor(name)
            except SafetensorError as e:
                raise CheckpointError(f"cannot read tensor {name} from {self.files[name]}: {e}") from None

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self.files:
            yield name, self.get(name)


def _open(file: Path):
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None


def _names(file: Path) -> list[str]:
    with _open(file) as f:
        return list(f.keys())
