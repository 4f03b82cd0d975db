"""Converted checkpoints: orbax params plus a marker with the config and checksums.

Layout of a converted directory:
    packed_ss_config.json   format, version, config, per-array SHA-256, file list, the
                            SHA-256 of the config and of the copied config.json, the size
                            of every params file (marker.py)
    params/                 orbax checkpoint of the params in the decoding layout
                            (`layer_{i}/...`, one array per layer weight), uncompressed
    config.json, tokenizer files   copied from the source, when present

Memory: writing and reading never hold a second copy of the weights. The writer hands
orbax the NumPy arrays as they are (its default NumPy handler deep-copies every array
first, and zstd compression stages the compressed bytes in memory until the commit:
each was one more copy of the weights; bf16 weights compress by only ~20%), and the
checksums are computed from the per-layer arrays while orbax writes. The reader restores
one layer (or one whole-model array) at a time, hashes it while the next one is read,
and hands each array to `place` (`jax.device_put`) before the next layer comes.

`Writer` builds everything in a hidden sibling directory, `.NAME.partial-<random>`, and
renames it into place only once complete (swapping atomically with a previous output),
so a failed or interrupted conversion leaves no output and no half-replaced one. Its
`commit` and `abort` are the critical sections: call them with signals held off (see
`interrupts.SignalGuard`).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import math
import os
import shutil
import stat
import sys
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Iterable

import jax
import numpy as np

from .. import model as model_lib
from ..config import ModelConfig
from . import atomic, marker
from .assemble import Progress, count_non_finite
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


def checksums(arrays: dict) -> dict[str, str]:
    """SHA-256 of each array (or of each list of arrays, their bytes one after another:
    a stacked weight's layers), several at once (hashlib releases the GIL)."""
    with concurrent.futures.ThreadPoolExecutor(_hash_workers()) as pool:
        return dict(zip(arrays, pool.map(marker.checksum, arrays.values())))


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
        pool = concurrent.futures.ThreadPoolExecutor(_hash_workers())
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

# Where orbax's own log records come from (orbax is imported only when first used).
_ORBAX_PART = f"{os.sep}orbax{os.sep}"
_CLOSED_LOOP = "Event loop is closed"
# After a failed read: how long no late callback must have come before the filter goes,
# and the longest wait for that (they came within milliseconds here).
_SETTLE_S, _SETTLE_MAX_S = 0.2, 2.0


class _OrbaxNoise:
    """While params/ is read, drops what orbax and tensorstore print around a failed read,
    so that the failure is the one-line CheckpointError alone: tensorstore's completion
    callbacks for the reads still in flight land on the event loop orbax has already
    closed, each an unraisable RuntimeError traceback printed from tensorstore's threads
    (up to milliseconds after the failure), and orbax logs warnings through absl.
    Anything else reaches the previous hook or handlers unchanged. Re-entrant and shared
    between threads: the hook is installed by the first user and removed by the last."""

    _lock = threading.Lock()
    _users = 0
    _previous = None
    _installed = None  # the bound method set as the hook (each access makes a new one)
    _last = 0.0

    def __enter__(self):
        cls = type(self)
        with cls._lock:
            if cls._users == 0:
                cls._previous = sys.unraisablehook
                sys.unraisablehook = cls._installed = cls._hook
                logging.getLogger("absl").addFilter(cls._log_filter)
            cls._users += 1
        return self

    def __exit__(self, kind, value, tb):
        cls = type(self)
        if kind is not None:
            cls._settle(time.monotonic())
        with cls._lock:
            cls._users -= 1
            if cls._users == 0:
                if sys.unraisablehook is cls._installed:  # unless replaced since
                    sys.unraisablehook = cls._previous
                logging.getLogger("absl").removeFilter(cls._log_filter)

    @classmethod
    def _hook(cls, unraisable):
        if isinstance(unraisable.exc_value, RuntimeError) and \
                str(unraisable.exc_value) == _CLOSED_LOOP:
            cls._last = time.monotonic()
            return
        cls._previous(unraisable)

    @staticmethod
    def _log_filter(record: logging.LogRecord) -> bool:
        return _ORBAX_PART not in record.pathname

    @classmethod
    def _settle(cls, failed_at: float):
        """Waits until the reads a failure left in flight have had their callbacks."""
        deadline = failed_at + _SETTLE_MAX_S
        while (now := time.monotonic()) < deadline:
            quiet_since = max(failed_at, cls._last)
            if now - quiet_since >= _SETTLE_S:
                return
            time.sleep(min(_SETTLE_S, deadline - now))

def _metadata(params_dir: Path):
    """orbax's metadata tree of params/ (shapes and dtypes), without reading any array."""
    import orbax.checkpoint as ocp

    try:
        meta = ocp.StandardCheckpointer().metadata(params_dir)
    except Exception as e:  # orbax raises several types for damaged metadata
        raise CheckpointError(f"cannot read the array metadata in {params_dir}: {e}") from None
    tree = getattr(meta, "item_metadata", meta)
    if tree is None:  # orbax logs a warning and returns nothing for unreadable metadata
        raise CheckpointError(f"cannot read the array metadata in {params_dir} (damaged params "
                              "files)")
    try:
        marker.specs(tree)
    except (AttributeError, TypeError) as e:
        raise CheckpointError(f"{params_dir}: unexpected metadata layout ({e})") from None
    return tree


def _item(name: str, spec) -> dict:
    """The nested-dict tree holding one array at its "a/b/c" name."""
    item: dict = {}
    node = item
    keys = name.split("/")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = spec
    return item


def _read(params_dir: Path, item) -> dict[str, np.ndarray]:
    """The arrays of `item` (a tree of ShapeDtypeStructs, part of params/), as NumPy
    arrays of their stored dtype, by name."""
    import orbax.checkpoint as ocp

    restore_args = jax.tree.map(
        lambda s: ocp.RestoreArgs(restore_type=np.ndarray, dtype=s.dtype), item)
    got = ocp.PyTreeCheckpointer().restore(params_dir, args=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True))
    return marker.array_names(got)


