"""The golden decodes of the fixture models (see test_golden.py, which checks the
embedded models' and the file itself)."""

import pytest

from test_golden import check, models, params  # noqa: F401  (models: the fixture it uses)
from tools import golden

FIXTURES = [c for c in golden.CASES if c.model not in golden.EMBEDDED]


@pytest.mark.parametrize("case", params(FIXTURES))
def test_fixture_decode_matches_golden(case, models):  # noqa: F811
    check(case, models)
