"""The persistent compilation cache: compiled decode programs outlive the process.

A decode program of a real-size model takes tens of seconds to a few minutes to compile;
with JAX's persistent cache, a second process loads it from disk instead. It is on by
default, in a per-user directory (`$XDG_CACHE_HOME/packed_ss_jax/xla`, else
`~/.cache/packed_ss_jax/xla`, created private to the user: JAX treats cache entries as
trusted code). `PACKED_SS_COMPILE_CACHE=off` turns it off and `PACKED_SS_COMPILE_CACHE=DIR`
moves it; `set_compile_cache(path | None)` (CLI: `--compile-cache DIR|off`) does either
for the process and wins over the environment. A cache directory the user configured in
JAX itself (`jax_compilation_cache_dir`) is left as it is.

It is JAX's cache, so it covers every program of the process, the user's own included.
JAX stores only programs that took at least `jax_persistent_cache_min_compile_time_secs`
(1 s by default) to compile.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

ENV = "PACKED_SS_COMPILE_CACHE"
OFF = ("", "0", "off", "none", "false", "no")

_state = {"configured": False, "explicit": None, "dir": None}


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "packed_ss_jax" / "xla"


def set_compile_cache(path: str | os.PathLike | None) -> Path | None:
    """Use `path` as the persistent compilation cache (None: no persistent cache) for
    the rest of the process; returns the directory in use."""
    _state["explicit"] = "off" if path is None else os.fspath(path)
    _state["configured"] = False
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
    jax_cache.set_cache_dir(None if path is None else str(path))
    # JAX decides once per process whether it uses the cache, at its first compile, which
    # may have happened before (loading a model compiles small programs): ask again.
    jax_cache.reset_cache()
    _state["dir"] = path
    return path
