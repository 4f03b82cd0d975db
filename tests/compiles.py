"""The decode programs compiled while a test runs, whichever model they are for: every
engine (one per model object, the ones a command line or a server loads included)
compiles through `Engine.compile`."""

from __future__ import annotations

from packed_ss_jax import Engine


def record(monkeypatch) -> list:
    """The keys of the programs any engine compiles from now on (until `monkeypatch` is
    undone), in order; a program already compiled, asked for again, is not listed."""
    keys = []
    real = Engine.compile

    def compile(self, name, fn, *args, **kwargs):
        if name not in self.executables():
            keys.append(name)
        return real(self, name, fn, *args, **kwargs)

    monkeypatch.setattr(Engine, "compile", compile)
    return keys
