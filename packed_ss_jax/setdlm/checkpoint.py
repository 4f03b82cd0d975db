"""SetDLM checkpoints (`pytorch_model.bin` or safetensors) -> params.

The release saves the whole denoiser, so the Qwen3 names sit under the prefix
`backbone.model.` (`backbone.model.model.layers.{i}...`, `backbone.model.lm_head.weight`).
The head is tied to the embedding: in a `.bin` the two names share one storage, a
safetensors copy stores an identical duplicate, and a checkpoint may omit it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from .. import model as model_lib
from ..checkpoints.assemble import Entry, assemble, decoder_table, slice_shape
from ..checkpoints.errors import CheckpointError
from ..checkpoints.safetensors_io import INDEX, SINGLE, SafetensorsDir
from ..checkpoints.torch_bin import TorchBin
from ..config import ModelConfig

PREFIX = "backbone.model."
EMBED = PREFIX + "model.embed_tokens.weight"
HEAD = PREFIX + "lm_head.weight"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


def table(c: ModelConfig) -> list[Entry]:
    return decoder_table(c, EMBED, PREFIX + "model.layers.{i}.", PREFIX + "model.norm.weight", HEAD)


class _BinShards:
    """`pytorch_model.bin.index.json` over several `.bin` shards."""

    def __init__(self, path: Path):
        index = path / BIN_INDEX
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a checkpoint index: {e}") from None
        self.shards = {f: TorchBin(path / f) for f in sorted(set(weight_map.values()))}
        self.where = {name: self.shards[f] for name, f in weight_map.items()}

    def names(self):
        return list(self.where)

    def shape(self, name):
        return self.where[name].shape(name)

    def get(self, name):
        return self.where[name].get(name)


def source(path: str | Path):
    """The weights of a SetDLM directory: safetensors when present, else the torch `.bin`."""
    path = Path(path)
    if (path / SINGLE).exists() or (path / INDEX).exists():
        return SafetensorsDir(path)
    if (path / BIN).exists():
        return TorchBin(path / BIN)
    if (path / BIN_INDEX).exists():
        return _BinShards(path)
    raise CheckpointError(f"no {SINGLE}, {INDEX}, {BIN} or {BIN_INDEX} in {path}")


def _ignored(c: ModelConfig):
    layer = re.compile(re.escape(PREFIX) + r"model\.layers\.(\d+)\.")

    def ignore(name: str) -> bool:
        if name.endswith("rotary_emb.inv_freq"):
            return True  # a recomputed buffer some exports keep
        m = layer.match(name)
        # The release truncates the base model to backbone_config.num_layers.
        return bool(m) and int(m.group(1)) >= c.num_layers

    return ignore


def _np_dtype(c: ModelConfig):
    import ml_dtypes

    return ml_dtypes.bfloat16 if c.dtype == "bfloat16" else np.float32


def _same_rows(src, c: ModelConfig, place) -> bool:
    """Whether the stored head equals the embedding: on a mesh (a placer that reads
    lazily, see assemble.read) in the rows of the embedding this process's devices hold,
    so that no process reads more of either than it loads; every row is some process's."""
    shape = tuple(src.shape(EMBED))
    slices = ([] if getattr(place, "lazy", None) is None or not hasattr(src, "get_slice")
              or shape != (c.vocab_size, c.hidden_size) else place.slices(shape, ("embed",)))
    if slices and sum(math.prod(slice_shape(i, shape)) for i in slices) < math.prod(shape):
        # The embedding is stored as loaded ([vocab, hidden]): its slices index the file.
        return all(np.array_equal(src.get_slice(HEAD, i), src.get_slice(EMBED, i))
                   for i in slices)
    return np.array_equal(src.get(HEAD), src.get(EMBED))


def read(path: str | Path, c: ModelConfig, progress: bool = False, place=None) -> dict:
    """Reads the weights into a params tree in the decoding layout, one tensor at a time
    (`place`: see `assemble`), checking the tied head when it is stored."""
    src = source(path)
    names = set(src.names())
    tied_head = c.tie_embeddings and HEAD in names
    if tied_head and not (isinstance(src, TorchBin) and src.shares_storage(HEAD, EMBED)):
        # A stored copy must really be the embedding, or the head we use would be wrong.
        if EMBED in names and (src.shape(HEAD) != src.shape(EMBED)
                               or not _same_rows(src, c, place)):
            raise CheckpointError(f"{HEAD} differs from {EMBED}, but the config ties them "
                                  "(tie_word_embeddings)")
    return assemble(table(c), model_lib.abstract_params(c), c.num_layers, src, _np_dtype(c),
                    ignore=_ignored(c), label="weights", progress=progress,
                    allow_unexpected=[HEAD] if tied_head else [], place=place)
