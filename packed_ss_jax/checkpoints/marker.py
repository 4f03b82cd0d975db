"""The marker file of a converted directory: config, array checksums, file list.

`packed_ss_config.json` (format version 3) records the model config, the shape, dtype and
SHA-256 of every param array of the stored layout, checksums of the config, the size of
every file under params/ and the files the conversion wrote; its fields and what each
protects: docs/checkpoints.md#the-marker-file. params/ holds the decoding layout, so a
stacked array's checksum is that of its layers' bytes one after another, computed from
the per-layer arrays alone. Only version 3 is read (an earlier one: `FormatVersionError`).

Everything read from a marker is validated here, so a damaged one gives an error naming
the file and the field instead of a traceback further down.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import types
import typing
from pathlib import Path

import jax
import numpy as np

from ..config import ConfigError, ModelConfig, check_token_ids
from .errors import CheckpointError

MARKER = "packed_ss_config.json"
FORMAT = "packed_ss_jax"
VERSION = 3
# The formats of the pre-release packed_ss_jax, which are no longer read.
EARLIER_VERSIONS = (1, 2)
_KEYS = {"format", "version", "config", "arrays", "files"}
# Keys a marker may lack (written before they were added).
_LATER_KEYS = {"checksums", "sizes"}
_HEX64 = re.compile(r"[0-9a-f]{64}")
# The copied files whose checksum a conversion records (in `checksums`).
COVERED_FILES = ("config.json",)


class FormatVersionError(CheckpointError):
    """A converted directory in an earlier format, which this packed_ss_jax no longer
    reads: it must be converted again."""

    def __init__(self, file: Path, version: int):
        self.version = version
        super().__init__(
            f"{file}: format version {version}, written by a pre-release packed_ss_jax; this "
            f"one reads only version {VERSION}. Run `packed-ss convert` on the original "
            "checkpoint again (into a new directory, or remove this one first)")


def hash_workers() -> int:
    """The threads that hash arrays at once (hashlib releases the GIL)."""
    return max(1, min(8, os.cpu_count() or 1))


def checksum(a) -> str:
    """SHA-256 of an array's bytes (C order, native byte order), or of several arrays'
    bytes one after another (a stacked array's layers: the same digest as the stack's).

    SHA-256, not CRC-32: a CRC is faster but can be forged to match edited weights, so it
    would catch accidents only.
    """
    h = hashlib.sha256()
    for part in (a if isinstance(a, (list, tuple)) else [a]):
        flat = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
        h.update(memoryview(flat))
    return h.hexdigest()


def config_checksum(config: dict) -> str:
    """SHA-256 of a marker's `config` object as canonical JSON (sorted keys, no spaces):
    reformatting the file does not change it, a changed value does. Taken of the object
    as written rather than of a ModelConfig, so a field added to ModelConfig later does
    not change the checksum of an older conversion."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def file_checksum(path: Path) -> str:
    """SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def array_names(tree) -> dict[str, object]:
    """"layers/attn/q_proj" -> leaf, for a params tree of nested dicts."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(str(k.key) for k in path): leaf for path, leaf in flat}


# -- the two layouts ------------------------------------------------------------------
# Stored: "layers/attn/q_proj" holds every layer, stacked on axis 0 (what checkpoints,
# training and the marker's `arrays` speak). Decoding: "layer_3/attn/q_proj" is layer 3
# alone (what a loaded Model holds, and params/). See model.py.

STACKED = "layers"
_LAYER = re.compile(r"layer_(0|[1-9][0-9]*)")


def stored_name(name: str) -> tuple[str, int | None]:
    """"layer_3/attn/q_proj" -> ("layers/attn/q_proj", 3); any other name -> (name, None)."""
    head, sep, rest = name.partition("/")
    m = _LAYER.fullmatch(head)
    if m and sep:
        return f"{STACKED}/{rest}", int(m.group(1))
    return name, None


