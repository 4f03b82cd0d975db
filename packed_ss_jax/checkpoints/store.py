"""Converted checkpoints: orbax params plus a marker with the config and checksums.

Layout of a converted directory:
    packed_ss_config.json   format, version, config, per-array SHA-256, file list (marker.py)
    params/                 orbax StandardCheckpointer checkpoint of the params tree
    config.json, tokenizer files   copied from the source, when present

`Writer` builds everything in a hidden sibling directory, `.NAME.partial-<random>`, and
renames it into place only once complete (swapping atomically with a previous output),
so a failed or interrupted conversion leaves no output and no half-replaced one. Its
`commit` and `abort` are the critical sections: call them with signals held off (see
`interrupts.SignalGuard`).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import stat
import threading
import uuid
import warnings
from pathlib import Path
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from .. import model as model_lib
from ..config import ModelConfig
from . import atomic, marker
from .assemble import count_non_finite
from .errors import CheckpointError

MARKER = marker.MARKER
# What a format-version-1 conversion wrote next to params/ (v1 markers list no files).
_V1_FILES = {MARKER, "config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json"}


class DestinationError(ValueError):
    """An output path that cannot be written or must not be replaced."""


def is_converted(path: str | Path) -> bool:
    return os.path.lexists(Path(path) / MARKER)


def read_config(path: str | Path) -> ModelConfig:
    return marker.read(path)["config"]


def _hash_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def checksums(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    """SHA-256 of each array, several arrays at once (hashlib releases the GIL)."""
    with concurrent.futures.ThreadPoolExecutor(_hash_workers()) as pool:
        return dict(zip(arrays, pool.map(marker.checksum, arrays.values())))


# -- writing -------------------------------------------------------------------------

def replace_refusal(dst: Path) -> str | None:
    """Why an existing `dst` must not be replaced, or None when it may be: an empty
    directory, or a converted directory that holds nothing a conversion does not write
    (version 2: exactly the files its marker lists; version 1: params/ and the copied
    config and tokenizer files). Symbolic links and unwritable directories anywhere in
    it are refused too: a link is never written by a conversion, and an unwritable
    directory could not be removed after the swap."""
    if dst.is_symlink() or not dst.is_dir():
        return f"{dst} is not a directory"
    entries = os.listdir(dst)
    listed = None  # None: an empty directory, or a version-1 output
    if entries and MARKER not in entries:
        return (f"{dst} is not empty and is not a converted checkpoint (no {MARKER}); "
                f"--overwrite only replaces an earlier conversion output or an empty directory")
    if entries:
        try:
            meta = marker.read(dst)
        except (CheckpointError, ValueError) as e:
            return f"{dst} has a damaged {MARKER}, so it is not replaced: {e}"
        if meta["version"] >= 2:
            listed = set(meta["files"]) | {MARKER}
    unlisted: list[OSError] = []
    for root, dirs, files in os.walk(dst, onerror=unlisted.append):
        if not os.access(root, os.W_OK | os.X_OK):
            return f"{root} is not writable, so {dst} is not replaced"
        for name in dirs + files:
            full = Path(root, name)
            rel = full.relative_to(dst).as_posix()
            mode = full.lstat().st_mode
            if stat.S_ISLNK(mode):
                return f"{dst} holds a symbolic link, {rel}, which a conversion never writes"
            if stat.S_ISDIR(mode):
                rel += "/"
            elif not stat.S_ISREG(mode):
                return f"{dst} holds {rel}, which is not a regular file"
            if listed is not None:
                ok = rel in listed
            else:  # version 1: the top level is known, params/ belongs to orbax
                ok = rel in _V1_FILES or rel.startswith("params/")
            if not ok:
                return f"{dst} holds {rel}, which a conversion does not write; it is not replaced"
    if unlisted:
        return f"cannot list {unlisted[0].filename} ({unlisted[0].strerror}), so {dst} is not replaced"
    return None


def _walk(root: Path) -> list[str]:
    out = []
    for d, dirs, files in os.walk(root):
        rel = Path(d).relative_to(root)
        out += [(rel / n).as_posix() + "/" for n in dirs] + [(rel / n).as_posix() for n in files]
    return sorted(out)


class Writer:
    """One conversion output: `begin`, `write`, then `commit`, or `abort` on any failure.

    `dst` must already be checked (see `conversion.check_destination`) and absolute.
    """

    def __init__(self, dst: Path, overwrite: bool = False):
        self.dst, self.overwrite = Path(dst), overwrite
        # Named before anything is created, so `abort` knows what to remove whichever
        # instruction a signal lands on.
        self.tmp = self.dst.parent / f".{self.dst.name}.partial-{uuid.uuid4().hex}"
        self.new_parents: list[Path] = []
        self._thread: threading.Thread | None = None
        # Set by the params writer thread when it has finished, error or not. Waiting on
        # it rather than on Thread.join(): in CPython 3.11 a join() that a signal
        # interrupts can mark the still-running thread as stopped, and the next join()
        # then returns at once.
        self._written = threading.Event()
        # Whether the writer thread got going, decided under a lock against `abort`, so
        # that a thread interrupted in `start()` either writes and is waited for, or
        # does not write at all.
        self._lock = threading.Lock()
        self._started = self._aborted = False
        self._error: BaseException | None = None

    def begin(self):
        """Creates the hidden directory (and missing parents): fails fast on a read-only
        destination, before any tensor is read."""
        missing = []
        for p in [self.dst.parent, *self.dst.parent.parents]:
            if os.path.lexists(p):
                break
            missing.append(p)
        self.new_parents = missing  # deepest first
        try:
            for p in reversed(missing):
                p.mkdir()
            self.tmp.mkdir()
        except OSError as e:
            where = Path(e.filename).parent if e.filename else self.dst.parent
            raise DestinationError(f"cannot write the output {self.dst}: "
                                   f"{e.strerror or e} in {where}") from None

    def _save_params(self, params):
        import orbax.checkpoint as ocp

        with self._lock:
            if self._aborted:
                return
            self._started = True
        try:
            checkpointer = ocp.StandardCheckpointer()
            try:
                checkpointer.save(self.tmp / "params", params)
            finally:
                checkpointer.wait_until_finished()
                checkpointer.close()
        except BaseException as e:  # re-raised in the calling thread
            self._error = e
        finally:
            self._written.set()

    def write(self, config: ModelConfig, params, copy_files: Iterable[Path] = ()):
        """Writes params (in a writer thread), checksums and copies into the hidden directory."""
        arrays = {n: np.asarray(a) for n, a in marker.array_names(params).items()}
        # orbax writes from a thread of ours, so `abort` can wait for it: files must not
        # appear in the hidden directory after it was removed.
        self._thread = threading.Thread(target=self._save_params, args=(params,),
                                        name="packed-ss-params-writer", daemon=True)
        self._thread.start()
        sums = checksums(arrays)  # overlaps with the write
        self._written.wait()
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, OSError):
                raise DestinationError(f"cannot write {self.tmp / 'params'}: {error}") from error
            raise error
        try:
            for f in copy_files:
                shutil.copyfile(f, self.tmp / Path(f).name)
            meta = {"format": marker.FORMAT, "version": marker.VERSION,
                    "config": config.to_dict(),
                    "arrays": {n: {"shape": list(a.shape), "dtype": marker.dtype_name(a.dtype),
                                   "sha256": sums[n]} for n, a in arrays.items()},
                    "files": _walk(self.tmp)}
            (self.tmp / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
        except OSError as e:
            raise DestinationError(f"cannot write into {self.tmp}: {e}") from None

    def commit(self) -> Path:
        """Moves the finished output into place (critical section)."""
        dst = self.dst
        if not os.path.lexists(dst):
            try:
                atomic.rename_new(self.tmp, dst)
            except OSError as e:
                raise DestinationError(f"cannot move the output into place at {dst}: {e}") from None
            return dst
        if not self.overwrite:
            raise FileExistsError(f"{dst} appeared during the conversion; it was not replaced")
        reason = replace_refusal(dst)  # again: it may have changed during the conversion
        if reason:
            raise DestinationError(reason)
        try:
            old = atomic.replace(self.tmp, dst)
        except OSError as e:
            raise DestinationError(f"cannot move the output into place at {dst}: {e}") from None
        try:
            shutil.rmtree(old)
        except OSError as e:
            raise DestinationError(f"wrote {dst}, but could not remove the previous output "
                                   f"(now at {old}): {e}") from None
        return dst

    def abort(self):
        """Waits for the params writer, then removes what this writer created (critical
        section; safe to call more than once)."""
        with self._lock:
            self._aborted = True
            started = self._started
        if started:
            self._written.wait()
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)
        for p in self.new_parents:
            try:
                p.rmdir()  # only while empty: never removes anything else
            except OSError:
                break


def save(dst: str | Path, config: ModelConfig, params, copy_files: Iterable[Path] = (),
         overwrite: bool = False) -> Path:
    """Writes a converted directory (no path or signal checks: see `conversion.convert`)."""
    dst = Path(dst).absolute()
    if os.path.lexists(dst) and not overwrite:
        raise FileExistsError(f"{dst} already exists (pass overwrite=True / --overwrite to replace it)")
    writer = Writer(dst, overwrite)
    try:
        writer.begin()
        writer.write(config, params, copy_files)
        return writer.commit()
    except BaseException:
        writer.abort()
        raise


# -- reading -------------------------------------------------------------------------

def _stored_specs(params_dir: Path) -> dict:
    """name -> (shape, dtype) from orbax's metadata, without reading any array."""
    import orbax.checkpoint as ocp

    try:
        meta = ocp.StandardCheckpointer().metadata(params_dir)
    except Exception as e:  # orbax raises several types for damaged metadata
        raise CheckpointError(f"cannot read the array metadata in {params_dir}: {e}") from None
    tree = getattr(meta, "item_metadata", meta)
    try:
        return marker.specs(tree)
    except (AttributeError, TypeError) as e:
        raise CheckpointError(f"{params_dir}: unexpected metadata layout ({e})") from None


