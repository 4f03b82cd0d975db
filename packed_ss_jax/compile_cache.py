"""The persistent compilation cache: compiled decode programs outlive the process.

One per-user directory, on by default. In it, programs are kept whole (executables.py): a
later process loads them, skipping tracing, lowering and XLA's compile. With
`PACKED_SS_EXECUTABLES=off`, JAX's persistent cache is used there instead (XLA's compile
saved, tracing and lowering paid by every process; it stores programs that took
`jax_persistent_cache_min_compile_time_secs` or more).
`PACKED_SS_COMPILE_CACHE=off|DIR` or `set_compile_cache(path | None)` (CLI:
`--compile-cache`) turns it off or moves it; a cache directory configured in JAX itself is
left as it is. Whoever can write to the cache can put code in every later process, so a
directory is used only if it is this user's own and nobody else can write to it or swap
it (`_distrust`); otherwise the process compiles without it, with one warning. Where it
lives and what it saves: docs/api.md."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

ENV = "PACKED_SS_COMPILE_CACHE"
EXECUTABLES_ENV = "PACKED_SS_EXECUTABLES"
OFF = ("", "0", "off", "none", "false", "no")

_state = {"configured": False, "explicit": None, "dir": None}
_warned: set[tuple[str, str]] = set()  # (what, directory) refused: one warning each
log = logging.getLogger(__name__)


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "packed_ss_jax" / "xla"


def set_compile_cache(path: str | os.PathLike | None) -> Path | None:
    """Use `path` as the persistent compilation cache (None: no persistent cache) for
    the rest of the process; returns the directory in use."""
    _state["explicit"] = "off" if path is None else os.fspath(path)
    _state["configured"] = False
    _state["jax_cache"] = False
    return ensure()


def ensure() -> Path | None:
    """Configures the cache once per process, before the first decode compile; returns
    the directory in use (None when off)."""
    if _state["configured"]:
        return _state["dir"]
    _state["configured"] = True
    choice = _state["explicit"] if _state["explicit"] is not None else os.environ.get(ENV)
    if choice is None and jax.config.jax_compilation_cache_dir:
        _state["dir"] = Path(jax.config.jax_compilation_cache_dir)  # the user's own choice
        return _state["dir"]
    if choice is not None and choice.strip().lower() in OFF:
        path = None
    else:
        path = Path(choice).expanduser() if choice is not None else default_dir()
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError:
            path = None  # an unwritable place: compile as if there were no cache
        else:
            path = trusted(path)
    # Programs kept whole (executables.py) make JAX's cache of XLA's output redundant for
    # them, and a program read back from it cannot be kept whole again on every backend.
    jax_cache.set_cache_dir(None if path is None or keeps_executables() else str(path))
    # JAX decides once per process whether it uses the cache, at its first compile, which
    # may have happened before (loading a model compiles small programs): ask again.
    jax_cache.reset_cache()
    _state["dir"] = path
    return path


def jax_cache_instead() -> None:
    """JAX's persistent cache in the cache directory after all: for a process whose
    programs cannot be kept whole (several hosts, a backend that cannot serialize)."""
    if _state["dir"] is not None and not _state.get("jax_cache"):
        _state["jax_cache"] = True
        jax_cache.set_cache_dir(str(_state["dir"]))
        jax_cache.reset_cache()


def keeps_executables() -> bool:
    """Whether compiled programs are kept whole in the cache directory (executables.py),
    unless `PACKED_SS_EXECUTABLES` turns that off (JAX's own cache is used instead)."""
    value = os.environ.get(EXECUTABLES_ENV)
    return value is None or value.strip().lower() not in OFF


def trusted(path: Path, what: str = "the compile cache",
            choose: str = f"--compile-cache or ${ENV}",
            instead: str = "compiling without it") -> Path | None:
    """`path`'s real directory if it may hold compiled programs (or other files this
    process acts on: `what`, chosen with `choose`; without it, `instead`), else None
    (with one warning). JAX gets the real directory, so a symbolic link swapped later
    does not move this process's cache."""
    try:
        real = Path(os.path.realpath(path))
        problem = _distrust(real)
    except OSError as e:
        problem = f"cannot be checked ({e.strerror or e})", None
    if problem is None:
        return real
    if (what, str(path)) not in _warned:
        _warned.add((what, str(path)))
        problem_text, fix = problem
        other = f"choose {'another' if fix else 'a'} directory of your own with {choose}"
        log.warning(f"packed_ss_jax: not using {what} {str(path)!r}: it {problem_text} "
                    f"(fix: {f'{fix}, or {other}' if fix else other}); {instead}")
    return None


def file_problem(info: os.stat_result) -> str | None:
    """Why a file (its `os.fstat`) in a trusted directory must not be acted on: not a
    regular file, another user's, or writable by others than its owner; None if it may."""
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        return f"owned by user {info.st_uid}, not by this user"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "writable by group or others"
    return None


def _distrust(real: Path) -> tuple[str, str | None] | None:
    """Why the directory `real` (symbolic links resolved) must not hold compiled programs,
    and the fix (None: another directory); None if it may."""
    if not hasattr(os, "geteuid"):  # no POSIX owners and modes to check
        return None
    try:
        str(real).encode("utf-8")
    except UnicodeEncodeError:  # JAX takes the directory as UTF-8 text
        return "is not a UTF-8 path", None
    info, me = real.stat(), os.geteuid()
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory", None
    if info.st_uid != me:
        return f"is owned by user {info.st_uid}, not by this user ({me})", None
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "is writable by group or others", f"chmod go-w {real}"
    # Whoever can write to a parent (its owner, or its group or everyone when it allows)
    # can rename the directory and put their own in its place, unless the parent is
    # sticky (as /tmp is): every parent must be this user's or root's.
    for parent in real.parents:
        pinfo = parent.stat()
        if pinfo.st_uid not in (me, 0):
            return f"is inside {parent}, owned by user {pinfo.st_uid}", None
        if pinfo.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not pinfo.st_mode & stat.S_ISVTX:
            return (f"is inside {parent}, which group or others can write to",
                    f"chmod go-w {parent}")
    return None
