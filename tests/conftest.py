import os
from pathlib import Path

import jax
import numpy as np
import pytest

# Parity needs true float32 products (TF32/bf16 passes move the fixture logits by ~1e-3).
jax.config.update("jax_default_matmul_precision", "highest")
# Programs compile in every test process (the compile-count tests count them); the
# persistent cache has its own test, with its own directory.
os.environ["PACKED_SS_COMPILE_CACHE"] = "off"


# The project's own fixture set, written by `python -m tools.make_fixtures --out tests/fixtures`.
# (The independent external set is found by tests/external_set.py, for
# tests/test_external_reference.py only.)
FIXTURES = Path(__file__).resolve().parent / "fixtures"
NEMOTRON = FIXTURES / "nemotron_tiny"


def _fixture_dir(path: Path) -> Path:
    if not path.is_dir():
        pytest.fail(f"fixture checkpoint not found at {path} "
                    "(regenerate: python -m tools.make_fixtures --out tests/fixtures)")
    return path


@pytest.fixture(scope="session")
def nemotron_dir() -> Path:
    return _fixture_dir(NEMOTRON)


@pytest.fixture(scope="session")
def nemotron_ref(nemotron_dir):
    return dict(np.load(nemotron_dir / "reference.npz"))


@pytest.fixture(scope="session")
def nemotron(nemotron_dir):
    import packed_ss_jax as ps

    return ps.load(nemotron_dir, lora=False)


@pytest.fixture(scope="session")
def nemotron_lora(nemotron_dir):
    import packed_ss_jax as ps

    return ps.load(nemotron_dir)


SETDLM = FIXTURES / "setdlm_tiny"
SETDLM_SAFETENSORS = FIXTURES / "setdlm_tiny_safetensors"


@pytest.fixture(scope="session")
def setdlm_dir() -> Path:
    return _fixture_dir(SETDLM)


@pytest.fixture(scope="session")
def setdlm_safetensors_dir() -> Path:
    return _fixture_dir(SETDLM_SAFETENSORS)


@pytest.fixture(scope="session")
def setdlm_ref(setdlm_dir):
    return dict(np.load(setdlm_dir / "reference.npz"))


@pytest.fixture(scope="session")
def setdlm(setdlm_dir):
    import packed_ss_jax as ps

    return ps.load(setdlm_dir)