def _groups(as_stored, layered: bool) -> list[dict]:
    """What to restore at once: each whole-model array alone, then each layer's arrays
    together (params/ in the decoding layout) or each stacked array alone (version 2)."""
    if not layered:
        return [_item(n, s) for n, s in marker.array_names(as_stored).items()]
    decoding = jax.eval_shape(model_lib.unstack_layers, as_stored)
    layers = sorted((k for k in decoding if k.startswith("layer_")), key=lambda k: int(k[6:]))
    return ([_item(n, s) for n, s in marker.array_names(
                {k: v for k, v in decoding.items() if k not in layers}).items()]
            + [{k: decoding[k]} for k in layers])


def restore(path: str | Path, config: ModelConfig, verify: bool = True, progress: bool = False,
            place=None):
    """Params of a converted checkpoint in the decoding layout, cast to `config.dtype`.

    Before any array is read: a params file shorter than written (the marker's `sizes`)
    is named; with `verify`, the marker's config and the copied config.json are compared
    with the checksums recorded at conversion (a marker from before they were recorded
    loads with a warning); the marker's array list and orbax's metadata are compared with
    the shapes and dtypes `config` implies. Arrays are then read a layer at a time (see
    module doc) and each is handed to `place` (default `jax.device_put`) as soon as it is
    read. With `verify` (the default) each stored array is hashed and compared with the
    SHA-256 recorded at conversion; every mismatch is named. The hashing costs about
    0.6 s per GiB per core here and runs while the next layer is read; `verify=False`
    skips it. Version-1 directories have no checksums: they are checked for NaN/Inf
    instead. A read that fails is one CheckpointError, without the tracebacks orbax and
    tensorstore would print around it (`_OrbaxNoise`).

    On a device mesh (`place` a `sharding.Placer`) only the slices this process's devices
    hold are cast and placed, but every process still reads (and, verifying, hashes)
    every whole array: params/ stores each array as one chunk, which orbax (tensorstore)
    reads whole whatever slice is asked for, and the recorded checksums are of whole
    arrays. Reading only a process's own shards takes a Hugging Face safetensors
    directory (see checkpoints.assemble.read).
    """
    place = jax.device_put if place is None else place
    path = Path(path).absolute()
    meta = marker.read(path)
    stored = meta["config"]
    params_dir = path / "params"
    if not params_dir.is_dir():
        raise CheckpointError(f"{path} has {MARKER} but no params/ directory")
    _check_sizes(path, meta)
    if verify:
        # First: an edited config may describe a model whose shapes take long to derive.
        _verify_config(path, meta)
    # Read in the dtype it was stored in, then cast: a bf16 checkpoint loads as float32
    # on CPU and the other way round.
    as_stored = model_lib.abstract_params(config.replace(dtype=stored.dtype))
    with _OrbaxNoise():
        found_tree = _check_layout(path, meta, as_stored)
        params, hashers, non_finite = _read_all(path, meta, config, as_stored, found_tree,
                                                verify, progress, place)
    if non_finite:
        raise CheckpointError(f"{path}: non-finite values in {', '.join(non_finite)}")
    if verify:
        _verify_arrays(path, meta, hashers)
    return params


