"""Convert, load and decode at the Nemotron 3B and 8B shapes in bf16, with peak memory.

On synthetic release-layout checkpoints (`tools.synthetic_checkpoint`: random
weights, real names, shapes, shards and adapter) this runs, each stage in a fresh child
process so that no stage inherits another's peak resident set:

    write     the synthetic checkpoint (skipped when `--dir` already holds it)
    convert   Hugging Face directory -> converted bf16 directory (`packed_ss_jax.convert`)
    load      the converted directory in bf16, checksums verified (`packed_ss_jax.load`)
    decode    load, compile and run one greedy decode per schedule

and reports per stage the peak RSS (the child's `ru_maxrss`, from `os.wait4`), also per
phase inside a decode child (load, compile, run: Linux resets a process's peak on
`echo 5 > /proc/self/clear_refs`), the load and compile times, the time per call (wall /
NFE) and the decoded tokens; every schedule must give the AR tokens (greedy). A decode
stage also records XLA's memory analysis of its compiled program.

    python -m benchmarks.real_size --dir /tmp/real-size --json real_size.json
    python -m benchmarks.real_size --shapes 3B --schedules-3b ar packed
    python -m benchmarks.real_size --shapes tiny --schedules-3b ar packed   # seconds, for a check

The 3B stages take about 8 GB of memory, the 8B ones about 17 GB: before each stage the
benchmark waits (up to `--wait-memory` seconds) until the machine has that much
available. Checkpoints this run wrote are deleted at the end unless `--keep`.
On a CPU, XLA emulates bf16 matmuls, so a call takes seconds at these shapes: keep the
prompt short and the cache small (`--cache-size`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GB = 1e9
ROOT = Path(__file__).resolve().parents[1]  # the stages run as `python -m` from here
SCHEDULES = {"3B": ("ar", "linear", "quadratic", "packed"), "8B": ("ar", "packed")}
# Token ids of the prompt: none is the mask id (100) or an EOS (2, 11).
PROMPT = (1, 523, 1871, 2048, 4099, 777, 9000, 12345)


# -- the child side --------------------------------------------------------------------

def _peak() -> int:
    """This process's peak resident set since the last `_reset_peak`, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _weight_bytes(model) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(model.params))


