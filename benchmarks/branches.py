"""Branched-SS between Packed-SS and Quadratic-SS: tokens per NFE and rows per call for
every number of branches k = 1..B, beside Packed-SS and Quadratic-SS at the same B, on
the embedded Nemotron model (greedy, the arithmetic task's held-out prompts, decoded as
one batch per setting). Every output is checked against AR's.

    python -m benchmarks.branches                                   # B = 8 and 16
    python -m benchmarks.branches --json benchmarks/results/branches_cpu.json
    python -m benchmarks.branches --blocks 4 --prompts 2 --max-new-tokens 16  # a check
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import packed_ss_jax as ps
from packed_ss_jax.arguments import int_at_least, ints_at_least
from packed_ss_jax.bench import tasks
from packed_ss_jax.nemotron import layouts


def _arguments(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.branches",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a Nemotron checkpoint (default: nld-tiny)")
    p.add_argument("--blocks", type=ints_at_least(2), default="8,16", help="block sizes B")
    p.add_argument("--prompts", type=int_at_least(1), default=32)
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=128)
    p.add_argument("--json", help="write the rows here")
    return p.parse_args(argv)


def rows_per_call(schedule: str, B: int, branches: int = 1) -> int:
    """Rows of one loop call, read off the layout the schedule builds."""
    x, c, draft = jnp.int32(0), jnp.int32(0), jnp.zeros(B - 1, jnp.int32)
    call = {"packed": lambda: layouts.packed(x, draft, c, 0),
            "quadratic": lambda: layouts.quadratic(x, draft, c, 0),
            "branched": lambda: layouts.branched(x, draft, jnp.int32(B - 1), c, 0, branches)}
    return int(call[schedule]().tokens.shape[0])


def measure(model, prompts, B: int, schedule: str, want, branches: int | None = None) -> dict:
    extra = {} if branches is None else {"branches": branches}
    results = ps.decode(model, prompts, schedule=schedule, block_size=B,
                        max_new_tokens=want["max_new"], **extra)
    if [r.tokens for r in results] != want["tokens"]:
        raise SystemExit(f"{schedule} B={B} {extra}: the tokens differ from AR's")
    tokens, nfe = sum(len(r.tokens) for r in results), sum(r.nfe for r in results)
    hist = np.sum([r.accept_hist for r in results], axis=0)
    return {"B": B, "schedule": schedule, "branches": branches, "tokens": tokens, "nfe": nfe,
            "tokens_per_nfe": tokens / nfe,
            "rows_per_call": rows_per_call(schedule, B, branches or 1),
            "accept_hist": hist.tolist()}


def main(argv=None) -> int:
    args = _arguments(argv)
    model = ps.load(args.model) if args.model else ps.load()
    prompts = [t.text for t in tasks.load("arithmetic", None, args.prompts)]
    ar = ps.decode(model, prompts, schedule="ar", max_new_tokens=args.max_new_tokens)
    want = {"tokens": [r.tokens for r in ar], "max_new": args.max_new_tokens}
    rows = []
    for B in args.blocks:
        rows.append(measure(model, prompts, B, "packed", want))
        for k in range(1, B + 1):
            rows.append(measure(model, prompts, B, "branched", want, k))
            print(f"B={B} k={k}: {rows[-1]['tokens_per_nfe']:.2f} tokens/NFE", file=sys.stderr,
                  flush=True)
        rows.append(measure(model, prompts, B, "quadratic", want))
    print("| B | schedule | k | rows/call | tokens/NFE |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['schedule']} | {r['branches'] or ''} | {r['rows_per_call']} | "
              f"{r['tokens_per_nfe']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1)
                                   + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
