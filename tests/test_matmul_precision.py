"""`load(..., matmul_precision=)`: the option reaches every matmul of the decode program."""

import jax
import pytest

import packed_ss_jax as ps
from packed_ss_jax import inspection
from packed_ss_jax.config import ConfigError


def _dot_precisions(model):
    engine = ps.Engine.of(model)
    request = engine.request([5, 6, 7], ps.DecodeOptions(schedule="ar", max_new_tokens=4))
    text = inspection.lower(engine, request).as_text()
    return {line.split("precision = [")[1].split("]")[0] if "precision = [" in line else None
            for line in text.splitlines() if "stablehlo.dot_general" in line}


def test_highest_reaches_every_matmul():
    # The suite runs under default_matmul_precision("highest"); a user's process does not.
    with jax.default_matmul_precision("default"):
        default = _dot_precisions(ps.load())
        highest = _dot_precisions(ps.load(matmul_precision="highest"))
    assert highest == {"HIGHEST, HIGHEST"}, highest  # attention products included
    assert "HIGHEST, HIGHEST" not in default, default


def test_unknown_precision_is_refused():
    with pytest.raises(ConfigError, match="unknown matmul_precision 'tf32'"):
        ps.load(matmul_precision="tf32")
