"""Per-call time of the forward with full-buffer attention against live-length attention.

`model.attend` either reads the whole cache buffer in every call ("full") or only the
positions up to the last live one, CHUNK at a time under an online softmax ("live"). This
times both on the same calls: `rows` causal rows after `live` committed positions of a
`positions`-position cache, the forward repeated inside one jitted loop, best of several runs.

    python -m benchmarks.attention_timing                    # embedded shape, float32
    python -m benchmarks.attention_timing --dtype bfloat16 --cases 4096:300
    python -m benchmarks.attention_timing --shape smoke --rows 1 --cases 64:40 --repeat 2 \
        --trials 1                                           # seconds, for a check
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp

from packed_ss_jax.nemotron import layouts
from packed_ss_jax import model as model_lib

from benchmarks.gpu_timing import SHAPES, config

# (cache positions, live positions): the embedded model's benchmark cache half used and full,
# and a default-sized cache (4096 positions) early and late in a decode.
CASES = "264:150,264:260,4096:300,4096:4000"


def compiled_loop(c, params, rows: int, size: int, live: int, impl: str, repeat: int):
    """`repeat` forwards of one call in a jitted loop, each fed by the previous one's
    logits (so XLA cannot hoist the call); compiled with attention `impl`."""
    saved = model_lib.LIVE_ATTENTION, model_lib.LIVE_MIN_POSITIONS
    model_lib.LIVE_ATTENTION = (jax.default_backend(),) if impl == "live" else ()
    model_lib.LIVE_MIN_POSITIONS = 0  # measured at every cache size
    try:
        positions = live + jnp.arange(rows, dtype=jnp.int32)
        mask = jnp.asarray(layouts.causal(rows))
        cache = model_lib.empty_cache(c, size)

        def run(params, tokens, cache, cache_len):
            def body(i, carry):
                tokens, acc = carry
                logits, _ = model_lib.forward(c, params, tokens, positions, mask, cache,
                                              cache_len)
                flag = (logits[0, 0] > 1e30).astype(jnp.int32)
                return tokens.at[0].add(flag), acc + logits[0, 0]
            return jax.lax.fori_loop(0, repeat, body, (tokens, jnp.float32(0)))

        args = (params, jnp.ones(rows, jnp.int32), cache, jnp.int32(live))
        exe = jax.jit(run).lower(*args).compile()
        return functools.partial(exe, *args)
    finally:
        model_lib.LIVE_ATTENTION, model_lib.LIVE_MIN_POSITIONS = saved


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def best_times(runs: dict, repeat: int, trials: int, clock: str) -> dict:
    """Seconds per call of each compiled loop: best of `trials`, the loops interleaved so
    that load from other processes falls on all of them alike. The "cpu" clock counts
    this process's CPU time (all threads), which other processes on a shared machine
    disturb much less than wall time; on an idle machine the two agree."""
    now = CLOCKS[clock]
    best = {k: float("inf") for k in runs}
    for fn in runs.values():
        jax.block_until_ready(fn())
    for _ in range(trials):
        for k, fn in runs.items():
            t0 = now()
            jax.block_until_ready(fn())
            best[k] = min(best[k], (now() - t0) / repeat)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention_timing",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="embedded",
                   help="model dimensions (random weights); smoke: tiny, for a check")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--rows", default="1,8,16", help="rows per call, comma-separated")
    p.add_argument("--cases", default=CASES, help="positions:live pairs")
    p.add_argument("--repeat", type=int, default=100, help="calls per timed loop")
    p.add_argument("--trials", type=int, default=7, help="timed loops per variant (best kept)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    p.add_argument("--chunk", type=int, default=model_lib.CHUNK, help="positions per live read")
    args = p.parse_args(argv)
    model_lib.CHUNK = args.chunk
    c = config(args.shape, args.dtype)
    params = model_lib.unstack_layers(model_lib.init_params(c, jax.random.PRNGKey(0)))
    print(f"{args.shape} shape, {args.dtype}, {jax.devices()[0].device_kind}, "
          f"chunk {model_lib.CHUNK}, {args.clock} clock")
    print("| cache positions | live | rows | full (ms) | live (ms) | live / full |")
    print("|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        size, live = (int(x) for x in case.split(":"))
        for rows in (int(r) for r in args.rows.split(",")):
            runs = {impl: compiled_loop(c, params, rows, size, live, impl, args.repeat)
                    for impl in ("full", "live")}
            t = best_times(runs, args.repeat, args.trials, args.clock)
            print(f"| {size} | {live} | {rows} | {1e3 * t['full']:.3f} | {1e3 * t['live']:.3f} | "
                  f"{t['live'] / t['full']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
