"""Branched-SS between Packed-SS and Quadratic-SS: tokens per NFE and rows per call for
every number of branches k (1..B for Nemotron, 1..W for SetDLM), beside Packed-SS and
Quadratic-SS at the same width, on both embedded models (greedy, the arithmetic task's
held-out prompts, decoded as one batch per setting). Every output is checked against the
reference's (AR, serial).

    python -m benchmarks.branches                                   # widths 8 and 16
    python -m benchmarks.branches --json benchmarks/results/branches_cpu.json
    python -m benchmarks.branches --models nld-tiny --blocks 4 --prompts 2 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import packed_ss_jax as ps
from packed_ss_jax.arguments import int_at_least, ints_at_least
from packed_ss_jax.bench import tasks


def _arguments(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.branches",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="nld-tiny,setdlm-tiny",
                   help="embedded models or checkpoints, comma-separated")
    p.add_argument("--blocks", type=ints_at_least(2), default="8,16",
                   help="widths: Nemotron's B, SetDLM's W")
    p.add_argument("--prompts", type=int_at_least(1), default=32)
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=128)
    p.add_argument("--json", help="write the rows here")
    return p.parse_args(argv)


def measure(name, model, prompts, width: int, schedule: str, want,
            branches: int | None = None) -> dict:
    family = ps.FAMILIES[model.config.family]
    extra = {} if branches is None else {"branches": branches}
    results = ps.decode(model, prompts, schedule=schedule, max_new_tokens=want["max_new"],
                        **{family.width_name: width}, **extra)
    if [r.tokens for r in results] != want["tokens"]:
        raise SystemExit(f"{schedule} {family.width_symbol}={width} {extra}: the tokens differ "
                         f"from {family.reference}'s")
    tokens, nfe = sum(len(r.tokens) for r in results), sum(r.nfe for r in results)
    hist = np.sum([r.accept_hist for r in results], axis=0)
    return {"model": name, "family": family.name, "B": width, "schedule": schedule,
            "branches": branches, "tokens": tokens, "nfe": nfe, "tokens_per_nfe": tokens / nfe,
            "rows_per_call": max(family.iteration_rows(schedule, width, branches or 1)),
            "accept_hist": hist.tolist()}


def measure_model(name: str, args) -> list[dict]:
    model = ps.load(name)
    family = ps.FAMILIES[model.config.family]
    prompts = [t.text for t in tasks.load("arithmetic", None, args.prompts)]
    ref = ps.decode(model, prompts, schedule=family.reference, max_new_tokens=args.max_new_tokens)
    want = {"tokens": [r.tokens for r in ref], "max_new": args.max_new_tokens}
    rows = []
    for width in args.blocks:
        rows.append(measure(name, model, prompts, width, "packed", want))
        for k in range(1, width + 1):
            rows.append(measure(name, model, prompts, width, "branched", want, k))
            print(f"{name} {family.width_symbol}={width} k={k}: "
                  f"{rows[-1]['tokens_per_nfe']:.2f} tokens/NFE", file=sys.stderr, flush=True)
        rows.append(measure(name, model, prompts, width, "quadratic", want))
    return rows


def main(argv=None) -> int:
    args = _arguments(argv)
    rows = [r for name in args.models.split(",") for r in measure_model(name, args)]
    print("| model | width | schedule | k | rows/call | tokens/NFE |\n|---|---|---|---|---|---|")
    for r in rows:
        symbol = "B" if r["family"] == "nemotron" else "W"
        print(f"| {r['model']} | {symbol}={r['B']} | {r['schedule']} | {r['branches'] or ''} | "
              f"{r['rows_per_call']} | {r['tokens_per_nfe']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1)
                                   + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
