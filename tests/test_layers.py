"""What the import-linter layers contract (pyproject.toml, run by CI as `lint-imports`)
cannot see: a module of the package importing a private name from another part of it,
or importing the package root (whose __init__ pulls in every layer)."""

import ast
from pathlib import Path

import packed_ss_jax

PACKAGE = Path(packed_ss_jax.__file__).parent


def _imports():
    """(module, imported module, names) for every import in the package, resolved."""
    for file in sorted(PACKAGE.rglob("*.py")):
        rel = file.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        module = ".".join(parts)
        package = parts if file.name == "__init__.py" else parts[:-1]
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                yield module, target, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    yield module, a.name, []


def _part(module: str) -> str:
    """The layer a module belongs to: its first level below the package."""
    return ".".join(module.split(".")[:2])


def test_no_private_names_cross_parts_of_the_package():
    bad = [f"{m}: from {t} import {n}" for m, t, names in _imports()
           if t.startswith("packed_ss_jax.") and _part(t) != _part(m)
           for n in names if n.startswith("_")]
    assert not bad, bad


def test_no_module_imports_the_package_root():
    submodules = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py"} | \
                 {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    bad = [f"{m}: {t} {names}" for m, t, names in _imports()
           if m != "packed_ss_jax" and t == "packed_ss_jax"
           and (not names or any(n not in submodules for n in names))]
    assert not bad, bad
