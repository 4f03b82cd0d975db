"""Edited and writable copies of the fixture checkpoints, and whole-tree snapshots.

Tests that write, overwrite or damage a checkpoint work on copies: the fixtures may be
writable to the test process, and a conversion bug must never reach them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

from safetensors.numpy import load_file, save_file


def copy_checkpoint(src: Path, dst: Path, edit=None, config_edit=None) -> Path:
    """A single-file copy of the fixture checkpoint, optionally with edited tensors/config."""
    dst.mkdir()
    weights = {}
    for f in sorted(src.glob("model-*.safetensors")):
        weights.update(load_file(f))
    if edit:
        edit(weights)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def writable_copy(src: Path, dst: Path) -> Path:
    """A full copy (shards, adapter, reference) whose files the test may change."""
    shutil.copytree(src, dst)
    for root, dirs, files in os.walk(dst):
        for n in dirs + files:
            p = Path(root, n)
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
    dst.chmod(dst.stat().st_mode | stat.S_IWUSR)
    return dst


def snapshot(root: Path) -> dict[str, str]:
    """relative path -> content digest / link target / "dir", for everything under root."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(d, n)
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
