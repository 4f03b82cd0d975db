"""The GPU check: the measurements a short GPU rental is for, most valuable first, in 8 minutes.

    python -m tools.gpu_check --out out/gpu_check      # on a machine with a GPU
    python -m tools.gpu_check --smoke --out /tmp/gc    # the same steps, tiny, on a CPU (< 1 min)

Each step is a subprocess under its own time limit (seconds, in brackets; JAX's start and
every compilation count against it). The limits add up to TOTAL_S less RESERVE_S, and the
check as a whole stops at TOTAL_S less RESERVE_S: a step's limit is cut to what is left,
and a step left less than MIN_STEP_S is skipped. A failed or timed-out step is reported
and the next one runs.

1. timing [150]: `benchmarks/gpu_timing.py` at the 8B shape in bf16, batch 1, a KV buffer
   of 1024: time per call of AR's row and of Linear-SS's, Packed-SS's and Quadratic-SS's
   row buffers at B = 8, 16 and 32, against the weight-streaming bound.
2. products [60]: the 8B weight products alone, at the row counts of those calls.
3. bench [110]: the embedded model's `packed-ss bench` in bf16, B = 8: AR, Linear-SS,
   Quadratic-SS and Packed-SS on the arithmetic task's 100 held-out prompts: tokens/s,
   paired bootstrap intervals, and whether every schedule's outputs match AR's. The
   embedded model is tiny, so the step's time is mostly JAX's start and compilation (16
   programs: 4 schedules x 2 prompt-length buckets x the decode and its null twin for the
   time split), not decoding (the README's 2-core CPU run decodes all 100 prompts with the
   four schedules in 13 s of wall time): 100 prompts cost little more than 20 would, give
   tighter paired intervals, and are that CPU table's prompts, so the two compare prompt
   for prompt.
4. parity [80]: tests/test_parity_nemotron.py (float32, precision "highest"),
   tests/test_parity_bf16.py and tests/test_setdlm_checkpoint.py, as pytest runs them.
5. batching [60]: `benchmarks/batch_throughput.py` in bf16: AR and Packed-SS at batch
   sizes 1, 8 and 32 (continuous batching over 64 prompts).

Under --out, per step: NAME.md (its tables: what the tool printed, written as it prints,
closed with the step's status as soon as it ends, so a cut-off step keeps the rows it
measured), NAME.log (its other output) and, where the tool writes one, NAME.json; and
summary.md, rewritten as each step starts and ends. Nothing here imports JAX: the parent
never takes the device from its steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOTAL_S = 480  # the GPU slot this check must fit
RESERVE_S = 20  # the check's own start and its last writes
MIN_STEP_S = 10  # less than this cannot even start JAX


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    title: str
    limit: int
    cmd: list[str]
    json: bool = False  # the tool writes NAME.json
    pytest: bool = False  # the table is built from pytest's verbose report


PARITY_FILES = {
    "tests/test_parity_nemotron.py": "float32, precision highest, against the reference logits",
    "tests/test_parity_bf16.py": "bf16 weights and products, against the float32 reference",
    "tests/test_setdlm_checkpoint.py": "SetDLM checkpoint reading (float32)",
}


def steps(smoke: bool, out: Path) -> list[Step]:
    """The steps in order of value; `smoke`: tiny sizes with the same code paths."""
    py = sys.executable
    timing = [py, "-m", "benchmarks.gpu_timing", "--repeat", "1" if smoke else "10"] + (
        ["--smoke", "--cache-lengths", "64", "--block-size", "4", "--quadratic-block-size", "3"]
        if smoke else
        ["--shapes", "8B", "--dtype", "bfloat16", "--cache-lengths", "1024", "--batch", "1",
         "--block-size", "8,16,32", "--quadratic-block-size", "8,16,32"])
    # Row counts of the timed calls: AR 1, Linear-SS B, Packed-SS 2B, Quadratic-SS B(B+1).
    products = [py, "-m", "benchmarks.gpu_timing", "--products"] + (
        ["--smoke", "--repeat", "1", "--batch", "1,8"] if smoke else
        ["--shapes", "8B", "--dtype", "bfloat16", "--repeat", "10",
         "--batch", "1,8,16,32,64,72,272,1056"])
    bench = [py, "-m", "packed_ss_jax", "bench", "--task", "arithmetic", "--block-size", "8",
             "--dtype", "bfloat16", "--json", str(out / "bench.json")] + (
        ["--schedules", "ar,packed", "--limit", "2", "--max-new-tokens", "8",
         "--resamples", "200"] if smoke else
        ["--schedules", "ar,linear,quadratic,packed", "--limit", "100", "--resamples", "20000"])
    # `-o addopts=`: the suite's own options want pytest-xdist, which the GPU image lacks.
    parity = [py, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "addopts="] + (
        ["tests/test_parity_nemotron.py::test_causal_logits[hf-ar]",
         "tests/test_parity_bf16.py::test_causal_logits[ar]",
         "tests/test_setdlm_checkpoint.py::test_bin_and_safetensors_give_identical_params"]
        if smoke else list(PARITY_FILES))
    batching = [py, "-m", "benchmarks.batch_throughput", "--schedules", "ar,packed",
                "--dtype", "bfloat16", "--json", str(out / "batching.json")] + (
        ["--sizes", "2", "--prompts", "2", "--max-new-tokens", "8"] if smoke else
        ["--sizes", "1,8,32", "--prompts", "64"])
    # The cost model calibrated at the same shape, against step 1's measured calls.
    cost_model = [py, "-m", "benchmarks.cost_check", "--measured", str(out / "timing.md")] + (
        ["--smoke"] if smoke else ["--shape", "8B", "--dtype", "bfloat16", "--cache", "1024"])
    return [
        Step("timing", "8B row buffers in bf16: time per call against the weight-streaming "
             "bound", 140, timing),
        Step("cost", "the cost model at 8B against the timed calls, and auto's choice there",
             60, cost_model),
        Step("products", "8B weight products alone, by rows", 50, products),
        Step("bench", "embedded model's bench in bf16: AR, Linear-SS, Quadratic-SS, Packed-SS",
             90, bench, json=True),
        Step("parity", "fixture parity in float32 (highest) and bf16", 70, parity, pytest=True),
        Step("batching", "AR and Packed-SS throughput by batch size, bf16", 50, batching,
             json=True),
    ]


def run(step: Step, out: Path, limit: float, env: dict) -> tuple[str, float]:
    """Runs one step into its files; returns (status, seconds)."""
    md, log = out / f"{step.name}.md", out / f"{step.name}.log"
    shown = " ".join("python" if a == sys.executable else a for a in step.cmd)
    md.write_text(f"## {step.title}\n\n`{shown}`\n\n")
    # Whatever plugins the image has, the parity tests use none.
    env = dict(env, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1") if step.pytest else env
    (out / f"{step.name}.json").unlink(missing_ok=True)  # an earlier run's, into this folder
    t0 = time.monotonic()
    with open(log, "w") as err, open(md, "a") as table:
        # Its own process group, so a timeout also ends what it started (compilers).
        p = subprocess.Popen(step.cmd, cwd=ROOT, env=env, stdout=err if step.pytest else table,
                             stderr=err, start_new_session=True)
        try:
            rc = p.wait(timeout=limit)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            status = f"timed out at {limit:.0f} s"
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    seconds = time.monotonic() - t0
    extra = []
    if step.pytest:
        extra = pytest_table(log.read_text(errors="replace"))
    if step.name == "bench" and (out / "bench.json").exists():
        extra = same_outputs(json.loads((out / "bench.json").read_text()))
    tail = "" if status == "ok" else " (the rows above are those it printed before it ended)"
    with open(md, "a") as table:
        table.write("\n".join(["", *extra, "", f"_{status} in {seconds:.0f} s, limit "
                               f"{limit:.0f} s{tail}; full output in {log.name}_", ""]))
    return status, seconds


def pytest_table(log: str) -> list[str]:
    """Passed / not passed per test file, from pytest's verbose lines (also when cut off)."""
    found = re.findall(r"^(tests/\S+?)::(\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)",
                       log, re.M)
    rows = ["| test file | what it checks | passed | not passed |", "|---|---|---|---|"]
    for path, what in PARITY_FILES.items():
        outcomes = [o for f, _, o in found if f == path]
        rows.append(f"| {path} | {what} | {outcomes.count('PASSED')} | "
                    f"{len(outcomes) - outcomes.count('PASSED')} |")
    rows += [f"- {o}: {f}::{t}" for f, t, o in found if o != "PASSED"]
    last = [line for line in log.splitlines()
            if re.match(r"=+ .*\d+ (passed|failed|errors?|skipped)", line)]
    return rows + ([""] + last[-1:] if last else [])


