"""Converted checkpoints: orbax params plus the model config, written atomically.

Layout of a converted directory:
    packed_ss_config.json   {"format": "packed_ss_jax", "version": 1, "config": {...}}
    params/                 orbax StandardCheckpointer checkpoint of the params tree
    config.json, tokenizer files   copied from the source, when present

Everything is written into a hidden sibling directory that is renamed into place
only once complete, so a failed or interrupted conversion leaves no output.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterable

import jax
import jax.numpy as jnp

from .. import model as model_lib
from ..config import ModelConfig
from .errors import CheckpointError

MARKER = "packed_ss_config.json"
FORMAT = "packed_ss_jax"
VERSION = 1


def is_converted(path: str | Path) -> bool:
    return (Path(path) / MARKER).exists()


def save(dst: str | Path, config: ModelConfig, params, copy_files: Iterable[Path] = (),
         overwrite: bool = False) -> Path:
    import orbax.checkpoint as ocp

    dst = Path(dst).absolute()
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists (pass overwrite=True / --overwrite to replace it)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / "params", params)
        checkpointer.wait_until_finished()
        meta = {"format": FORMAT, "version": VERSION, "config": config.to_dict()}
        (tmp / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
        for f in copy_files:
            shutil.copyfile(f, tmp / Path(f).name)
        if dst.exists():
            old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def read_config(path: str | Path) -> ModelConfig:
    file = Path(path) / MARKER
    meta = json.loads(file.read_text())
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{file}: not a {FORMAT} v{VERSION} checkpoint")
    return ModelConfig.from_dict(meta["config"])


def restore(path: str | Path, config: ModelConfig):
    """Params of a converted checkpoint, cast to `config.dtype`."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if not (path / "params").is_dir():
        raise CheckpointError(f"{path} has {MARKER} but no params/ directory")
    stored = read_config(path)
    target = model_lib.abstract_params(config)
    # Restore with the dtype it was stored in, then cast: a bf16 checkpoint loads
    # as float32 on CPU and the other way round.
    as_stored = model_lib.abstract_params(config.replace(dtype=stored.dtype))
    try:
        params = ocp.StandardCheckpointer().restore(path / "params", as_stored)
    except Exception as e:  # orbax raises several types for a damaged checkpoint
        raise CheckpointError(f"cannot restore params from {path / 'params'}: {e}") from None
    return jax.tree.map(lambda a, t: jnp.asarray(a, t.dtype), params, target)
