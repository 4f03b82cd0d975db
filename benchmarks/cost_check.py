"""The cost model (packed_ss_jax/cost.py) at a real model size, against measured calls, and
what `schedule="auto"` would choose there.

Random weights of the shape (a call's time does not depend on their values) are
calibrated as `auto` calibrates a loaded model, on a coarser grid that fits a short GPU
step (the forward at `ROWS` rows over the one buffer size the timed calls read, where
`auto`'s own grid is cost.ROWS over cost.POSITIONS); then:

1. each call of `--measured` (the table `benchmarks.gpu_timing` prints: AR's row,
   Linear-SS's, Packed-SS's and Quadratic-SS's calls at each B) next to the cost model's
   prediction for its rows;
2. per candidate of `auto`, the predicted tokens per second at batch 1 and 8: tokens
   per iteration from `--acceptance` (a `benchmarks.auto` run's calibrated acceptance:
   random weights accept nothing, so a trained model's rates stand in) over the
   predicted time of an iteration's calls, and the candidate `auto` would pick.

    python -m benchmarks.cost_check --shape 8B --dtype bfloat16 --cache 1024 \
        --measured out/gpu_check/timing.md   # on a GPU, after the GPU check's timing step
    python -m benchmarks.cost_check --smoke  # tiny shapes: checks the script
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import jax

from benchmarks import gpu_timing
from packed_ss_jax import cost, families, model as model_lib
from packed_ss_jax.acceptance import Candidate
from packed_ss_jax.model import Model

ROOT = Path(__file__).resolve().parents[1]
ACCEPTANCE = ROOT / "benchmarks" / "results" / "auto_cpu.json"
ROWS = (1, 32, 256)   # three compiles at a real size: a GPU check step is short
BATCHES = (1, 8)
NEMOTRON = families.FAMILIES["nemotron"]
# A row of gpu_timing's table: | model | call | batch | cache | ms / call | ...
TIMED = re.compile(r"^\|[^|]*\|\s*(?P<call>[^|]*?\((?P<rows>\d+) rows[^|]*)\|\s*(?P<batch>\d+)\s*\|"
                   r"\s*(?P<cache>\d+)\s*\|\s*(?P<ms>[\d.]+)\s*\|")
LABEL = re.compile(r"^(?P<schedule>\w+)(?: B=(?P<width>\d+))?(?: k=(?P<k>\d+))?$")


def _arguments(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cost_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8B", choices=sorted(gpu_timing.SHAPES))
    p.add_argument("--dtype", default=None, help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--cache", type=int, default=1024, help="KV positions each call attends over")
    p.add_argument("--measured", default=None, help="benchmarks.gpu_timing's printed table")
    p.add_argument("--acceptance", default=str(ACCEPTANCE),
                   help="a benchmarks.auto --json run (its nld-tiny acceptance)")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shape, for a CPU check")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.cache, args.repeat = "smoke", 64, 1
    return args


def measured_calls(path: str | None) -> list[dict]:
    """The batch-1 rows of gpu_timing's table: call, rows, cache, ms."""
    if path is None or not Path(path).is_file():
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        m = TIMED.match(line)
        if m and m["batch"] == "1":
            out.append({"call": m["call"].strip(), "rows": int(m["rows"]),
                        "cache": int(m["cache"]), "ms": float(m["ms"])})
    return out


def acceptance_rates(path: str) -> dict[Candidate, float]:
    """Greedy tokens per iteration by candidate, from a benchmarks.auto run's nld-tiny."""
    run = next(r for r in json.loads(Path(path).read_text())["runs"] if r["model"] == "nld-tiny")
    out = {}
    for row in run["acceptance"]:
        m = LABEL.match(row["candidate"])
        if row["sampled"] or m is None:
            continue
        out[Candidate(m["schedule"], int(m["width"] or 1), int(m["k"] or 1))] = \
            row["prior_tokens_per_iteration"]
    return out


def main(argv=None) -> int:
    args = _arguments(argv)
    dev = jax.devices()[0]
    dtype = args.dtype or ("bfloat16" if dev.platform == "gpu" else "float32")
    c = gpu_timing.config(args.shape, dtype)
    params = model_lib.unstack_layers(model_lib.init_params(c, jax.random.PRNGKey(0)))
    model = Model(config=c, params=params, source=f"random {args.shape}")
    positions = args.cache + 128   # gpu_timing's buffer: the cache and one call's headroom
    t0 = time.perf_counter()
    model_cost = cost.calibrate(model, rows=tuple(r for r in ROWS if r < positions),
                                positions=(positions,), repeat=args.repeat)
    print(f"device: {getattr(dev, 'device_kind', dev.platform)}, {args.shape} {dtype}, "
          f"cache {args.cache}: calibrated in {time.perf_counter() - t0:.1f} s\n")
    print("| rows | ms / call (calibration) |\n|---|---|")
    for r, s in zip(model_cost.rows, model_cost.seconds[0]):
        print(f"| {r} | {1e3 * s:.3f} |")
    timed = [m for m in measured_calls(args.measured) if m["cache"] == args.cache]
    if timed:
        print("\n| call | rows | measured ms | predicted ms | predicted / measured |\n"
              "|---|---|---|---|---|")
        for m in timed:
            p = 1e3 * model_cost.call_s(m["rows"], positions)
            print(f"| {m['call']} | {m['rows']} | {m['ms']:.3f} | {p:.3f} | {p / m['ms']:.2f} |")
    else:
        print(f"\n(no measured calls at cache {args.cache} in {args.measured}: step 1's table)")
    rates = acceptance_rates(args.acceptance)
    print("\n| candidate | tokens / iteration | " +
          " | ".join(f"batch {n}: ms / iteration | tokens/s" for n in BATCHES) + " |")
    print("|---|---|" + "---|---|" * len(BATCHES))
    best = {}
    for cand, rate in sorted(rates.items(), key=lambda kv: kv[0].label(NEMOTRON)):
        cells = []
        for n in BATCHES:
            s = sum(model_cost.call_s(n * r, positions)
                    for r in NEMOTRON.iteration_rows(cand.schedule, cand.width, cand.branches))
            speed = n * rate / s
            cells.append(f"{1e3 * s:.3f} | {speed:.0f}")
            if speed > best.get(n, (None, 0))[1]:
                best[n] = (cand, speed)
        print(f"| {cand.label(NEMOTRON)} | {rate:.2f} | " + " | ".join(cells) + " |")
    for n, (cand, speed) in best.items():
        print(f"\nauto at batch {n}: {cand.label(NEMOTRON)} (predicted {speed:.0f} tokens/s)")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