def same_outputs(result: dict) -> list[str]:
    """Per schedule, the prompts on which it matched AR's response (token count and score:
    the bench records those, not the tokens)."""
    per = result["per_prompt"]
    ar = per["ar"]
    rows = ["Outputs against AR's, per prompt. The bench records each response's token count "
            "and score, not its tokens, so those are compared; greedy speculative decoding is "
            "exact, so both should match on every prompt.", "",
            "| schedule | same token count as AR | same score as AR | all match |",
            "|---|---|---|---|"]
    for s, d in per.items():
        if s == "ar":
            continue
        n = len(ar["tokens"])
        tokens = sum(a == b for a, b in zip(d["tokens"], ar["tokens"]))
        scores = sum(a == b for a, b in zip(d.get("correct", []), ar.get("correct", [])))
        same = tokens == n and scores == len(ar.get("correct", []))
        rows.append(f"| {s} | {tokens}/{n} | {scores}/{len(ar.get('correct', []))} | "
                    f"{'yes' if same else 'NO'} |")
    return rows


def device(out: Path) -> str:
    """The device, as the steps saw it (this process never starts JAX)."""
    for name in ("timing", "products"):
        f = out / f"{name}.md"
        m = f.exists() and re.search(r"^device: (.*)$", f.read_text(errors="replace"), re.M)
        if m:
            return m.group(1)
    try:
        return json.loads((out / "bench.json").read_text())["reproducibility"]["device_kind"]
    except (OSError, ValueError, KeyError):
        return "unknown (no step has reported it yet)"


