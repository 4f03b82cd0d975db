"""Reading a converted directory back: params in the decoding layout, checked against
the marker (marker.py) before and while they are read.

Memory: reading never holds a second copy of the weights. The reader restores one layer
(or one whole-model array) at a time, hashes it while the next one is read, and hands
each array to `place` (`jax.device_put`) before the next layer comes.

On a device mesh (`place` a `sharding.Placer`) only the slices this process's devices
hold are cast and placed, but every process still reads (and, verifying, hashes) every
whole array: params/ stores each array as one chunk, which orbax (tensorstore) reads
whole whatever slice is asked for, and the recorded checksums are of whole arrays.
Reading only a process's own shards takes a Hugging Face safetensors directory (see
checkpoints.assemble.read).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import warnings
from pathlib import Path

import jax
import numpy as np

from .. import model as model_lib
from ..config import ModelConfig
from . import marker
from .assemble import Progress
from .errors import CheckpointError
from .orbax_noise import OrbaxNoise

MARKER = marker.MARKER


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


def _groups(as_stored) -> list[dict]:
    """What to restore at once: each whole-model array alone, then each layer's arrays
    together."""
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
    the shapes and dtypes `config` implies. Arrays are then read a layer at a time and
    each is handed to `place` (default `jax.device_put`) as soon as it is read. With
    `verify` (the default) each stored array is hashed while the next layer is read and
    compared with the SHA-256 recorded at conversion; every mismatch is named;
    `verify=False` skips it. A read that fails is one CheckpointError, without the
    tracebacks orbax and tensorstore would print around it (`OrbaxNoise`). On a device
    mesh, see the module doc.
    """
    place = jax.device_put if place is None else place
    path = Path(path).absolute()
    meta = marker.read(path)
    stored = meta["config"]
    if not (path / "params").is_dir():
        raise CheckpointError(f"{path} has {MARKER} but no params/ directory")
    _check_sizes(path, meta)
    if verify:
        # First: an edited config may describe a model whose shapes take long to derive.
        _verify_config(path, meta)
    # Read in the dtype it was stored in, then cast: a bf16 checkpoint loads as float32
    # on CPU and the other way round.
    as_stored = model_lib.abstract_params(config.replace(dtype=stored.dtype))
    with OrbaxNoise():
        found_tree = _check_layout(path, meta, as_stored)
        params, hashers = _read_all(path, config, as_stored, found_tree, verify, progress,
                                    place)
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
    recorded = {n: (tuple(a["shape"]), a["dtype"]) for n, a in meta["arrays"].items()}
    problems = marker.compare(expected, recorded, f"the arrays list of {MARKER}")
    found_tree = _metadata(path / "params")
    stacked = sorted(n for n in marker.array_names(found_tree)
                     if n.split("/")[0] == marker.STACKED)
    if stacked:
        # The layout of an earlier format: a conversion writes each layer's arrays apart.
        problems.append(f"params/ holds arrays stacked over the layers ({', '.join(stacked)}), "
                        "which a conversion never writes; convert again")
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


def _read_all(path: Path, config: ModelConfig, as_stored, found_tree, verify: bool,
              progress: bool, place):
    """Every array of params/, a group at a time (see module doc), placed as it is read:
    (params, the stored names' hashers, fed only when verifying)."""
    params_dir = path / "params"
    target = np.dtype(model_lib.param_dtype(config))
    groups = _groups(as_stored)
    hashers = {n: hashlib.sha256() for n in marker.specs(as_stored)}

    def check(name: str, a: np.ndarray):
        hashers[marker.stored_name(name)[0]].update(
            memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))

    n_arrays = sum(len(marker.array_names(g)) for g in groups)
    bar = Progress(n_arrays, "params", progress,
                   total_bytes=sum(math.prod(s.shape) for s in jax.tree.leaves(as_stored))
                   * target.itemsize)
    params: dict = {}
    with concurrent.futures.ThreadPoolExecutor(marker.hash_workers()) as pool:
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
            pending = [pool.submit(check, n, a) for n, a in arrays.items()] if verify else []
            for name, a in arrays.items():
                _place(params, name, a, target, place)
                bar.step(nbytes=a.size * target.itemsize)
            del arrays
        for f in pending:
            f.result()
    return params, hashers


def _verify_arrays(path: Path, meta: dict, hashers: dict):
    """Each array's hash against the marker's; a marker without the config's checksum is
    warned about (stacklevel: the caller of `load`)."""
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
    """One restored array into `params` (decoding layout), cast and placed."""
    keys = name.split("/")
    node = params
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if getattr(place, "lazy", None) is not None:
        # On a mesh only the slices this process's devices hold are cast and placed (the
        # array itself was read whole: see the module doc).
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
