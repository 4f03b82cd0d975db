"""Writing a converted directory: orbax params plus the marker, built aside and swapped
into place.

Memory: writing never holds a second copy of the weights. The writer hands orbax the
NumPy arrays as they are (its default NumPy handler deep-copies every array first, and
zstd compression stages the compressed bytes in memory until the commit: each would be
one more copy of the weights; bf16 weights compress by only ~20%), and the checksums are
computed from the per-layer arrays while orbax writes.

`Writer` builds everything in a hidden sibling directory, `.NAME.partial-<random>`, and
renames it into place only once complete (swapping atomically with a previous output),
so a failed or interrupted conversion leaves no output and no half-replaced one. Its
`commit` and `abort` are the critical sections: call them with signals held off (see
`interrupts.SignalGuard`). `replace_refusal` says when `--overwrite` may replace an
existing directory.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import stat
import threading
import uuid
from pathlib import Path
from typing import Iterable

import jax
import numpy as np

from .. import model as model_lib
from ..config import ModelConfig
from . import atomic, marker
from .assemble import Progress
from .errors import CheckpointError

MARKER = marker.MARKER


class DestinationError(ValueError):
    """An output path that cannot be written or must not be replaced."""


def host_arrays(params) -> dict:
    """The params as NumPy arrays in the decoding layout, without copying: a CPU jax
    array's NumPy view, a stacked array's per-layer views."""
    return model_lib.unstack_layers(jax.tree.map(np.asarray, params))


def _numpy_checkpointer():
    """An orbax checkpointer that writes NumPy arrays in place: without the deep copy of
    orbax's default NumPy handler and without compression (see module doc). The arrays
    must not change until it returns; they are the converter's own."""
    import orbax.checkpoint as ocp

    handlers = ocp.type_handlers
    registry = handlers.create_type_handler_registry(
        (np.ndarray, handlers.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, handlers.get_type_handler(jax.Array)))  # orbax wants one registered
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry,
                                                        use_compression=False))


def replace_refusal(dst: Path) -> str | None:
    """Why an existing `dst` must not be replaced, or None when it may be: an empty
    directory, or a converted directory that holds nothing a conversion does not write
    (exactly the files its marker lists). Symbolic links and unwritable directories
    anywhere in it are refused too: a link is never written by a conversion, and an
    unwritable directory could not be removed after the swap."""
    if dst.is_symlink() or not dst.is_dir():
        return f"{dst} is not a directory"
    entries = os.listdir(dst)
    if entries and MARKER not in entries:
        return (f"{dst} is not empty and is not a converted checkpoint (no {MARKER}); "
                f"--overwrite only replaces an earlier conversion output or an empty directory")
    listed = {MARKER}
    if entries:
        try:
            listed |= set(marker.read(dst)["files"])
        except marker.FormatVersionError as e:
            # Its marker lists no files this packed_ss_jax can check.
            return (f"{dst} is a conversion in format version {e.version}, which this "
                    "packed_ss_jax no longer reads, so it is not replaced; remove it, then "
                    "convert again")
        except (CheckpointError, ValueError) as e:
            return f"{dst} has a damaged {MARKER}, so it is not replaced: {e}"
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
            if rel not in listed:
                return f"{dst} holds {rel}, which a conversion does not write; it is not replaced"
    if unlisted:
        return f"cannot list {unlisted[0].filename} ({unlisted[0].strerror}), so {dst} is not replaced"
    return None


def _bytes_under(root: Path) -> int:
    total = 0
    for d, _, files in os.walk(root):
        for n in files:
            try:
                total += os.stat(os.path.join(d, n)).st_size
            except OSError:  # orbax renames and removes its temporary files as it goes
                pass
    return total


def _sizes(root: Path, sub: str) -> dict[str, int]:
    """Bytes of every file under root/sub, by path relative to root."""
    return {rel: (root / rel).stat().st_size
            for rel in _walk(root) if rel.startswith(sub + "/") and not rel.endswith("/")}


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

    def _save_params(self, arrays):
        import orbax.checkpoint as ocp

        with self._lock:
            if self._aborted:
                return
            self._started = True
        try:
            checkpointer = _numpy_checkpointer()
            try:
                checkpointer.save(self.tmp / "params", args=ocp.args.PyTreeSave(arrays))
            finally:
                checkpointer.close()
        except BaseException as e:  # re-raised in the calling thread
            self._error = e
        finally:
            self._written.set()

    def write(self, config: ModelConfig, params, copy_files: Iterable[Path] = (),
              progress: bool = False):
        """Writes params (in a writer thread), checksums and copies into the hidden directory.

        `params` in either layout (NumPy or jax arrays); params/ gets the decoding layout
        and the marker the stored names, shapes and checksums (see marker.py)."""
        arrays = host_arrays(params)
        specs, problems = marker.stored_specs(arrays)
        if problems:
            raise ValueError("params tree: " + "; ".join(problems))
        # orbax writes from a thread of ours, so `abort` can wait for it: files must not
        # appear in the hidden directory after it was removed.
        self._thread = threading.Thread(target=self._save_params, args=(arrays,),
                                        name="packed-ss-params-writer", daemon=True)
        self._thread.start()
        leaves = jax.tree.leaves(arrays)
        bar = Progress(len(leaves), "writing params", progress, noun="arrays",
                       total_bytes=sum(a.nbytes for a in leaves))
        pool = concurrent.futures.ThreadPoolExecutor(marker.hash_workers())
        try:
            # The checksums are computed while orbax writes.
            futures = {n: pool.submit(marker.checksum, parts)
                       for n, parts in marker.stored_parts(arrays).items()}
            while not self._written.wait(0.25):
                if progress:
                    bar.set_bytes(_bytes_under(self.tmp))  # orbax writes into a temporary name
            sums = {n: f.result() for n, f in futures.items()}
        finally:
            pool.shutdown(cancel_futures=True)  # on an interrupt: no hashing left queued
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, OSError):
                raise DestinationError(f"cannot write {self.tmp / 'params'}: {error}") from error
            raise error
        bar.finish()
        try:
            for f in copy_files:
                shutil.copyfile(f, self.tmp / Path(f).name)
            raw = config.to_dict()
            meta = {"format": marker.FORMAT, "version": marker.VERSION,
                    "config": raw,
                    "arrays": {n: {"shape": list(shape), "dtype": dtype, "sha256": sums[n]}
                               for n, (shape, dtype) in sorted(specs.items())},
                    "files": _walk(self.tmp),
                    "checksums": {"config": marker.config_checksum(raw),
                                  **{name: marker.file_checksum(self.tmp / name)
                                     for name in marker.COVERED_FILES
                                     if (self.tmp / name).is_file()}},
                    "sizes": _sizes(self.tmp, "params")}
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
