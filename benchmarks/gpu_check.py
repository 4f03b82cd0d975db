#!/usr/bin/env python
"""The GPU check: one command, under 10 minutes on an H100/H200, whose tables go in the README.

    python -m benchmarks.gpu_check --out gpu_check_out      # on a machine with a GPU
    python -m benchmarks.gpu_check --smoke --out /tmp/gc    # the same steps, tiny, on a CPU

Steps (each under its own time limit; a failed step is reported and the next one runs):
1. parity: the fixture parity tests in float32 (precision "highest") and bf16 against the
   Hugging Face reference logits (tests/test_parity_nemotron.py, test_parity_bf16.py,
   test_setdlm_checkpoint.py); the fixtures are found as the tests find them
   (PACKED_SS_SHARED, or a `shared/` folder beside or inside the checkout).
2. the embedded model's bench in bf16: AR, Linear-SS and Packed-SS at B = 8 on 100
   held-out arithmetic prompts (throughput, tokens/NFE, paired intervals);
3. `benchmarks/gpu_timing.py` at the 3B and 8B shapes: time per call of every schedule's
   row buffer against the weight-streaming bound, and the weight products alone by rows;
4. batching on the embedded model: AR throughput at batch sizes 1 and 8 (continuous
   batching over 64 prompts) and continuous against static batches of 8 over 200 prompts.
Outputs: one log per step and a summary, under --out. Nothing in the project depends on
a GPU; this only measures on one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def steps(smoke: bool, out: Path) -> list[tuple[str, list[str], int]]:
    py = sys.executable
    parity = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_parity_nemotron.py",
              "tests/test_parity_bf16.py", "tests/test_setdlm_checkpoint.py"]
    bench = [py, "-m", "packed_ss_jax", "bench", "--task", "arithmetic", "--schedules",
             "ar,linear,packed", "--block-size", "8", "--dtype", "bfloat16",
             "--limit", "3" if smoke else "100", "--resamples", "2000" if smoke else "20000",
             "--json", str(out / "bench_embedded.json")]
    timing = [py, "-m", "benchmarks.gpu_timing"] + (["--smoke", "--repeat", "1"] if smoke else
                                                     ["--shapes", "3B,8B", "--cache-lengths",
                                                      "1024", "--repeat", "10"])
    products = [py, "-m", "benchmarks.gpu_timing", "--products"] + (
        ["--smoke", "--repeat", "1", "--batch", "1,8"] if smoke else
        ["--shapes", "3B,8B", "--repeat", "10", "--batch", "1,8,16,64,256"])
    batching = [py, "-m", "benchmarks.batch_throughput", "--schedules", "ar", "--sizes", "1,8",
                "--prompts", "4" if smoke else "64", "--json", str(out / "batching.json")]
    queue = [py, "-m", "benchmarks.continuous_batching", "--every", "64",
             "--prompts", "8" if smoke else "200", "--repeats", "1" if smoke else "3",
             "--json", str(out / "continuous.json")]
    if smoke:
        parity += ["-k", "ar_logits or bf16"]
    return [("parity", parity, 150), ("bench_embedded", bench, 200),
            ("gpu_timing", timing, 240), ("products", products, 90),
            ("batching", batching, 120), ("continuous", queue, 120)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_check_out", help="folder for the logs and summary")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: check the steps on a CPU")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    summary = []
    t_all = time.monotonic()
    for name, cmd, limit in steps(args.smoke, out):
        t0 = time.monotonic()
        with open(out / f"{name}.log", "w") as log:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=limit).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        summary.append(f"| {name} | {rc} | {time.monotonic() - t0:.0f} |")
        print(summary[-1], flush=True)
    import jax

    dev = jax.devices()[0]
    text = "\n".join([f"device: {getattr(dev, 'device_kind', dev.platform)}",
                      "| step | status | seconds |", "|---|---|---|", *summary,
                      f"total {time.monotonic() - t_all:.0f} s"])
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0 if all(line.split("|")[2].strip() == "0" for line in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