def _check_sizes(path: Path, meta: dict):
    """Names a params file that is missing or shorter than written (truncated) before orbax
    reads it, whether verifying or not: orbax could not read it either."""
    for rel, written in meta.get("sizes", {}).items():
        file = path / rel
        try:
            found = file.stat().st_size
        except OSError:
            raise CheckpointError(f"{file}: missing ({written} bytes were written at "
                                  "conversion): the params files are damaged; copy the "
                                  "checkpoint again or convert again") from None
        if found < written:
            raise CheckpointError(f"{file}: {found} bytes, {written} were written at conversion "
                                  "(truncated); copy the checkpoint again or convert again")


def _check_layout(path: Path, meta: dict, as_stored) -> dict:
    """orbax's metadata tree of params/, once it and the marker's arrays list agree with
    the shapes and dtypes the config implies."""
    expected = marker.specs(as_stored)
    problems = []
    if meta["version"] >= 2:
        recorded = {n: (tuple(a["shape"]), a["dtype"]) for n, a in meta["arrays"].items()}
        problems += marker.compare(expected, recorded, f"the arrays list of {MARKER}")
    found_tree = _metadata(path / "params")
    found, layout = marker.stored_specs(found_tree)
    problems += [f"params/: {p}" for p in layout] + marker.compare(expected, found, "params/")
    if problems:
        raise CheckpointError(f"{path}: params do not match the config in {MARKER}:\n  "
                              + "\n  ".join(problems))
    return found_tree


_AGAIN = "convert again, or pass verify=False / --no-verify to load anyway"


def _verify_config(path: Path, meta: dict):
    """The marker's config and the copied config.json against the checksums recorded at
    conversion (a marker written before they were recorded is warned about once the
    arrays are verified)."""
    sums = meta.get("checksums")
    if sums is None:
        return
    if meta["config_digest"] != sums["config"]:
        raise CheckpointError(f"{path / MARKER}: its 'config' changed after conversion "
                              "(checksum mismatch), so it no longer describes the params it "
                              f"was converted with; {_AGAIN}")
    for name in marker.COVERED_FILES:
        if name not in sums:
            continue
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (it was copied here at conversion); copy it "
                                  f"back, {_AGAIN}")
        if marker.file_checksum(file) != sums[name]:
            # The loader reads the config in the marker: an edit here would not take effect.
            raise CheckpointError(f"{file}: changed after conversion (checksum mismatch); a "
                                  f"converted checkpoint runs with the config of {MARKER}, so "
                                  "edit the Hugging Face checkpoint's config.json and "
                                  f"{_AGAIN}")