def stored_parts(tree) -> dict[str, list]:
    """Stored name -> the leaves that hold it, in layer order: one per layer for a name
    held per layer (the decoding layout), else the leaf itself. Raises ValueError when a
    name's layers are not exactly 0 .. n-1, or it is held both ways."""
    return {name: leaves for name, (_, leaves) in _grouped(tree).items()}


def _grouped(tree) -> dict[str, tuple[bool, list]]:
    by_name: dict[str, dict] = {}
    for name, leaf in array_names(tree).items():
        stored, layer = stored_name(name)
        by_name.setdefault(stored, {})[layer] = leaf
    out = {}
    for stored, by_layer in by_name.items():
        if None in by_layer:
            if len(by_layer) > 1:
                raise ValueError(f"{stored} is stored both whole and per layer")
            out[stored] = (False, [by_layer[None]])
            continue
        layers = sorted(by_layer)
        if layers != list(range(len(layers))):
            raise ValueError(f"{stored} is stored for layers {layers}, not 0 .. {len(layers) - 1}")
        out[stored] = (True, [by_layer[i] for i in layers])
    return out


def dtype_name(dtype) -> str:
    return np.dtype(dtype).name  # "float32", "bfloat16" (ml_dtypes)


def read(path: str | Path) -> dict:
    """The validated marker of a converted directory (raises CheckpointError/ConfigError)."""
    file = Path(path) / MARKER
    try:
        meta = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read it: {e}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file}: expected a JSON object, found {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{file}: 'format' is {meta.get('format')!r}, expected {FORMAT!r}")
    version = meta.get("version")
    if type(version) is int and version in EARLIER_VERSIONS:
        raise FormatVersionError(file, version)
    if type(version) is not int or version != VERSION:
        raise CheckpointError(f"{file}: format version {version!r} is not the one this "
                              f"packed_ss_jax reads ({VERSION}); run `packed-ss convert` on "
                              "the original checkpoint again")
    missing = sorted(_KEYS - set(meta))
    unknown = sorted(set(meta) - _KEYS - _LATER_KEYS)
    if missing or unknown:
        raise CheckpointError(f"{file}: " + "; ".join(
            ([f"missing keys {missing}"] if missing else [])
            + ([f"unknown keys {unknown}"] if unknown else [])))
    raw = meta["config"]
    meta["config"] = _config(raw, file)
    # What `checksums["config"]` is compared with (see `restoring.restore`).
    meta["config_digest"] = config_checksum(raw)
    _check_arrays(meta["arrays"], file)
    files = meta["files"]
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise CheckpointError(f"{file}: 'files' must be a list of relative paths")
    if "checksums" in meta:
        _check_checksums(meta["checksums"], file)
    if "sizes" in meta:
        _check_sizes(meta["sizes"], file)
    return meta


def _check_checksums(sums, file: Path):
    ok = (isinstance(sums, dict) and "config" in sums
          and set(sums) <= {"config", *COVERED_FILES}
          and all(isinstance(v, str) and _HEX64.fullmatch(v) for v in sums.values()))
    if not ok:
        raise CheckpointError(f"{file}: 'checksums' must be {{\"config\": 64 hex digits}} plus "
                              f"any of {list(COVERED_FILES)}, found {sums!r}")


def _check_sizes(sizes, file: Path):
    def ok(rel, n):
        parts = rel.split("/") if isinstance(rel, str) else []
        return (len(parts) > 1 and parts[0] == "params" and ".." not in parts and "" not in parts
                and type(n) is int and n >= 0)

    if not isinstance(sizes, dict) or not all(ok(r, n) for r, n in sizes.items()):
        raise CheckpointError(f"{file}: 'sizes' must map files under params/ to byte counts "
                              f"(ints >= 0), found {sizes!r}"[:400])


def _field_types() -> dict[str, tuple[type, ...]]:
    hints = typing.get_type_hints(ModelConfig)
    out = {}
    for name, hint in hints.items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if all(a in (int, float, str, bool, type(None)) for a in args):
            out[name] = tuple(args) + ((int,) if float in args else ())
    return out


def _config(d, file: Path) -> ModelConfig:
    """ModelConfig from the marker's "config", with each field's JSON type checked."""
    if not isinstance(d, dict):
        raise ConfigError(f"{file}: 'config' must be an object, found {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - set(fields))
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in d]
    if unknown or missing:
        raise ConfigError(f"{file}: config " + "; ".join(
            ([f"is missing the fields {missing}"] if missing else [])
            + ([f"has unknown fields {unknown}"] if unknown else [])))
    for name, allowed in _field_types().items():
        if name not in d:
            continue
        v = d[name]
        # JSON true/false are Python bools, which are also ints: keep them apart.
        ok = (bool in allowed) if isinstance(v, bool) else isinstance(v, allowed)
        if isinstance(v, float) and not math.isfinite(v):
            ok = False
        if not ok:
            want = " or ".join("null" if a is type(None) else a.__name__
                               for a in dict.fromkeys(allowed))
            raise ConfigError(f"{file}: config field {name!r} must be {want}, found {v!r}")
    try:
        config = ModelConfig.from_dict(d)
        check_token_ids(config)
        return config
    except (ConfigError, TypeError, ValueError) as e:
        raise ConfigError(f"{file}: {e}") from None


def _check_arrays(arrays, file: Path):
    if not isinstance(arrays, dict):
        raise CheckpointError(f"{file}: 'arrays' must be an object")
    for name, a in arrays.items():
        ok = (isinstance(a, dict) and set(a) == {"shape", "dtype", "sha256"}
              and isinstance(a["shape"], list)
              and all(type(n) is int and n >= 0 for n in a["shape"])
              and isinstance(a["dtype"], str)
              and isinstance(a["sha256"], str) and _HEX64.fullmatch(a["sha256"]))
        if not ok:
            raise CheckpointError(f"{file}: arrays entry {name!r} must be "
                                  '{"shape": [ints], "dtype": str, "sha256": 64 hex digits}, '
                                  f"found {a!r}")


def specs(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype name) of a params tree (arrays or ShapeDtypeStructs)."""
    return {n: (tuple(int(s) for s in x.shape), dtype_name(x.dtype))
            for n, x in array_names(tree).items()}


def stored_specs(tree) -> tuple[dict[str, tuple[tuple[int, ...], str]], list[str]]:
    """`specs` under stored names, for a tree in either layout: a name held per layer gets
    the stacked shape `[layers, ...]`. Returns the specs and the problems that leave a
    name without one (layers missing from 0 .. n-1, layers of different shapes)."""
    try:
        grouped = _grouped(tree)
    except ValueError as e:
        return {}, [str(e)]
    out, problems = {}, []
    for stored, (layered, leaves) in grouped.items():
        got = {(tuple(int(s) for s in x.shape), dtype_name(x.dtype)) for x in leaves}
        if len(got) > 1:
            problems.append(f"{stored}: its layers differ in shape or dtype: "
                            + ", ".join(f"{list(s)} {d}" for s, d in sorted(got)))
            continue
        shape, dtype = got.pop()
        out[stored] = ((len(leaves),) + shape if layered else shape, dtype)
    return out, problems


def compare(expected: dict, found: dict, what: str) -> list[str]:
    """The differences between two `specs`, one line each."""
    lines = []
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing:
        lines.append(f"missing from {what}: {', '.join(missing)}")
    if extra:
        lines.append(f"in {what} but not in the config: {', '.join(extra)}")
    for n in sorted(set(expected) & set(found)):
        if expected[n] != found[n]:
            (ws, wd), (fs, fd) = expected[n], found[n]
            lines.append(f"{n}: the config gives {list(ws)} {wd}, {what} has {list(fs)} {fd}")
    return lines
