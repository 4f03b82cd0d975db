"""Every golden case (tools/golden.py) decodes today as it is pinned in
tests/golden/decodes.json: the same tokens, NFE, iterations, acceptance histogram, finish
reason, text and stop position. The file was written before the engine refactor; a change
in it must be explained (see tools/golden.py).

The cases of one model run one after another on one loaded model, so that they share its
compiled programs. The suite runs the cases in `golden.SUITE` (Packed-SS greedy and sampled
on every model, and every kind of call on the embedded models); the whole matrix (every
schedule, sampler, width, stop, batch, stream and queue of every model) runs with the
long checks:

    python -m pytest -q --long-checks -m long_check tests/test_golden.py tests/test_golden_fixtures.py

The quick loop keeps a greedy and a sampled Packed-SS decode on each family's embedded
model (tests/slow.py)."""

import jax
import pytest

from tools import golden

GOLDEN = golden.read() if golden.GOLDEN.is_file() else {"cases": {}}


@pytest.fixture(scope="module")
def models():
    """One loaded model at a time, kept while its cases run (they are grouped by model)."""
    held: dict = {}

    def get(name):
        if name not in held:
            held.clear()
            held[name] = golden.load(name)
        return held[name]

    yield get
    held.clear()
    golden.release()  # the last model's programs go before the next file's tests


def test_golden_file_has_every_case():
    assert golden.GOLDEN.is_file(), ("tests/golden/decodes.json is missing "
                                     "(python -m tools.golden --write)")
    stored = GOLDEN["cases"]
    ids = [c.id for c in golden.CASES]
    assert list(stored) == ids, (
        f"the golden file's cases are not tools/golden.py's: missing "
        f"{sorted(set(ids) - set(stored))}, extra {sorted(set(stored) - set(ids))}")
    changed = [c.id for c in golden.CASES if stored[c.id]["input"] != c.describe()]
    assert not changed, f"cases whose inputs differ from the golden file's: {changed}"


# The embedded models' cases here, the fixtures' in test_golden_fixtures.py: two files,
# so that two workers share them.
EMBEDDED = [c for c in golden.CASES if c.model in golden.EMBEDDED]


def params(cases) -> list:
    """`cases` as test parameters, those outside `golden.SUITE` marked `long_check`
    (deselected unless --long-checks is given: tests/conftest.py)."""
    return [pytest.param(c, id=c.id, marks=() if c.id in golden.SUITE
                         else pytest.mark.long_check) for c in cases]


@pytest.mark.parametrize("case", params(EMBEDDED))
def test_decode_matches_golden(case, models):
    check(case, models)


def check(case, models) -> None:
    """Decodes `case` and compares it with its golden record."""
    if jax.default_backend() != "cpu":
        pytest.skip("the golden decodes are the CPU's float32 results")
    stored = GOLDEN["cases"].get(case.id)
    if stored is None:
        pytest.fail(f"{case.id}: not in tests/golden/decodes.json")
    if stored["input"] != case.describe():
        pytest.fail(f"{case.id}: its inputs differ from the golden file's")
    got = golden.run(case, models(case.model))
    diff = golden.first_difference(stored["output"], got)
    assert diff is None, f"{case.id}: {diff}"
