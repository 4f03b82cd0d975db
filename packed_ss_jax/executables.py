"""Compiled programs kept on disk: a program compiled once is serialized
(`jax.experimental.serialize_executable`), and a later process loads it instead of
tracing, lowering and compiling it again.

Entries live in `executables/` inside the persistent compilation cache (compile_cache.py),
on when it is on; `PACKED_SS_EXECUTABLES=off` turns them off alone (and JAX's own
persistent cache on in their place). A model's programs share one folder, named by a
digest of what they all depend on (this package's code, jax and jaxlib, the backend and
its devices, the model's compile identity, XLA_FLAGS and JAX's settings); an entry in it
is named by a digest of its program's key, its arguments' shapes, dtypes and placements
and the donated ones. `preload` reads a folder's entries on several threads (a server's
startup); `compiled` reads one or compiles and keeps it.

An entry is code: it is read only from a directory the compilation cache would trust,
only if this user owns it and nobody else can write it, and only up to the size bound;
its header must name these versions and this program and its checksum must hold. One that
fails is compiled anew, with one warning line, and replaced. Entries are written to a
temporary file renamed into place, and the least recently used go past the bound
(`PACKED_SS_EXECUTABLES_MAX_BYTES`)."""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import logging
import os
import pickle
import re
import stat
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np

from . import compile_cache

MAX_BYTES_ENV = "PACKED_SS_EXECUTABLES_MAX_BYTES"
DEFAULT_MAX_BYTES = 4 << 30
FORMAT = 1
MAGIC = b"packed_ss_jax executable\n"
SUFFIX = ".pssx"
WARM_SUFFIX = ".warm.json"
_ENTRY = re.compile(r"[0-9a-f]{40}" + re.escape(SUFFIX))
_HEADER_MAX = 1 << 16
_STALE_S = 3600
_VERSIONED = ("format", "jax", "jaxlib", "libraries", "platform", "devices", "package")
# JAX settings that change where programs are kept or what is logged, not the programs.
_NOT_PROGRAM = re.compile(
    r"jax_(compilation_cache_\w+|persistent_cache_\w+|enable_compilation_cache|"
    r"raise_persistent_cache_errors|explain_cache_misses|log_compiles|logging_level|"
    r"debug_log_modules|pprint_use_color|traceback_filtering|traceback_in_locations_limit|"
    r"include_full_tracebacks_in_locations|tracer_error_num_traceback_frames|dump_ir_to|"
    r"dump_ir_modes|include_debug_info_in_dumps|transfer_guard\w*|source_url_schema|"
    r"thread_guard|compiler_detailed_logging_min_ops)")
log = logging.getLogger(__name__)


_hits = threading.local()   # JAX compilation cache hits on this thread


