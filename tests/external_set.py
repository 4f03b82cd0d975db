"""Where the independent external reference set is, if anywhere.

The tests run on the project's own fixtures (tests/fixtures); only
tests/test_external_reference.py cross-checks the package against this other set, made
by other code from other seeds. A plain module rather than conftest code, so that a test
module can skip itself at import (one line in the summary instead of one per test).
"""

from __future__ import annotations

import os
from pathlib import Path

MISSING = ("external reference set not found (set PACKED_SS_SHARED or place shared/fixtures "
           "beside the checkout)")


def shared() -> Path | None:
    """The `shared/` folder holding `fixtures/`: $PACKED_SS_SHARED, else a `shared/` beside
    the checkout or one of its parents; None when there is none."""
    env = os.environ.get("PACKED_SS_SHARED")
    if env:
        return Path(env) if (Path(env) / "fixtures").is_dir() else None
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "shared" / "fixtures").is_dir():
            return parent / "shared"
        if (parent.parent / "shared" / "fixtures").is_dir():
            return parent.parent / "shared"
    return None
