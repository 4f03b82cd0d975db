"""What streaming costs: wall time of a decode run in chunks of k loop iterations
(`scheduler.Streaming`: the prefill, then a launch of k iterations at a time, the state
donated, the final tokens read back after each launch) against the same decode in one launch
(`Engine.decode`). Interleaved repetitions, medians.

    python -m benchmarks.stream_overhead                         # embedded nld-tiny, packed
    python -m benchmarks.stream_overhead --schedule ar --chunks 4,16 --tokens 512
    python -m benchmarks.stream_overhead --tokens 16 --chunks 4 --repeat 1   # for a check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax

import packed_ss_jax as ps
from packed_ss_jax import DecodeOptions, Engine
from packed_ss_jax.scheduler import DEFAULT_CHUNK, Streaming
from packed_ss_jax.chunks import Detokenizer

PROMPT = ("Question: Ava has 12 apples. Ava gets 7 more apples. How many apples does Ava have "
          "now?\nAnswer:")


def _arguments(argv) -> argparse.Namespace:
    """The parsed command line."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.stream_overhead",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded nld-tiny)")
    p.add_argument("--schedule", default="packed")
    p.add_argument("--tokens", type=int, default=256, help="max_new_tokens (EOS ignored)")
    p.add_argument("--chunks", default=f"4,8,{DEFAULT_CHUNK},32")
    p.add_argument("--repeat", type=int, default=15)
    return p.parse_args(argv)


def _interleaved_times(e: Engine, model, request, chunks: list[int], repeat: int) -> dict:
    """Wall times (s) per way of decoding: "one-shot", "k=K" and "k=K + text" (the chunks
    detokenized as they come), `repeat` of each."""

    def chunked(k, text: bool):
        t0 = time.perf_counter()
        d = Detokenizer(model.tokenizer.decode) if text else None
        for new in Streaming(e, request, k):
            if d is not None:
                d.add(new)
        return time.perf_counter() - t0

    def oneshot():
        return e.decode(request).wall_s

    times = {"one-shot": []} | {f"k={k}": [] for k in chunks} | \
            {f"k={k} + text": [] for k in chunks}
    for _ in range(repeat):  # interleaved, so drifts in machine load hit all alike
        times["one-shot"].append(oneshot())
        for k in chunks:
            times[f"k={k}"].append(chunked(k, False))
            times[f"k={k} + text"].append(chunked(k, True))
    return times


def _empty_launch_times(e: Engine, request) -> list[float]:
    """Wall times (s) of 200 launches that run no loop iteration."""
    # The fixed cost of one launch: a generate that runs no iteration (k = 0: dispatch,
    # the donated state, the progress read back). Best of many, so load hides less.
    c = Streaming(e, request, 1)
    c.launch()
    empty = []
    for _ in range(200):
        t0 = time.perf_counter()
        jax.device_get(c.scheduler.launch(0).progress)
        empty.append(time.perf_counter() - t0)
    return empty


def _print_report(model, args, one, times: dict, chunks: list[int], empty: list[float]) -> None:
    """The table of wall times against one-shot, then the launch cost and what it adds."""
    launch = min(empty)
    base, best = statistics.median(times["one-shot"]), min(times["one-shot"])
    print(f"{model.source}: {args.schedule}, {len(one.tokens)} tokens, {one.iterations} "
          f"iterations, {one.nfe} NFE; {args.repeat} runs each")
    print("| decode | launches | median wall (ms) | vs one-shot | best wall (ms) | vs one-shot |")
    print("|---|---|---|---|---|---|")
    for name, ts in times.items():
        t, b = statistics.median(ts), min(ts)
        k = int(name.split()[0][2:]) if name.startswith("k=") else None
        launches = 1 if k is None else 1 + -(-(one.iterations - 1) // k)
        print(f"| {name} | {launches} | {1e3 * t:.1f} | {100 * (t / base - 1):+.1f} % | "
              f"{1e3 * b:.1f} | {100 * (b / best - 1):+.1f} % |")
    print(f"\none launch, no iteration (k=0): best {1e6 * launch:.0f} us, median "
          f"{1e6 * statistics.median(empty):.0f} us; per-iteration cost (best one-shot / "
          f"iterations): {1e3 * best / one.iterations:.2f} ms")
    for k in chunks:
        launches = 1 + -(-(one.iterations - 1) // k)
        print(f"k={k}: {launches - 1} extra launches x best launch cost = "
              f"{100 * (launches - 1) * launch / best:.2f} % of the best one-shot wall")


def main(argv=None) -> int:
    args = _arguments(argv)
    model = ps.load(args.model)
    e = Engine.of(model)
    request = e.request(PROMPT, DecodeOptions(schedule=args.schedule, max_new_tokens=args.tokens,
                                              eos_id=None))
    chunks = [int(k) for k in args.chunks.split(",")]
    one = e.decode(request)  # compiles
    for k in chunks:
        assert [t for c in Streaming(e, request, k) for t in c] == one.tokens
    times = _interleaved_times(e, model, request, chunks, args.repeat)
    _print_report(model, args, one, times, chunks, _empty_launch_times(e, request))
    return 0


if __name__ == "__main__":
    sys.exit(main())
