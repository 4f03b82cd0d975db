"""Directory renames that never leave the destination missing or half-replaced.

Linux's renameat2(2) swaps two directories in one step (RENAME_EXCHANGE) and renames
without replacing (RENAME_NOREPLACE); the standard library has no binding, so it is
called through ctypes. Where the kernel, libc or file system lacks it, replacing falls
back to two renames (destination aside, new one in), which leaves a moment without the
destination; callers hold signals across it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import uuid
from pathlib import Path

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


@functools.cache
def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28 / not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _call(src: Path, dst: Path, flags: int) -> bool:
    """True when renameat2 did it, False when it is unavailable here; raises OSError else."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(dst))


def rename_new(src: Path, dst: Path):
    """Renames `src` to `dst`, which must not exist (an empty directory may be replaced
    where RENAME_NOREPLACE is unavailable, as plain rename(2) does)."""
    if not _call(src, dst, _RENAME_NOREPLACE):
        os.rename(src, dst)


def replace(new: Path, dst: Path) -> Path:
    """Puts directory `new` at `dst` and returns where the previous `dst` now is (a hidden
    sibling for the caller to delete)."""
    if _call(new, dst, _RENAME_EXCHANGE):
        return new  # the two swapped: `new` now names the previous directory
    old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex}"
    os.rename(dst, old)
    try:
        os.rename(new, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    return old
