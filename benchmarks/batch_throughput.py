"""Throughput versus batch size, per schedule, on the embedded model.

The same prompts (the arithmetic task's first `--prompts`) are decoded by every schedule
at every batch size: batch size N keeps N slots of one batched program busy, refilling a
slot as soon as its sequence stops (bench.measure.run, `batch_size=N`; `--batching
static` decodes groups of N consecutive prompts instead, each until its last sequence
stops). Per row: total tokens, wall time (compilation excluded), throughput, tokens/NFE
per sequence and the time of one batched forward call. Per prompt the tokens are those
decoded alone, so tokens/NFE does not move with the batch; what moves is the cost of a
call, which serves N sequences at once.

    python -m benchmarks.batch_throughput                       # 1,2,4,8,16 x every schedule
    python -m benchmarks.batch_throughput --schedules ar --sizes 1,8 --json out.json
    python -m benchmarks.batch_throughput --schedules ar,packed --sizes 1,8,32 --dtype bfloat16

The speculative schedules already put 2B (Linear, Packed) or B(B+1) (Quadratic) rows in
each call; a batch multiplies those rows by N, so on a compute-bound CPU their calls cost
about N times as much and batching gains little (see `python -m benchmarks.gpu_timing
--shapes embedded` for the per-call cost by rows). AR's one-row calls are bound by reading
the weights, which a batch shares.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import packed_ss_jax as ps
from packed_ss_jax import families
from packed_ss_jax.bench import measure, tasks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.batch_throughput",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", default=None, help="comma-separated (default: all)")
    p.add_argument("--sizes", default="1,2,4,8,16", help="batch sizes")
    p.add_argument("--prompts", type=int, default=64, help="prompts per measurement")
    p.add_argument("--batching", choices=measure.BATCHING, default="continuous")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--capacity", type=int, default=128,
                   help="cache slots (bench sizes these prompts + 64 new tokens to 128)")
    p.add_argument("--repeats", type=int, default=1, help="keep the fastest of this many")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)

    model = ps.load(dtype=args.dtype)
    family = families.of(model.config)
    schedules = args.schedules.split(",") if args.schedules else list(family.schedules)
    sizes = [int(x) for x in args.sizes.split(",")]
    prompts = tasks.load("arithmetic", None, args.prompts)
    rows = []
    print("| schedule | batch | tokens | wall (s) | throughput (tok/s) | vs batch 1 "
          "| tokens/NFE per sequence | time/call (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for s in schedules:
        base = None
        for n in sizes:
            t0 = time.perf_counter()
            d = measure.run(model, prompts, [s], {s: args.block_size}, capacity=args.capacity,
                            max_new_tokens=args.max_new_tokens, split=None, progress=False,
                            batch_size=n, batching=args.batching, repeats=args.repeats)[s]
            tokens, wall = sum(d["tokens"]), sum(d["wall_s"])
            row = dict(schedule=s, batch_size=n, tokens=tokens, wall_s=wall,
                       throughput_tok_s=tokens / wall, tokens_per_nfe=tokens / sum(d["nfe"]),
                       time_per_call_ms=1e3 * wall / sum(d["calls"]),
                       elapsed_s=time.perf_counter() - t0)
            base = base or row["throughput_tok_s"]
            row["speedup_vs_batch1"] = row["throughput_tok_s"] / base
            rows.append(row)
            print(f"| {s} | {n} | {tokens} | {wall:.2f} | {row['throughput_tok_s']:.1f} | "
                  f"{row['speedup_vs_batch1']:.2f}x | {row['tokens_per_nfe']:.2f} | "
                  f"{row['time_per_call_ms']:.2f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": "embedded (nld-tiny)", "dtype": args.dtype, "task": "arithmetic",
             "prompts": args.prompts,
             "max_new_tokens": args.max_new_tokens, "block_size": args.block_size,
             "capacity": args.capacity, "batching": args.batching, "rows": rows},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