def _read_all(path: Path, meta: dict, config: ModelConfig, as_stored, found_tree, verify: bool,
              progress: bool, place):
    """Every array of params/, a group at a time (see module doc), placed as it is read:
    (params, the stored names' hashers, the arrays holding NaN/Inf)."""
    params_dir = path / "params"
    target = np.dtype(model_lib.param_dtype(config))
    groups = _groups(as_stored, marker.is_layered(found_tree))
    hashers = {n: hashlib.sha256() for n in marker.specs(as_stored)}
    non_finite: list[str] = []
    checksummed = verify and meta["version"] >= 2

    def check(name: str, a: np.ndarray):
        if checksummed:
            hashers[marker.stored_name(name)[0]].update(
                memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))
        elif verify and (k := count_non_finite(a)):
            non_finite.append(f"{name} ({k} non-finite values)")

    n_arrays = sum(len(marker.array_names(g)) for g in groups)
    bar = Progress(n_arrays, "params", progress,
                   total_bytes=sum(math.prod(s.shape) for s in jax.tree.leaves(as_stored))
                   * target.itemsize)
    params: dict = {}
    with concurrent.futures.ThreadPoolExecutor(_hash_workers()) as pool:
        pending: list = []
        for item in groups:
            try:
                arrays = _read(params_dir, item)
            except Exception as e:  # orbax raises several types for a damaged checkpoint
                _raise_unreadable(params_dir, as_stored, found_tree, e)
            # The previous group's hashes must be done before this group's update the
            # same hashers (layer order); meanwhile this group was being read.
            for f in pending:
                f.result()
            pending = [pool.submit(check, n, a) for n, a in arrays.items()]
            for name, a in arrays.items():
                _place(params, name, a, target, place)
                bar.step(nbytes=a.size * target.itemsize)
            del arrays
        for f in pending:
            f.result()
    return params, hashers, non_finite


def _verify_arrays(path: Path, meta: dict, hashers: dict):
    """Each array's hash against the marker's; a marker without checksums is warned about
    (stacklevel: the caller of `load`)."""
    if meta["version"] < 2:
        warnings.warn(f"{path} was converted by an older version that recorded no checksums: "
                      "checked for NaN/Inf only; convert it again to get verification",
                      stacklevel=4)
        return
    bad = [n for n in hashers if hashers[n].hexdigest() != meta["arrays"][n]["sha256"]]
    if bad:
        raise CheckpointError(
            f"{path}: checksum mismatch in {', '.join(bad)}: the params files changed after "
            f"conversion (damaged or edited); {_AGAIN}")
    if "checksums" not in meta:
        warnings.warn(f"{path}: {MARKER} records no checksum of its config (converted by an "
                      "older packed_ss_jax), so a changed config goes unnoticed; convert again "
                      "to cover it", stacklevel=4)


def _place(params: dict, name: str, a: np.ndarray, target, place):
    """One restored array into `params` (decoding layout), cast and placed; a stacked
    array (version 2) goes in layer by layer."""
    stored, layer = marker.stored_name(name)
    keys = name.split("/")
    if layer is None and keys[0] == marker.STACKED:
        for i in range(a.shape[0]):
            _place(params, f"layer_{i}/" + "/".join(keys[1:]), a[i], target, place)
        return
    node = params
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if getattr(place, "lazy", None) is not None:
        # On a mesh only the slices this process's devices hold are cast and placed (the
        # array itself was read whole: see `restore`).
        node[keys[-1]] = place.lazy(a.shape, keys, lambda index: _cast(a[index], target))
        return
    a = _cast(a, target)
    # A placer that shards (`sharding.placer`) needs the weight's path to pick its shards.
    node[keys[-1]] = place(a, keys) if getattr(place, "with_path", False) else place(a)


def _cast(a: np.ndarray, target) -> np.ndarray:
    return a if a.dtype == target else a.astype(target)


def _raise_unreadable(params_dir: Path, as_stored, found_tree, error: Exception):
    """After a failed read: names every array orbax cannot read (stored names)."""
    bad = _unreadable(params_dir, found_tree, as_stored)
    if bad:
        raise CheckpointError(f"{params_dir}: cannot read {', '.join(bad)} (damaged params "
                              f"files): {bad[next(iter(bad))]}") from None
    raise CheckpointError(f"cannot restore params from {params_dir}: {error}") from None


def _unreadable(params_dir: Path, found_tree, as_stored) -> dict[str, str]:
    """The arrays orbax cannot read, one at a time, under their stored names."""
    dtypes = {n: s.dtype for n, s in marker.array_names(as_stored).items()}
    bad = {}
    for name, spec in marker.array_names(found_tree).items():
        stored = marker.stored_name(name)[0]
        if stored in bad:
            continue
        item = _item(name, jax.ShapeDtypeStruct(tuple(spec.shape), dtypes.get(stored, spec.dtype)))
        try:
            _read(params_dir, item)
        except Exception as e:  # noqa: BLE001 - any failure marks the array
            bad[stored] = str(e).splitlines()[0][:300]
    return {n: bad[n] for n in dtypes if n in bad}