def write_summary(out: Path, plan: list[Step], done: dict, elapsed: float, smoke: bool):
    rows = [f"# GPU check{' (smoke)' if smoke else ''}", "", f"device: {device(out)}", "",
            f"budget {TOTAL_S} s (steps' limits {sum(s.limit for s in plan)} s); "
            f"elapsed {elapsed:.0f} s", "",
            "| # | step | limit (s) | status | seconds | table |", "|---|---|---|---|---|---|"]
    for i, s in enumerate(plan, 1):
        status, seconds = done.get(s.name, ("not run yet", None))
        files = [f"{s.name}.md"] + ([f"{s.name}.json"] if s.json else [])
        have = ", ".join(f for f in files if (out / f).exists()) or "-"
        rows.append(f"| {i} | {s.name}: {s.title} | {s.limit} | {status} | "
                    f"{'-' if seconds is None else f'{seconds:.0f}'} | {have} |")
    (out / "summary.md").write_text("\n".join(rows) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/gpu_check", help="folder for the tables and logs")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, unoptimised compilation: check the steps on a CPU")
    args = p.parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + TOTAL_S - RESERVE_S
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if args.smoke:
        # A smoke run checks that the steps run, not their speed: unoptimised code generation
        # takes about a third off its CPU time, nearly all of which is compilation.
        env["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                  "--xla_backend_optimization_level=0"]))
    plan, done = steps(args.smoke, out), {}
    write_summary(out, plan, done, 0, args.smoke)
    for s in plan:
        left = deadline - time.monotonic()
        limit = min(s.limit, left)
        if left < MIN_STEP_S:
            done[s.name] = (f"skipped: {max(left, 0):.0f} s left of the budget", None)
        else:
            # What the summary keeps if the check is ended from outside during this step.
            done[s.name] = (f"cut off while running (limit {limit:.0f} s)", None)
            write_summary(out, plan, done, time.monotonic() - t_start, args.smoke)
            done[s.name] = run(s, out, limit, env)
        print(f"{s.name}: {done[s.name][0]}"
              + ("" if done[s.name][1] is None else f" ({done[s.name][1]:.0f} s)"), flush=True)
        write_summary(out, plan, done, time.monotonic() - t_start, args.smoke)
    print((out / "summary.md").read_text())
    return 0 if all(status == "ok" for status, _ in done.values()) else 1


if __name__ == "__main__":
    # Ended from outside (a lease running out), the check still ends the step it is running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    sys.exit(main())