def _stage(spec: dict) -> dict:
    """One stage, run in this (child) process; returns what it measured."""
    import packed_ss_jax as ps

    kind = spec["kind"]
    t0 = time.perf_counter()
    if kind == "write":
        from tools import synthetic_checkpoint

        synthetic_checkpoint.write(spec["shape"], spec["out"], progress=True)
        return {"seconds": time.perf_counter() - t0}
    if kind == "convert":
        ps.convert(spec["src"], spec["dst"], dtype="bfloat16", overwrite=True, progress=True)
        return {"seconds": time.perf_counter() - t0}
    model = ps.load(spec["model"], dtype="bfloat16", progress=True)
    out = {"load_s": time.perf_counter() - t0, "weight_bytes": _weight_bytes(model),
           "load_peak": _peak()}
    if kind == "load":
        return out
    from packed_ss_jax import DecodeOptions, Engine

    resets = _reset_peak()
    e = Engine.of(model)
    options = DecodeOptions(schedule=spec["schedule"], width=spec["block_size"],
                            max_new_tokens=spec["max_new_tokens"], eos_id=None,
                            cache_size=spec["cache_size"])
    prompt = [t % model.config.vocab_size for t in spec["prompt"]]  # the tiny shape's too
    request = e.request(prompt, options)
    exe, compile_s = e.compiled(request)
    out.update(compile_s=compile_s, compile_peak=_peak() if resets else None)
    mem = exe.memory_analysis()
    if mem is not None:
        out["xla"] = {k: int(getattr(mem, k)) for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes") if hasattr(mem, k)}
    resets = _reset_peak()
    r = e.decode(request)
    out.update(run_s=r.wall_s, nfe=r.nfe, tokens=r.tokens, s_per_call=r.wall_s / r.nfe,
               run_peak=_peak() if resets else None)
    return out


def _child(argv) -> int:
    spec = json.loads(argv[0])
    result = _stage(spec)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# -- the parent side -------------------------------------------------------------------

def _available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _wait_for_memory(need: float, limit_s: float, label: str):
    t0 = time.monotonic()
    while _available() < need:
        if time.monotonic() - t0 > limit_s:
            raise RuntimeError(f"{label}: {need / GB:.1f} GB needed, {_available() / GB:.1f} GB "
                               f"available after waiting {limit_s:.0f}s")
        print(f"{label}: waiting for {need / GB:.1f} GB of memory "
              f"({_available() / GB:.1f} GB available)", file=sys.stderr, flush=True)
        time.sleep(30)


def run_stage(spec: dict, label: str) -> dict:
    """Runs one stage in a fresh child process; adds its peak RSS and wall time."""
    cmd = [sys.executable, "-m", "benchmarks.real_size", "--stage", json.dumps(spec)]
    print(f"== {label}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        out = p.stdout.read()
    except BaseException:
        p.kill()
        raise
    finally:
        # os.wait4 gives this child's own resource usage (Popen.wait would not).
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{label}: the child failed (exit status {p.returncode})")
    result = json.loads(lines[-1][len("RESULT "):])
    result.update(label=label, peak_rss=usage.ru_maxrss * 1024, wall_s=wall)
    return result


def _fmt(x, spec="{:.1f}"):
    return "" if x is None else spec.format(x)


def table(results: list[dict]) -> str:
    head = ("| shape | stage | wall s | peak RSS GB | weights GB | peak - weights GB "
            "| peak / weights | load s | compile s | calls (NFE) | s per call | tokens = AR |")
    lines = [head, "|" + "---|" * 12]
    for r in results:
        w = r.get("weight_bytes")
        peak = r["peak_rss"]
        lines.append(
            f"| {r['shape']} | {r['stage']} | {r['wall_s']:.0f} | {peak / GB:.2f} "
            f"| {_fmt(w and w / GB, '{:.2f}')} | {_fmt(w and (peak - w) / GB, '{:.2f}')} "
            f"| {_fmt(w and peak / w, '{:.2f}')} | {_fmt(r.get('load_s'))} "
            f"| {_fmt(r.get('compile_s'))} | {_fmt(r.get('nfe'), '{}')} "
            f"| {_fmt(r.get('s_per_call'), '{:.2f}')} | {_fmt(r.get('same_as_ar'), '{}')} |")
    return "\n".join(lines)


def verdicts(results: list[dict]) -> list[str]:
    """The targets: decode peaks within 1.3 x weights + 2 GB; greedy tokens equal AR's."""
    out = []
    for r in results:
        if r["stage"].startswith("decode"):
            limit = 1.3 * r["weight_bytes"] + 2 * GB
            ok = r["peak_rss"] <= limit
            out.append(f"{r['shape']} {r['stage']}: peak {r['peak_rss'] / GB:.2f} GB "
                       f"{'<=' if ok else '>'} 1.3 x weights + 2 GB = {limit / GB:.2f} GB; "
                       f"tokens {'=' if r.get('same_as_ar') else '!='} AR's")
    return out


def _weights(shape: str) -> float:
    """bf16 weight bytes of a shape (adapter included), from the abstract params."""
    import jax

    from packed_ss_jax import model as model_lib
    from tools.synthetic_checkpoint import model_config

    c = model_config(shape, "bfloat16", lora=True)
    return float(sum(x.size * 2 for x in jax.tree.leaves(model_lib.abstract_params(c))))


def _shape(shape: str, root: Path, args) -> list[dict]:
    """Every stage of one shape; deletes the checkpoints it wrote unless `--keep`."""
    weights = _weights(shape)
    need = weights + 1.5 * GB  # what a stage holds at its peak, and a margin
    src, dst = root / f"nld-{shape.lower()}", root / f"nld-{shape.lower()}-bf16"
    written, results = [], []

    def stage(spec, name, memory=need, **extra):
        label = f"{shape} {name}"
        _wait_for_memory(memory, args.wait_memory, label)
        r = dict(run_stage(spec, label), shape=shape, stage=name, **extra)
        results.append(r)
        print(table([r]).splitlines()[-1], file=sys.stderr, flush=True)
        return r

    try:
        if not (src / "model.safetensors.index.json").exists():
            written.append(src)
            stage({"kind": "write", "shape": shape, "out": str(src)}, "write", memory=GB)
        written.append(dst)
        stage({"kind": "convert", "src": str(src), "dst": str(dst)}, "convert",
              weight_bytes=weights)
        stage({"kind": "load", "model": str(dst)}, "load")
        stage({"kind": "load", "model": str(src)}, "load (Hugging Face)")
        ar_tokens = None
        for schedule in (args.schedules_8b if shape == "8B" else args.schedules_3b):
            spec = {"kind": "decode", "model": str(dst), "schedule": schedule,
                    "block_size": args.block_size, "max_new_tokens": args.max_new_tokens,
                    "cache_size": args.cache_size, "prompt": list(PROMPT)}
            # The reference is AR's output when AR runs first; each schedule is compared.
            r = stage(spec, f"decode {schedule}")
            if schedule == "ar":
                ar_tokens = r["tokens"]
            r["same_as_ar"] = None if ar_tokens is None else r["tokens"] == ar_tokens
            print(f"{shape} {schedule}: tokens {r['tokens']} "
                  f"({'the same as' if r['same_as_ar'] else 'NOT the same as'} AR's)",
                  file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            for d in written:
                shutil.rmtree(d, ignore_errors=True)
    return results


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--stage"]:
        return _child(argv[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks.real_size",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="where the checkpoints go (and are reused "
                   "from: nld-3b/, nld-8b/); default: a temporary directory")
    p.add_argument("--shapes", nargs="+", default=["3B", "8B"], choices=["3B", "8B", "tiny"],
                   help="tiny: a check of the benchmark itself, in seconds")
    p.add_argument("--schedules-3b", nargs="+", default=list(SCHEDULES["3B"]))
    p.add_argument("--schedules-8b", nargs="+", default=list(SCHEDULES["8B"]))
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--cache-size", type=int, default=64)
    p.add_argument("--wait-memory", type=float, default=1800.0,
                   help="seconds to wait for enough available memory before a stage")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints this run wrote")
    args = p.parse_args(argv)

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="real-size-"))
    root.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    t_start = time.perf_counter()
    try:
        for shape in args.shapes:
            results += _shape(shape, root, args)
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    total = time.perf_counter() - t_start
    print(table(results))
    print("\n" + "\n".join(verdicts(results)))
    print(f"\ntotal {total:.0f}s; block size {args.block_size}, {args.max_new_tokens} new "
          f"tokens, cache {args.cache_size} slots, prompt of {len(PROMPT)} tokens, greedy")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "total_s": total,
                                               "args": vars(args)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
