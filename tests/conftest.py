import os
from pathlib import Path

# Compiling is most of the suite's time, and two code-generation settings more than halve
# each compile (docs/testing.md): LLVM's unoptimised code generation, and XLA's CPU loop
# emitters instead of its fusion emitters. The second also moves XLA's fusion decisions,
# so the tests that read a compiled program's HLO compile as a user's process does
# (`user_codegen`). Set before JAX starts its backend, and inherited by the processes the
# tests start.
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                 "--xla_backend_optimization_level=0",
                                                 "--xla_cpu_use_fusion_emitters=false"]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Parity needs true float32 products (TF32/bf16 passes move the fixture logits by ~1e-3).
jax.config.update("jax_default_matmul_precision", "highest")
# Nothing from a user's persistent compilation cache: `run_compile_cache` gives the run one
# of its own.
os.environ["PACKED_SS_COMPILE_CACHE"] = "off"
# Nor programs kept on disk (executables.py): a test that patches a function a program
# calls must get the program it patched. tests/test_executables.py turns them on, and
# tests/servers.py for the servers it starts.
os.environ["PACKED_SS_EXECUTABLES"] = "off"


# The project's own fixture set, written by `python -m tools.fixtures --out tests/fixtures`.
# (The independent external set is found by tests/external_set.py, for
# tests/test_external_reference.py only.)
FIXTURES = Path(__file__).resolve().parent / "fixtures"
NEMOTRON = FIXTURES / "nemotron_tiny"


def _fixture_dir(path: Path) -> Path:
    if not path.is_dir():
        pytest.fail(f"fixture checkpoint not found at {path} "
                    "(regenerate: python -m tools.fixtures --out tests/fixtures)")
    return path


@pytest.fixture(scope="session", autouse=True)
def run_compile_cache(tmp_path_factory):
    """One persistent compilation cache for the whole run, new with it: this process, the
    processes it starts (command lines, servers) and pytest-xdist's other workers read a
    program back from it instead of compiling it again. Every run still compiles each
    distinct program once, as a user's first run does. Tests that count compiles turn it
    off around themselves (`no_compile_cache`)."""
    from packed_ss_jax import compile_cache

    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "xla-cache"
    # Small programs too: the tiny models' programs compile in about a second each.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["PACKED_SS_COMPILE_CACHE"] = str(path)
    compile_cache.set_compile_cache(path)
    # Schedule auto's calibrations (cost.py, planner.py) go to the run's folder too, never
    # to the user's.
    os.environ["PACKED_SS_COST_DIR"] = str(path.parent / "cost")
    yield path


@pytest.fixture(scope="module", autouse=True)
def programs_per_module():
    """Each test module starts with no compiled program held: a test that lists an
    engine's programs sees its own module's only. The next module reads a program it
    shares from the run's persistent cache."""
    yield
    from packed_ss_jax import programs

    programs.clear_programs()


@pytest.fixture
def user_codegen(monkeypatch):
    """Every program compiled during the test is compiled with a user's code generation
    (hlo.USER_CODEGEN), so the HLO a structure test reads is the one users run. Programs
    held from before are let go first, so that none compiled otherwise is read."""
    from hlo import USER_CODEGEN
    from packed_ss_jax import programs

    programs.clear_programs()
    compile = jax.stages.Lowered.compile

    def as_users(self, compiler_options=None, **kwargs):
        return compile(self, {**USER_CODEGEN, **(compiler_options or {})}, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", as_users)
    yield
    programs.clear_programs()


@pytest.fixture
def no_compile_cache(run_compile_cache):
    """No persistent cache during one test (for tests that count compiles)."""
    from packed_ss_jax import compile_cache

    compile_cache.set_compile_cache(None)
    yield
    compile_cache.set_compile_cache(run_compile_cache)


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


def pytest_addoption(parser):
    parser.addoption("--long-checks", action="store_true",
                     help="also run the long checks (marked long_check): every golden "
                          "decode (tools/golden.py; the suite runs golden.SUITE), the "
                          "docs' recipes of saved runs and trained models, and tests/slow.py's "
                          "LONG matrices")


def pytest_collection_modifyitems(config, items):
    import slow

    slow.mark(items)
    # On a whole-suite collection (no paths given), a slow-list entry naming no test is a
    # stale entry.
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        stale = slow.unknown(items)
        if stale:
            raise pytest.UsageError(f"tests/slow.py names tests that do not exist: {stale}")
    if not config.getoption("long_checks"):
        long = [i for i in items if i.get_closest_marker("long_check")]
        if long:
            config.hook.pytest_deselected(items=long)
            items[:] = [i for i in items if not i.get_closest_marker("long_check")]
