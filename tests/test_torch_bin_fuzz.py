"""2,000 fuzzed `.bin` files from the fixture: each is refused or read inside its storages.

The generator and the independent check live in `tools/fuzz_torch_bin.py`, which
also runs the long version (`python -m tools.fuzz_torch_bin --cases 100000`).
"""

import pytest

from tools import fuzz_torch_bin as fuzz

CASES = 2000


@pytest.fixture(scope="module")
def base(setdlm_dir):
    return fuzz.Base((setdlm_dir / "pytorch_model.bin").read_bytes())


def test_fuzzed_files_are_refused_or_read_inside_their_storages(base, tmp_path):
    s = fuzz.run(base, seed=0, cases=range(CASES), workdir=tmp_path, limit_s=10.0)
    assert not s.failures, s.line() + "\n" + "\n".join(
        f"case {i} ({m}): {d}" for i, m, d in s.failures[:10])
    # Both ends are exercised, by every kind of mutation.
    assert s.cases == CASES and s.refused > CASES // 2 and s.loaded > CASES // 10
    assert {m for m, _ in s.by_mutation} == set(fuzz.MUTATIONS)
    assert s.by_mutation[("after_record", "refused")] > 100  # BUILD & co. on a fresh record
    assert s.by_mutation[("valid", "loaded")] > 50


def test_cases_are_reproducible(base, tmp_path):
    a = [fuzz.make_case(base, 3, i, str(tmp_path)) for i in range(20)]
    assert a == [fuzz.make_case(base, 3, i, str(tmp_path)) for i in range(20)]
    assert len({blob for _, blob in a}) == 20