def restore(path: str | Path, config: ModelConfig, verify: bool = True):
    """Params of a converted checkpoint, cast to `config.dtype`.

    The marker's array list and orbax's metadata are compared with the shapes and dtypes
    `config` implies before any array is read. With `verify` (the default) each array is
    then hashed and compared with the SHA-256 recorded at conversion; the first mismatch
    names the array. The hashing costs about 0.6 s per GiB per core here (SHA-256 with
    SHA-NI, arrays hashed in parallel), about 10 s single-core for an 8B bfloat16
    checkpoint (16 GB); `verify=False` skips it. Version-1 directories have no checksums:
    they are checked for NaN/Inf instead.
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta = marker.read(path)
    stored = meta["config"]
    params_dir = path / "params"
    if not params_dir.is_dir():
        raise CheckpointError(f"{path} has {MARKER} but no params/ directory")
    target = model_lib.abstract_params(config)
    # Restore with the dtype it was stored in, then cast: a bf16 checkpoint loads
    # as float32 on CPU and the other way round.
    as_stored = model_lib.abstract_params(config.replace(dtype=stored.dtype))
    expected = marker.specs(as_stored)
    problems = []
    if meta["version"] >= 2:
        recorded = {n: (tuple(a["shape"]), a["dtype"]) for n, a in meta["arrays"].items()}
        problems += marker.compare(expected, recorded, f"the arrays list of {MARKER}")
    problems += marker.compare(expected, _stored_specs(params_dir), "params/")
    if problems:
        raise CheckpointError(f"{path}: params do not match the config in {MARKER}:\n  "
                              + "\n  ".join(problems))
    try:
        params = ocp.StandardCheckpointer().restore(params_dir, as_stored)
    except Exception as e:  # orbax raises several types for a damaged checkpoint
        bad = _unreadable(params_dir, as_stored)
        if bad:
            raise CheckpointError(f"{params_dir}: cannot read {', '.join(bad)} (damaged params "
                                  f"files): {bad[next(iter(bad))]}") from None
        raise CheckpointError(f"cannot restore params from {params_dir}: {e}") from None
    if verify:
        _verify(path, meta, params)
    return jax.tree.map(lambda a, t: jnp.asarray(a, t.dtype), params, target)


def _unreadable(params_dir: Path, abstract) -> dict[str, str]:
    """The arrays orbax cannot read, one at a time (after a failed restore: names them)."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    bad = {}
    for name, spec in marker.array_names(abstract).items():
        item: dict = {}
        keys = name.split("/")
        node = item
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = spec
        restore_args = jax.tree.map(
            lambda s: ocp.RestoreArgs(restore_type=np.ndarray, dtype=s.dtype), item)
        try:
            checkpointer.restore(params_dir, args=ocp.args.PyTreeRestore(
                item=item, restore_args=restore_args, partial_restore=True))
        except Exception as e:  # noqa: BLE001 - any failure marks the array
            bad[name] = str(e).splitlines()[0][:300]
    return bad


def _verify(path: Path, meta: dict, params):
    arrays = marker.array_names(params)
    if meta["version"] < 2:
        warnings.warn(f"{path} was converted by an older version that recorded no checksums: "
                      "checked for NaN/Inf only; convert it again to get verification",
                      stacklevel=3)
        bad = [f"{n} ({k} non-finite values)" for n, a in arrays.items()
               if (k := count_non_finite(np.asarray(a)))]
        if bad:
            raise CheckpointError(f"{path}: non-finite values in {', '.join(bad)}")
        return
    with concurrent.futures.ThreadPoolExecutor(_hash_workers()) as pool:
        got = dict(zip(arrays, pool.map(lambda a: marker.checksum(np.asarray(a)), arrays.values())))
    bad = [n for n in arrays if got[n] != meta["arrays"][n]["sha256"]]
    if bad:
        raise CheckpointError(
            f"{path}: checksum mismatch in {', '.join(bad)}: the params files changed after "
            "conversion (damaged or edited); convert again, or pass verify=False / --no-verify "
            "to load anyway")
