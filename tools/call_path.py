"""The host path of one decode and of one server request, function by function: which of
the package's modules each call crosses into, and whether any call goes back up the
import layers (pyproject.toml's layers contract).

    python -m tools.call_path            # both paths, on the embedded nld-tiny

Each path is traced warm (its programs compiled by a first run), with `sys.setprofile`
on every thread, so only host work shows: the calls from one module of `packed_ss_jax`
into another. A boundary is a (caller module, callee module) pair; the report lists the
path's calls in order, the distinct boundaries, and the calls that go up the layers.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import tomllib
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "packed_ss_jax"


def _layers() -> dict[str, int]:
    """Module -> its layer's depth in the layers contract (0 at the top)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers"
                  and "containers" not in c)["layers"]
    return {name.strip(): depth for depth, line in enumerate(layers)
            for name in line.split("|")}


def _layer_of(module: str, layers: dict[str, int]) -> int | None:
    while module:
        if module in layers:
            return layers[module]
        module = module.rpartition(".")[0]
    return None


def _properties() -> set:
    """The code of every property getter of the package's classes: reading a field of a
    value passed down (a request's program's width) is data, not a call into its module."""
    import importlib
    import pkgutil

    import packed_ss_jax

    codes = set()
    for info in pkgutil.walk_packages(packed_ss_jax.__path__, PACKAGE + "."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:   # a module needing an optional extra
            continue
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == module.__name__:
                codes.update(p.fget.__code__ for p in vars(value).values()
                             if isinstance(p, property) and p.fget is not None)
    return codes


class Trace:
    """Every call from one package module into another, on every thread, in order; not
    counted: property getters and the methods dataclasses generate (`__init__`,
    `__eq__`, `__hash__`: made from a string, they have no file)."""

    def __init__(self):
        self.calls: list[tuple[str, str, str]] = []   # (caller module, callee module, function)
        self.skip = _properties()

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code in self.skip or code.co_filename.startswith("<"):
            return
        callee = frame.f_globals.get("__name__", "")
        back = frame.f_back
        caller = back.f_globals.get("__name__", "") if back is not None else ""
        if (callee.startswith(PACKAGE) and caller.startswith(PACKAGE) and callee != caller):
            self.calls.append((caller, callee, frame.f_code.co_qualname))

    def __enter__(self):
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)


def report(name: str, trace: Trace) -> dict:
    layers = _layers()
    edges = list(dict.fromkeys((a, b) for a, b, _ in trace.calls))
    crossings = list(dict.fromkeys(trace.calls))
    up = [(a, b) for a, b in edges
          if None not in (_layer_of(a, layers), _layer_of(b, layers))
          and _layer_of(b, layers) < _layer_of(a, layers)]
    modules = sorted({m for e in edges for m in e})
    print(f"## {name}\n")
    print(f"{len(crossings)} boundary crossings (distinct calls from one module into a "
          f"function of another), {len(edges)} module pairs, {len(trace.calls)} calls in "
          f"all, {len(modules)} modules; calls up the layers: {len(up)}\n")
    for a, b, fn in crossings:
        print(f"- {a.removeprefix(PACKAGE + '.')} -> {b.removeprefix(PACKAGE + '.')}.{fn}")
    for a, b in up:
        print(f"  UP: {a} -> {b}")
    print()
    return {"crossings": len(crossings), "pairs": len(edges), "calls": len(trace.calls),
            "modules": modules, "up": up, "path": crossings}


def decode_path(model) -> Trace:
    import packed_ss_jax as ps

    ps.decode(model, "12+34=", max_new_tokens=8)   # compiled outside the trace
    with Trace() as trace:
        ps.decode(model, "12+34=", max_new_tokens=8)
    return trace


def server_path(model) -> Trace:
    """One request through a server on a thread of this process. A profile reaches only
    the threads started after it is set, so the trace runs from before the server starts
    and keeps the second request's calls."""
    import uvicorn

    from packed_ss_jax.server import bind, create_app

    with Trace() as trace:
        app = create_app(model, "nld-tiny", max_model_len=64, slots=2)
        sock = bind("127.0.0.1", 0)
        server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]),
                                  daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
        body = json.dumps({"model": "nld-tiny", "prompt": "12+34=", "max_tokens": 8,
                           "temperature": 0}).encode()

        def ask():
            request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as reply:
                return json.load(reply)

        try:
            while not server.started:
                threading.Event().wait(0.01)
            ask()   # the first request warms what the startup did not
            mark = len(trace.calls)
            ask()
            end = len(trace.calls)   # not the shutdown's
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            sock.close()
    trace.calls = trace.calls[mark:end]
    return trace


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.call_path", description=__doc__)
    p.add_argument("--json", help="also write the counts to this file")
    args = p.parse_args(argv)
    import packed_ss_jax as ps

    model = ps.load("nld-tiny")
    out = {"decode": report("ps.decode of one prompt", decode_path(model)),
           "server": report("one /v1/completions request", server_path(model))}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
