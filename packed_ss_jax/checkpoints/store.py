"""Converted checkpoints: orbax params plus a marker with the config and checksums.

Layout of a converted directory:
    packed_ss_config.json   format, version, config, per-array SHA-256, file list, the
                            SHA-256 of the config and of the copied config.json, the size
                            of every params file (marker.py)
    params/                 orbax checkpoint of the params in the decoding layout
                            (`layer_{i}/...`, one array per layer weight), uncompressed
    config.json, tokenizer files   copied from the source, when present

This module is what the converter and the loader ask; the work is split by job:
`writing` builds a directory aside and swaps it into place (`Writer`, and
`replace_refusal` for `--overwrite`), `restoring` reads one back a layer at a time,
checked against the marker (`restore`), and `marker` reads and validates the marker.
Neither writing nor reading ever holds a second copy of the weights.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import ModelConfig
from . import marker
from .restoring import restore
from .writing import DestinationError, Writer, replace_refusal

__all__ = ["MARKER", "DestinationError", "Writer", "is_converted", "read_config",
           "replace_refusal", "restore"]

MARKER = marker.MARKER


def is_converted(path: str | Path) -> bool:
    """Whether `path` holds a converted checkpoint (its marker), rather than a Hugging
    Face one."""
    return os.path.lexists(Path(path) / MARKER)


def read_config(path: str | Path) -> ModelConfig:
    """The config a converted checkpoint was written with (its validated marker's)."""
    return marker.read(path)["config"]