def _count_hit(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _hits.n = getattr(_hits, "n", 0) + 1


jax.monitoring.register_event_listener(_count_hit)


class Unusable(Exception):
    """Why an entry on disk is not loaded (the warning's words)."""


def directory() -> Path | None:
    """Where entries are kept (None: off): `executables/` in the compilation cache, when
    that is on, trusted, and `PACKED_SS_EXECUTABLES` does not turn this off; only in a
    process of its own (several hosts compile together)."""
    cache = compile_cache.ensure()
    if cache is None or not compile_cache.keeps_executables():
        return None
    if jax.process_count() > 1:
        compile_cache.jax_cache_instead()
        return None
    path = cache / "executables"
    try:
        path.mkdir(exist_ok=True, mode=0o700)
    except OSError:
        return None
    return compile_cache.trusted(path)


def max_bytes() -> int:
    value = os.environ.get(MAX_BYTES_ENV, "")
    try:
        return max(int(value), 0) if value else DEFAULT_MAX_BYTES
    except ValueError:
        _warn_once(f"packed_ss_jax: {MAX_BYTES_ENV}={value!r} is not a whole number of "
                   f"bytes; using {DEFAULT_MAX_BYTES}")
        return DEFAULT_MAX_BYTES


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


@functools.cache
def package_digest() -> str:
    """A digest of this package's code: a program compiled by other code is another."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _libraries() -> str:
    """The versions of the libraries a program is traced through besides jax."""
    from importlib import metadata

    def of(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "-"

    return " ".join(f"{name} {of(name)}" for name in ("flax", "numpy", "ml_dtypes", "chex"))


def _versions() -> dict:
    import jaxlib

    device = jax.devices()[0]
    return {"format": FORMAT, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "libraries": _libraries(),
            "platform": f"{device.platform} {device.client.platform_version}",
            "devices": [f"{d.id}:{d.device_kind}" for d in jax.devices()],
            "package": package_digest()}


def _environment(identity) -> str:
    """What every program of a model depends on, as text: the versions, the model's
    compile identity, XLA_FLAGS and JAX's settings."""
    settings = {k: repr(v) for k, v in sorted(jax.config.values.items())
                if not _NOT_PROGRAM.fullmatch(k)}
    return json.dumps({**_versions(), "identity": repr(identity), "settings": settings,
                       "xla_flags": os.environ.get("XLA_FLAGS", "")}, sort_keys=True)


def placed(sharding) -> str:
    """A sharding as text, with the devices it lies on in order (a mesh's text names
    its axes only)."""
    if sharding is None:
        return ""
    mesh = getattr(sharding, "mesh", None)
    devices = (list(mesh.devices.flat) if mesh is not None and hasattr(mesh, "devices")
               else sorted(sharding.device_set, key=lambda d: d.id))
    return f"{sharding} on {[d.id for d in devices]}"


def _leaf(x) -> str:
    return (f"{np.shape(x)}:{getattr(x, 'dtype', type(x).__name__)}:"
            f"{getattr(x, 'weak_type', '')}:{placed(getattr(x, 'sharding', None))}")


def _program(key, args, donate) -> str:
    """What one program is, as text: its key, its arguments' structure, shapes, dtypes and
    placements, and the donated ones."""
    return json.dumps({"key": repr(key), "args": str(jax.tree.structure(args)),
                       "leaves": [_leaf(x) for x in jax.tree.leaves(args)],
                       "donate": list(donate)}, sort_keys=True)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _group(identity) -> tuple[Path, str] | None:
    """The folder of a model's programs in this environment, and the environment's text
    (None: off)."""
    where = None if identity is None else directory()
    if where is None:
        return None
    environment = _environment(identity)
    group = where / _digest(environment)[:32]
    try:
        group.mkdir(exist_ok=True, mode=0o700)
    except OSError:
        return None
    group = compile_cache.trusted(group)
    return None if group is None else (group, environment)


def compiled(identity, key, fn, args, donate=()):
    """`fn` compiled for `args`: loaded from disk when kept there, else lowered, compiled
    and kept. `identity`, `key`: what the program is (`identity` None: not kept). Returns
    the executable and the name of its entry (None: none on disk)."""
    group = _group(identity)
    exe = path = None
    if group is not None:
        program = _program(key, args, donate)
        path = group[0] / (_digest(program)[:40] + SUFFIX)
        exe = _load(path, group[1], program)
    if exe is not None:
        return exe, path.name
    hits = getattr(_hits, "n", 0)
    exe = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    # One read back from JAX's own cache cannot be serialized again on every backend (on
    # CPU its functions are missing when loaded): kept only when compiled here.
    if path is not None and getattr(_hits, "n", 0) == hits \
            and _store(path, group[1], program, key, exe):
        return exe, path.name
    return exe, None


def preload(identity, hold, limit: int, names=None, workers: int | None = None) -> int:
    """Loads the programs kept for `identity`: the entries `names` (None: every one), at
    most the `limit` most recently used, on `workers` threads (default one per core),
    handing each to `hold(key, exe, name)`; returns how many. An unusable entry is
    skipped with one warning line (compiled anew when asked for)."""
    group = _group(identity)
    if group is None or limit <= 0:
        return 0
    entries = (group[0].glob("[!.]*" + SUFFIX) if names is None else
               [group[0] / n for n in names if _ENTRY.fullmatch(n)])
    entries = sorted(entries, key=_mtime, reverse=True)[:limit]
    with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        loaded = [(p.name, x) for p, x in zip(entries, pool.map(
            lambda p: _load(p, group[1]), entries)) if x]
    held = set()
    for name, (key, exe) in loaded:   # newest first: an older entry of a key is stale
        if key not in held:
            held.add(key)
            hold(key, exe, name)
    return len(held)


def remember(identity, label: str, entries: dict[str, str | None]) -> None:
    """Notes which programs a warm-up of `label` asked for: their keys' text, each with
    the name of its entry (None: not kept)."""
    group = _group(identity)
    if group is not None:
        try:
            _write(group[0] / (_digest(label)[:40] + WARM_SUFFIX),
                   json.dumps(entries, sort_keys=True).encode())
        except OSError as e:
            _warn_once(f"packed_ss_jax: cannot note a warm-up in {group[0]} "
                       f"({e.strerror or e})")


def recall(identity, label: str) -> dict[str, str | None] | None:
    """What `remember` noted for `label` (None: nothing, or a note this user does not
    own alone). A note names what to read and whether a warm-up must run; an entry it
    names is read with every check an entry gets."""
    group = _group(identity)
    if group is None:
        return None
    path = group[0] / (_digest(label)[:40] + WARM_SUFFIX)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            _check_owner(os.fstat(f.fileno()))
            entries = json.loads(f.read(_HEADER_MAX * 16))
        except (Unusable, ValueError, OSError, RecursionError):
            return None
    ok = isinstance(entries, dict) and all(
        isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in entries.items())
    return entries if ok else None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _load(path: Path, environment: str, program: str | None = None):
    """The program in `path` (with `program` given, that one's executable; else its
    (key, executable)), or None: none there, or unusable (then one warning line)."""
    try:
        key, exe = _read(path, environment, program)
    except FileNotFoundError:
        return None
    except Unusable as e:
        log.warning(f"packed_ss_jax: compiled program {path} not used ({e}); "
                    "compiling it anew")
        return None
    try:
        os.utime(path)   # most recently used: the last to go past the bound
    except OSError:
        pass
    return exe if program is not None else (key, exe)


def _read(path: Path, environment: str, program: str | None):
    """(key, executable) in `path`, if its owner, size, header (made in `environment`,
    for `program` when given) and checksum allow (else Unusable)."""
    from jax.experimental import serialize_executable

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise Unusable(f"cannot be opened: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "rb") as f:
            header, payload = _contents(f, environment, program)
    except OSError as e:
        raise Unusable(f"cannot be read: {e.strerror or e}") from None
    if len(payload) != header["bytes"] or hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise Unusable("truncated or damaged: its checksum does not match")
    try:
        key, blob, in_tree, out_tree = pickle.loads(payload)
        return key, serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
    except Exception as e:   # anything a stale executable can raise when loaded
        raise Unusable(f"failed to load: {type(e).__name__}: {e}"[:300]) from None


def _contents(f, environment: str, program: str | None) -> tuple[dict, bytes]:
    """An open entry's checked header and its payload."""
    info = os.fstat(f.fileno())
    _check_owner(info)
    if info.st_size > max_bytes():
        raise Unusable(f"{info.st_size} bytes, over the bound of {max_bytes()}")
    if f.readline(len(MAGIC) + 1) != MAGIC:
        raise Unusable("not an entry of this kind")
    try:
        header = json.loads(f.readline(_HEADER_MAX))
        _check_header(header, environment, program)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise Unusable(f"damaged header: {e}"[:300]) from None
    return header, f.read()


def _check_owner(info: os.stat_result) -> None:
    if (problem := compile_cache.file_problem(info)) is not None:
        raise Unusable(problem)


def _check_header(header: dict, environment: str, program: str | None) -> None:
    want = json.loads(environment)
    for field in _VERSIONED:
        if header[field] != want[field]:
            raise Unusable(f"made with {field} {header[field]!r}, this process has "
                           f"{want[field]!r}")
    if header["environment"] != _digest(environment) or (
            program is not None and header["program"] != _digest(program)):
        raise Unusable("made for another program")
    if not isinstance(header["bytes"], int) or not isinstance(header["sha256"], str):
        raise ValueError("no size or checksum")


def _store(path: Path, environment: str, program: str, key, exe) -> bool:
    """Keeps `exe` at `path`; False when the backend cannot serialize it, or when it would
    not fit the bound."""
    from jax.experimental import serialize_executable

    try:
        payload = pickle.dumps((key, *serialize_executable.serialize(exe)))
    except Exception as e:   # a backend or program that cannot be serialized
        log.debug("packed_ss_jax: %s not kept on disk: %s", key, e)
        compile_cache.jax_cache_instead()
        return False
    want = json.loads(environment)
    header = {field: want[field] for field in _VERSIONED}
    header.update(environment=_digest(environment), program=_digest(program),
                  bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    data = MAGIC + json.dumps(header).encode() + b"\n" + payload
    if len(data) > max_bytes():
        return False
    try:
        _write(path, data)
        _bound(path.parent.parent, max_bytes())
    except OSError as e:   # a full disk, a read-only cache: the program runs, unkept
        _warn_once(f"packed_ss_jax: compiled programs cannot be kept in {path.parent} "
                   f"({e.strerror or e}); compiling them in every process")
        return False
    return True


def _write(path: Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all: a temporary file renamed into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _bound(where: Path, limit: int) -> None:
    """Removes this module's least recently used entries until they fit `limit`, and
    temporary files a killed process left (an hour old: a live writer's are newer)."""
    entries, now = [], time.time()
    for path in where.glob("*/*" + SUFFIX):
        try:
            info = path.lstat()
        except OSError:
            continue
        if not stat.S_ISREG(info.st_mode):
            continue
        if path.name.startswith(".tmp-"):
            if now - info.st_mtime > _STALE_S:
                path.unlink(missing_ok=True)
            continue
        entries.append((info.st_mtime, info.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        try:
            path.unlink()
            total -= size
        except OSError:
            pass
