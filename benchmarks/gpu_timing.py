"""Time per call of each schedule's row buffer on Nemotron 3B/8B shapes (random bf16 weights).

For every model shape, cache length and row count (AR: 1; Linear-SS and Packed-SS: 2B;
Quadratic-SS: B(B+1)), the jitted forward is run at least --repeat times inside one XLA loop (as many as
make a timed loop last cost.MIN_RUN_S) and the time per call is reported next to the weight-streaming bound (parameter bytes /
memory bandwidth): at batch size 1 a call can't be faster than reading every weight once.

    python -m benchmarks.gpu_timing                  # 3B and 8B, B=32 (Q-SS B=8)
    python -m benchmarks.gpu_timing --smoke          # tiny shapes: checks the script on a CPU
    python -m benchmarks.gpu_timing --shapes embedded --cache-lengths 264 --block-size 8 \
        --quadratic-block-size 4                     # the embedded model's calls, on a CPU
    python -m benchmarks.gpu_timing --shapes embedded --cache-lengths 128 --block-size 8 \
        --quadratic-block-size 4 --batch 1,2,4,8,16  # ... and of batched decodes
    python -m benchmarks.gpu_timing --shapes embedded --products --batch 1,8,16
                                                     # the weight products alone, by rows
    python -m benchmarks.gpu_timing --shapes 8B --cache-lengths 1024 --block-size 8,16,32 \
        --quadratic-block-size 8,16,32               # every schedule at B = 8, 16 and 32

`--products` times only the products of a call with the weights (every layer's q, k, v,
o, gate, up and down projections and the head, chained as the forward chains them, none
of the rest): what a call of that many rows cannot be faster than on this device, and the
rate those products run at, next to the rate of one 1024 x 1024 x 1024 product.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp

from packed_ss_jax.nemotron import layouts
from packed_ss_jax import cost, model as model_lib
from packed_ss_jax.config import ModelConfig

# Peak HBM bandwidth, bytes/s, by device kind substring.
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40": 0.86e12}

SHAPES = {
    "3B": dict(hidden_size=3072, num_layers=26, num_heads=32, num_kv_heads=8, head_dim=128,
               intermediate_size=9216, vocab_size=131072),
    "8B": dict(hidden_size=4096, num_layers=34, num_heads=32, num_kv_heads=8, head_dim=128,
               intermediate_size=14336, vocab_size=131072),
    # The embedded model's dims (random weights cost the same): the per-call table on CPU.
    "embedded": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                     intermediate_size=640, vocab_size=2048),
    "smoke": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128, vocab_size=512),
}


def config(shape: str, dtype: str) -> ModelConfig:
    return ModelConfig(family="nemotron", rms_norm_eps=1e-5, mask_token_id=100, block_size=32,
                       max_position_embeddings=262144, rope_theta=1e6, rope_type="yarn",
                       rope_factor=16.0, rope_original_max_position=16384,
                       llama4_scaling_beta=0.1, dtype=dtype, **SHAPES[shape])


def calls(B, Bq, mask_id: int):
    """(schedule, call layout, logits rows) as the engine makes them (tokens are arbitrary).
    `B` and `Bq` (Quadratic-SS) are block sizes, an int or a list each: AR's call, then
    Linear-SS's and Packed-SS's calls at the i-th B followed by Quadratic-SS's at the i-th
    Bq, for each i (so 8,16,32 and 8,16,32 time every schedule at each size in turn)."""
    Bs, Bqs = ([b] if isinstance(b, int) else list(b) for b in (B, Bq))
    x, c = jnp.int32(1), jnp.int32(0)
    out = [("ar (1 row)", layouts.single(x, c), None)]
    for i in range(max(len(Bs), len(Bqs))):
        if i < len(Bs):
            b = Bs[i]
            d = jnp.full(b - 1, 2, jnp.int32)
            out += [
                (f"linear draft ({b} rows)", layouts.draft_block(x, c, b, mask_id),
                 jnp.arange(1, b)),
                (f"linear verify ({b} rows)", layouts.verify(x, d, c), None),
                (f"packed ({2 * b} rows)", layouts.packed(x, d, c, mask_id),
                 jnp.concatenate([jnp.arange(b), b + 1 + jnp.arange(b - 1)])),
            ]
        if i < len(Bqs):
            b = Bqs[i]
            dq = jnp.full(b - 1, 2, jnp.int32)
            out.append((f"quadratic ({b * (b + 1)} rows, B={b})",
                        layouts.quadratic(x, dq, c, mask_id), None))
    return out


def time_forward(forward, params, call, cache, cache_len, out_rows, repeat: int) -> float:
    """Seconds per call of `forward` on one layout (cost.seconds_per_call: the median of
    timed loops of at least `repeat` calls)."""
    def one(params, tokens, cache):
        return forward(params, tokens, call.positions, call.mask, cache, jnp.int32(cache_len),
                       call.draft_rows, out_rows)[0]

    return cost.seconds_per_call(one, params, call.tokens, cache, repeat)


def time_call(c: ModelConfig, params, call, out_rows, cache_len: int, repeat: int,
              batch: int = 1) -> float:
    """Seconds per call of one layout; with `batch` > 1, the call of `batch` sequences,
    each with its own cache, as the batched engine makes it (the forward vmapped)."""
    cache = model_lib.empty_cache(c, cache_len + 128)
    call = call._replace(positions=call.positions + cache_len)
    forward = functools.partial(model_lib.forward, c)
    if batch > 1:
        cache = jax.tree.map(lambda b: jnp.broadcast_to(b, (batch,) + b.shape), cache)
        call = call._replace(tokens=jnp.broadcast_to(call.tokens, (batch,) + call.tokens.shape))
        forward = jax.vmap(forward, in_axes=(None, 0, None, None, 0, None, None, None))
    return time_forward(forward, params, call, cache, cache_len, out_rows, repeat)


def products(c: ModelConfig, params, rows: int, repeat: int):
    """The weight products alone for `rows` rows, as a timer: the forward's chain of dense
    products with its weights (attention, norms, RoPE and the cache left out; each
    product's input still depends on the one before). Returns (time_once, FLOPs per
    call): `time_once()` runs `repeat` calls in one XLA loop, seconds per call."""
    kv_repeat = c.num_heads // c.num_kv_heads

    @jax.jit
    def run(params_, h):
        def body(_, h):
            x = h
            for j in range(c.num_layers):
                a, m = params_[f"layer_{j}"]["attn"], params_[f"layer_{j}"]["mlp"]
                q, k, v = (model_lib.dense(x, a[n], None) for n in ("q_proj", "k_proj", "v_proj"))
                mixed = q + jnp.tile(k + v, (1, kv_repeat))  # stands in for attention
                x = x + model_lib.dense(mixed, a["o_proj"], None)
                gate, up = (model_lib.dense(x, m[n], None) for n in ("gate_proj", "up_proj"))
                x = x + model_lib.dense(jax.nn.silu(gate) * up, m["down_proj"], None)
            logits = model_lib.dense(x, params_["head"], None)
            return h + 1e-6 * jnp.max(logits, axis=-1, keepdims=True)
        return jax.lax.fori_loop(0, repeat, body, h)

    h = jnp.ones((rows, c.hidden_size), jnp.float32)
    jax.block_until_ready(run(params, h))  # compile

    def time_once() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(run(params, h))
        return (time.perf_counter() - t0) / repeat

    weights = sum(w.shape[0] * w.shape[1] for i in range(c.num_layers)
                  for part in ("attn", "mlp") for w in params[f"layer_{i}"][part].values())
    return time_once, 2.0 * rows * (weights + c.hidden_size * c.vocab_size)


def square_rate(dtype, n: int = 1024, repeat: int = 10) -> float:
    """FLOP/s of one n x n x n product on this device: a rate its kernels can reach."""
    a = jnp.ones((n, n), dtype)
    run = jax.jit(lambda a: jax.lax.fori_loop(0, repeat, lambda i, x: (x @ a) * 1e-3, a))
    jax.block_until_ready(run(a))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(run(a))
        best = min(best, (time.perf_counter() - t0) / repeat)
    return 2.0 * n ** 3 / best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_timing",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="3B,8B")
    p.add_argument("--cache-lengths", default=None,
                   help="KV buffer sizes (every call attends over the whole buffer; default "
                        "1024,4096, with --smoke 64,256)")
    p.add_argument("--block-size", default=None,
                   help="B of Linear-SS and Packed-SS, or several: 8,16,32 (default 32, with "
                        "--smoke 4)")
    p.add_argument("--quadratic-block-size", default=None,
                   help="B of Quadratic-SS, or several (default 8, with --smoke 3)")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--batch", default="1",
                   help="sequences per call, e.g. 1,2,4,8,16 (each call of a batched decode)")
    p.add_argument("--dtype", default=None, help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--bandwidth", type=float, default=None, help="bytes/s (default: by device)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, for a CPU check")
    p.add_argument("--products", action="store_true",
                   help="time the weight products alone, by rows (one row per sequence)")
    args = p.parse_args(argv)
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    dtype = args.dtype or ("bfloat16" if dev.platform == "gpu" else "float32")
    bw = args.bandwidth or next((v for k, v in BANDWIDTH.items() if k in kind), None)
    shapes = ["smoke"] if args.smoke else args.shapes.split(",")
    # --smoke picks tiny sizes for whatever is not given.
    lengths = _sizes(p, "--cache-lengths", args.cache_lengths or ("64,256" if args.smoke
                                                                    else "1024,4096"))
    block_sizes = _sizes(p, "--block-size", args.block_size or ("4" if args.smoke else "32"), 2)
    quadratic_sizes = _sizes(p, "--quadratic-block-size",
                             args.quadratic_block_size or ("3" if args.smoke else "8"), 2)
    print(f"device: {kind}, dtype {dtype}, peak bandwidth "
          f"{'unknown' if bw is None else f'{bw / 1e12:.2f} TB/s'}")
    try:
        batches = [int(x) for x in args.batch.split(",")]
    except ValueError:
        batches = [0]
    if min(batches) < 1:
        p.error(f"--batch: sequences per call must be integers >= 1, got {args.batch!r}")
    if args.products:
        return _products_table(shapes, dtype, batches, args.repeat)
    print("| model | call | batch | cache | ms / call | bound (ms) | call / bound |")
    print("|---|---|---|---|---|---|---|")
    t_start = time.monotonic()
    for shape in shapes:
        c = config(shape, dtype)
        params = model_lib.unstack_layers(model_lib.init_params(c, jax.random.PRNGKey(0)))
        nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
        bound = nbytes / bw if bw else float("nan")
        for L in lengths:
            for name, call, rows in calls(block_sizes, quadratic_sizes, c.mask_token_id):
                for n in batches:
                    t = time_call(c, params, call, rows, L, args.repeat, n)
                    size = f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
                    print(f"| {shape} ({size}) | {name} | {n} | {L} | {1e3 * t:.3f} | "
                          f"{1e3 * bound:.3f} | {t / bound:.2f} |", flush=True)
        del params
    print(f"\ntotal {time.monotonic() - t_start:.0f}s", file=sys.stderr)
    return 0


def _sizes(p, flag: str, spec: str, minimum: int = 1) -> list[int]:
    """'8,16,32' -> [8, 16, 32]; a usage error unless every size is an integer >= minimum."""
    parts = [x.strip() for x in spec.split(",")]
    if not all(x.isdigit() and int(x) >= minimum for x in parts):
        p.error(f"{flag}: sizes must be integers >= {minimum}, got {spec!r}")
    return [int(x) for x in parts]


def _products_table(shapes, dtype, batches, repeat: int, rounds: int = 5) -> int:
    """The products-only table. The row counts are timed in turn, `rounds` times, and the
    fastest of each is kept: a CPU shared with other work drifts by tens of percent within
    seconds, which a comparison of row counts timed one after the other would take in."""
    square = square_rate(jnp.dtype(dtype))
    print(f"one 1024 x 1024 x 1024 product: {square / 1e9:.0f} GFLOP/s")
    print(f"| model | rows | ms / call (products only) | GFLOP/s | x {batches[0]} rows |")
    print("|---|---|---|---|---|")
    for shape in shapes:
        c = config(shape, dtype)
        params = model_lib.unstack_layers(model_lib.init_params(c, jax.random.PRNGKey(0)))
        timers = {n: products(c, params, n, repeat) for n in batches}
        best = dict.fromkeys(batches, float("inf"))
        for _ in range(rounds):
            best = {n: min(best[n], timers[n][0]()) for n in batches}
        for n in batches:
            print(f"| {shape} | {n} | {1e3 * best[n]:.3f} | {timers[n][1] / best[n] / 1e9:.0f} | "
                  f"{best[n] / best[batches[0]]:.2f} |", flush=True)
        del params, timers
    return 0


if __name__ == "__main__":
    sys.exit(main())
