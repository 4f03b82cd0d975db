"""Hugging Face checkpoint directory -> converted directory (orbax params + marker)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from . import hub
from .checkpoints import store
from .checkpoints.interrupts import Interrupted, SignalGuard
from .checkpoints.store import DestinationError
from .config import DTYPES, ConfigError
from .loading import TOKENIZER_FILES, hf_config, read_weights

__all__ = ["DestinationError", "Interrupted", "check_destination", "convert"]


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_destination(src: Path, dst: Path, overwrite: bool) -> Path:
    """The absolute, symlink-free output path, or an error when writing it could harm data.

    Refused whatever `overwrite` says: an output equal to, inside or containing the source
    (after resolving symlinks and `..`, and comparing inodes, so bind mounts and links
    count), a symbolic link (it may point anywhere; pass the real directory), an existing
    non-directory. With `overwrite`, an existing directory is replaced only when it is
    empty or an earlier conversion output holding nothing else (`store.replace_refusal`).
    """
    if dst.is_symlink():
        raise DestinationError(f"output {dst} is a symbolic link; give the directory itself")
    try:
        src_real, real = src.resolve(strict=True), dst.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        raise DestinationError(f"cannot resolve {src} or {dst}: {e}") from None
    if real == src_real or any(_same(p, src_real) for p in [real, *real.parents]):
        what = "is" if real == src_real or _same(real, src_real) else "is inside"
        raise DestinationError(f"output {dst} {what} the source checkpoint {src}; "
                               "choose a directory outside it")
    if real in src_real.parents or any(_same(p, real) for p in src_real.parents):
        raise DestinationError(f"output {dst} contains the source checkpoint {src}; "
                               "choose a directory outside it")
    if os.path.lexists(real):
        if not real.is_dir():
            raise DestinationError(f"output {dst} exists and is not a directory")
        if not overwrite:
            raise FileExistsError(
                f"{dst} already exists (pass overwrite=True / --overwrite to replace it)")
        reason = store.replace_refusal(real)
        if reason:
            raise DestinationError(reason)
    return real


def convert(src: str | Path, dst: str | Path, dtype: str = "bfloat16", lora: bool | None = None,
            overwrite: bool = False, progress: bool = True, base_config=None) -> Path:
    """Converts `src` (config.json, safetensors shards, optional linear_spec_lora/; or a
    SetDLM directory with pytorch_model.bin or safetensors; or a Hugging Face hub id
    ORG/NAME[@REVISION] naming one, when no such local directory exists) to `dst`.

    base_config: SetDLM only, the Qwen3 base model's config.json (see `load`).

    The checkpoint is checked against the expected param shapes first; any missing,
    unexpected or misshaped tensor, and any tensor holding NaN/Inf, stops the conversion
    with the full list. The output is built in a hidden sibling of `dst` and appears only
    when complete; `overwrite` replaces an earlier conversion output or an empty directory
    in one atomic swap and nothing else (see `check_destination`).

    SIGINT and SIGTERM raise `Interrupted` (a KeyboardInterrupt) while converting, after
    the hidden directory is removed and any previous output left as it was; a signal
    during the final swap is held until the swap is done. Handlers are installed only
    when called from the main thread, and the previous ones are restored afterwards.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    if hub.is_hub_name(src):   # never a path that exists here
        src = hub.resolve(src)
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"source checkpoint {src} is not a directory")
    real = check_destination(src, dst, overwrite)
    t0 = time.monotonic()
    with SignalGuard() as guard:
        writer = store.Writer(real, overwrite)
        try:
            config = hf_config(src, dtype, lora, base_config)
            writer.begin()
            params = read_weights(src, config, progress=progress)
            guard.check()  # between phases: a signal whose exception was swallowed
            copies = [src / "config.json"] + [src / f for f in TOKENIZER_FILES if (src / f).exists()]
            writer.write(config, params, copies, progress=progress)
            del params  # the Writer is done with it
            guard.check()
            guard.armed = False  # a plain store: no signal can land between it and commit
            with guard.blocked():
                writer.commit()
        except BaseException:
            guard.armed = False  # first statement, before any call a handler could run in
            with guard.blocked():
                writer.abort()
            # Library code may wrap the signal's exception in its own (jax's pytree code
            # turns it into a ValueError), so ask the guard whether a signal fired.
            if guard.fired is not None:
                raise Interrupted(guard.fired, f"nothing was written, {dst} is as it was") from None
            raise
    guard.raise_pending(f"{dst} was written completely before it took effect")
    if progress:
        sys.stderr.write(f"wrote {dst} ({config.dtype}, lora={'on' if config.lora_rank else 'off'}) "
                         f"in {time.monotonic() - t0:.1f}s\n")
    return Path(dst).absolute()
