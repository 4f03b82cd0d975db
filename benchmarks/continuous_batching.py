"""Continuous versus static batching over a long queue, on the embedded model.

The arithmetic task's first `--prompts` prompts, N slots: static batches of N
consecutive prompts, each run until its last sequence stops (bench.measure.run with
`batch_size=N, batching="static"`), against one queue keeping N slots busy
(`decode_continuous`): the loop hands control back as soon as a sequence stops, or after
k iterations at most, and one call starts the next prompts in the stopped slots. Both
give every prompt's own tokens (checked here); compilation is excluded from both.
Reported: throughput, the ratio, the batched loop iterations, the refill calls, the host
round trips and the share of wall time they take (outside the device programs) for each k.

    python -m benchmarks.continuous_batching                   # 200 prompts, N=8, AR
    python -m benchmarks.continuous_batching --schedule packed --every 8,64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import packed_ss_jax as ps
from packed_ss_jax.bench import measure, tasks


def _arguments(argv) -> tuple[argparse.Namespace, list[int]]:
    """The parsed command line and the values of k (`--every`) to measure."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.continuous_batching",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="ar")
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--every", default="8,64",
                   help="the most loop iterations between host round trips, k, to measure")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--capacity", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="keep the fastest of this many")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if min(args.repeats, args.prompts, args.slots) < 1:
        p.error("--repeats, --prompts and --slots must be at least 1")
    try:
        every = [int(x) for x in args.every.split(",")]
    except ValueError:
        every = [0]
    if min(every) < 1:
        p.error(f"--every: iterations between round trips must be integers >= 1, "
                f"got {args.every!r}")
    return args, every


def _timed_passes(model, prompts, args, every: list[int]) -> dict:
    """Every pass over the queue, static and for each k: "static" -> measure.run's
    results, k -> decode_continuous's (results, stats); compiled before the first."""
    s, N = args.schedule, args.slots
    width = {} if s == "ar" else {"block_size": args.block_size}
    kw = dict(schedule=s, max_new_tokens=args.max_new_tokens, cache_size=args.capacity,
              seed=list(range(len(prompts))), **width)

    def static():
        return measure.run(model, prompts, [s], {s: args.block_size}, capacity=args.capacity,
                           max_new_tokens=args.max_new_tokens, split=None, progress=False,
                           batch_size=N, batching="static")[s]

    def queue(k):
        return ps.decode_continuous(model, [q.text for q in prompts], slots=N, every=k, **kw)

    warm = [q.text for q in prompts[:N + 1]]  # a refill too, where the queue is that long
    for k in every:  # compile, warm up
        ps.decode_continuous(model, warm, slots=N, every=k,
                             **dict(kw, seed=list(range(len(warm)))))
    # The passes alternate (static, then each k), so a slow spell of the machine hits
    # every way alike; each way keeps its fastest whole pass over the queue.
    passes = {"static": [], **{k: [] for k in every}}
    for _ in range(args.repeats):
        passes["static"].append(static())
        for k in every:
            passes[k].append(queue(k))
    return passes


def _rows(passes: dict, every: list[int], N: int) -> list[dict]:
    """One row per way (static, then each k), from its fastest pass; checks that every
    way gives each prompt as many tokens as static batching."""
    d = min(passes["static"], key=lambda d: sum(d["wall_s"]))
    tokens, static_wall = sum(d["tokens"]), sum(d["wall_s"])
    rows = [dict(mode="static", slots=N, every=None, tokens=tokens, wall_s=static_wall,
                 throughput_tok_s=tokens / static_wall, ratio_to_static=1.0,
                 forward_calls=round(sum(d["calls"])), host_fraction=None)]
    for k in every:
        results, st = min(passes[k], key=lambda x: x[1].wall_s)
        got = [len(r.tokens) for r in results]
        assert got == d["tokens"], "continuous batching changed some prompt's token count"
        rows.append(dict(mode="continuous", slots=N, every=k, tokens=sum(got),
                         wall_s=st.wall_s, throughput_tok_s=sum(got) / st.wall_s,
                         ratio_to_static=static_wall / st.wall_s,
                         forward_calls=st.forward_calls, steps=st.steps,
                         refill_calls=st.refill_calls, round_trips=st.round_trips,
                         host_fraction=st.host_fraction))
    return rows


def _print_table(rows: list[dict], args, n_prompts: int) -> None:
    """The rows as a Markdown table, under a line naming the setup."""
    print(f"{args.schedule}, {n_prompts} prompts, {args.slots} slots, max_new_tokens "
          f"{args.max_new_tokens}, fastest of {args.repeats}")
    print("| mode | k | tokens | wall (s) | throughput (tok/s) | vs static | batched calls "
          "| refill calls | round trips | host share |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        host = "-" if r["host_fraction"] is None else f"{100 * r['host_fraction']:.1f}%"
        print(f"| {r['mode']} | {r['every'] or '-'} | {r['tokens']} | {r['wall_s']:.2f} | "
              f"{r['throughput_tok_s']:.1f} | {r['ratio_to_static']:.2f}x | "
              f"{r['forward_calls']} | {r.get('refill_calls', '-')} | "
              f"{r.get('round_trips', '-')} | {host} |")


def main(argv=None) -> int:
    args, every = _arguments(argv)
    model = ps.load()
    prompts = tasks.load("arithmetic", None, args.prompts)
    rows = _rows(_timed_passes(model, prompts, args, every), every, args.slots)
    _print_table(rows, args, len(prompts))
    if args.json:
        Path(args.json).write_text(json.dumps({"schedule": args.schedule,
                                               "prompts": len(prompts),
                                               "repeats": args.repeats, "rows": rows},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
