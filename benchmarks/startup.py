"""How fast a new process is ready: `packed-ss serve` from launch to its first `/health`
200 (and its own "ready in" line), and a first `ps.decode` in a new process (the model
load, then the decode with its compile). Each is measured cold (an empty cache
directory), warm with the programs kept whole on disk (executables.py, the default), and
warm with JAX's cache of XLA's output only (`PACKED_SS_EXECUTABLES=off`, tracing and
lowering paid again). Every measurement is a new process; medians of `--repeat`.

    python -m benchmarks.startup                                   # embedded nld-tiny
    python -m benchmarks.startup --repeat 1 --max-model-len 128    # for a check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# --modes: (the table's words, PACKED_SS_EXECUTABLES; None: cold, from an empty cache)
MODES = {"cold": ("cold", None), "disk": ("warm, programs on disk", "on"),
         "xla": ("warm, XLA cache only", "off")}

# The first decode of a new process, timed inside it: its imports, the model load, and
# the decode (its `compile_s`: compiling or reading its program).
DECODE = """
import json, sys, time
t0 = time.perf_counter()
import packed_ss_jax as ps
t1 = time.perf_counter()
model = ps.load(sys.argv[1] if len(sys.argv) > 1 else None)
t2 = time.perf_counter()
r = ps.decode(model, "Question: Ava has 12 apples. How many apples does Ava have?",
              schedule="packed", max_new_tokens=32)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "decode_s": t3 - t2,
                  "compile_s": r.compile_s, "tokens": r.tokens}))
"""


def _arguments(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.startup",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded nld-tiny)")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="the server's --max-model-len (default 1024)")
    p.add_argument("--repeat", type=int, default=3, help="warm runs per mode (default 3)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"which starts, of {', '.join(MODES)} (default all)")
    p.add_argument("--out", default=str(RESULTS / "startup_cpu"),
                   help="results path without suffix (.json and .md are written)")
    return p.parse_args(argv)


def _env(cache: Path, executables: str | None) -> dict:
    env = dict(os.environ, PACKED_SS_COMPILE_CACHE=str(cache))
    env.pop("PACKED_SS_EXECUTABLES", None)
    if executables is not None:
        env["PACKED_SS_EXECUTABLES"] = executables
    return env


def first_decode(model, env: dict) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", DECODE, *([model] if model else [])], env=env,
                         capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(f"the decode failed:\n{out.stderr[-3000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]),
            "process_s": time.perf_counter() - t0}


def serve_until_healthy(model, max_model_len: int, env: dict) -> dict:
    """Starts `packed-ss serve` on a free port, waits for /health 200, stops it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "packed_ss_jax", "serve", "--port", str(port),
               "--max-model-len", str(max_model_len), *(["--model", model] if model else [])]
    with tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            healthy = _wait(server, f"http://127.0.0.1:{port}/health") - t0
        finally:
            server.terminate()
            server.wait(timeout=60)
        err.seek(0)
        ready = next((line.strip() for line in err if line.startswith("ready in")), "")
    if healthy is None:
        raise RuntimeError(f"the server ended before it was healthy: {ready}")
    return {"health_s": healthy, "ready": ready,
            "ready_s": float(ready.split()[2]) if ready else None}


def _wait(server, url: str, timeout: float = 1200.0):
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        if server.poll() is not None:
            return None
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return time.perf_counter()
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")


def measure(args) -> dict:
    rows = {}
    for name in args.modes.split(","):
        if name not in MODES:
            raise SystemExit(f"unknown mode {name!r}; expected some of {', '.join(MODES)}")
        mode, executables = MODES[name]
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp) / "cache"
            env = _env(cache, executables)
            if executables is not None:   # fill the cache (not measured)
                first_decode(args.model, env)
                serve_until_healthy(args.model, args.max_model_len, env)
            runs = 1 if executables is None else args.repeat
            decodes = [first_decode(args.model, env) for _ in range(runs)]
            serves = []
            for _ in range(runs):
                if executables is None:   # each cold run starts from nothing
                    env = _env(Path(tmp) / f"cold-{len(serves)}", None)
                serves.append(serve_until_healthy(args.model, args.max_model_len, env))
        rows[mode] = {
            "decode": {k: statistics.median(d[k] for d in decodes)
                       for k in ("import_s", "load_s", "decode_s", "compile_s", "process_s")},
            "serve": {"health_s": statistics.median(s["health_s"] for s in serves),
                      "ready_s": statistics.median(s["ready_s"] for s in serves
                                                   if s["ready_s"] is not None),
                      "ready": serves[-1]["ready"]},
            "runs": runs, "tokens": decodes[-1]["tokens"]}
        print(f"{mode}: {json.dumps(rows[mode]['decode'])} {json.dumps(rows[mode]['serve'])}",
              file=sys.stderr, flush=True)
    return rows


def table(rows: dict) -> str:
    out = ["| start | serve: /health 200 (s) | serve: ready in (s) | decode: import (s) | "
           "decode: load (s) | decode: first decode (s) | of which compile (s) |",
           "|---|---|---|---|---|---|---|"]
    for mode, r in rows.items():
        d, s = r["decode"], r["serve"]
        out.append(f"| {mode} | {s['health_s']:.1f} | {s['ready_s']:.1f} | "
                   f"{d['import_s']:.2f} | {d['load_s']:.2f} | {d['decode_s']:.2f} | "
                   f"{d['compile_s']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    args = _arguments(argv)
    rows = measure(args)
    same = len({json.dumps(r["tokens"]) for r in rows.values()}) == 1
    text = (f"# Startup, {args.model or 'nld-tiny'}, serve --max-model-len "
            f"{args.max_model_len}\n\n{table(rows)}\n\nMedians of {args.repeat} new "
            f"processes per warm mode, one cold. The first decode's tokens are "
            f"{'the same' if same else 'NOT the same'} in every mode.\n")
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"model": args.model or "nld-tiny", "max_model_len": args.max_model_len,
         "rows": rows, "same_tokens": same}, indent=1))
    out.with_suffix(".md").write_text(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
