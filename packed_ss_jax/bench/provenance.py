"""What a benchmark run needs to be reproduced: software versions, the device, a checksum
of the model's files, the exact command line and the seeds."""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path

CHUNK = 1 << 20


def directory_sha256(path: str | Path) -> dict:
    """SHA-256 over a checkpoint directory: every regular file below it (symbolic links
    to files followed, as Hugging Face caches use them; links to directories are not),
    in sorted order of relative path, each as its path, size and content. Returns the
    digest, the file count and the bytes hashed. A file is named in the error if it
    cannot be read."""
    root = Path(path)
    if not root.is_dir():
        raise NotADirectoryError(f"model directory {root} is not a directory")
    files = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in filenames:
            p = Path(dirpath) / name
            if p.is_file():  # skips sockets, fifos and dangling links
                files.append(p)
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    h, total = hashlib.sha256(), 0
    for p in files:
        rel = p.relative_to(root).as_posix().encode()
        try:
            with open(p, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                h.update(len(rel).to_bytes(8, "little") + rel + size.to_bytes(8, "little"))
                seen = 0
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    seen += len(chunk)
        except OSError as e:
            raise OSError(f"cannot hash model file {p}: {e.strerror or e}") from None
        if seen != size:
            raise OSError(f"model file {p} changed size while it was hashed")
        total += size
    return {"sha256": h.hexdigest(), "files": len(files), "bytes": total}


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def record(argv: list[str], flags: dict, model: str, model_dir: str | Path,
           extra_files: dict) -> dict:
    """The reproducibility record of a run (saved under "reproducibility" in the JSON).
    `model` is the model as the command line named it (a path or an embedded model's
    name), `model_dir` the directory it resolved to, which is hashed."""
    import jax
    import jaxlib
    import numpy as np

    # The package root's version: the root is initialised before any of its submodules,
    # so it is read from there rather than imported (no module imports the root).
    version = sys.modules[__name__.split(".")[0]].__version__
    devices = jax.devices()
    return {
        "package": "packed-ss-jax", "package_version": version,
        "python": platform.python_version(), "jax": jax.__version__,
        "jaxlib": jaxlib.__version__, "numpy": np.__version__,
        "platform": devices[0].platform, "device_kind": devices[0].device_kind,
        "device_count": len(devices), "machine": platform.machine(),
        "argv": list(argv), "flags": dict(flags),
        "model": model, "model_checksum": directory_sha256(model_dir),
        "files_sha256": {k: file_sha256(v) for k, v in extra_files.items() if v is not None
                         and Path(v).is_file()},
    }


def command(argv: list[str], prog: str) -> str:
    """The command line as one string a shell reads back the same."""
    import shlex

    return " ".join([prog] + [shlex.quote(a) for a in argv]) if argv is not None else \
        " ".join(shlex.quote(a) for a in [prog] + sys.argv[1:])
