"""A roofline projection of decode steps at the Nemotron 3B and 8B shapes in bf16.

For each schedule (AR, Linear-SS, Quadratic-SS, Packed-SS) one loop step is compiled on
the CPU backend with abstract params (no weights are allocated) and XLA's cost analysis
gives its floating-point operations and bytes accessed. A step on a GPU cannot take less
than max(flops / peak bf16 rate, bytes / HBM bandwidth). Two byte counts give two
projections per call: XLA's (that of the CPU compilation's fusions: it counts the
attention scores' elementwise passes, and a row lookup as reading the whole embedding
table), and the least traffic a call needs, every weight and every live cache entry read
once ("minimal"; with the flops, the weight-streaming bound of a fused kernel).
Neither is a measurement: kernels reach a fraction of peak, and launch and host
overheads are left out.

The Packed-SS / Linear-SS throughput ratio is (tokens per NFE ratio) x (time per NFE
ratio): the time per NFE comes from the projection, the tokens per NFE from the paper
(see TOKENS_PER_NFE).

    python -m benchmarks.roofline                 # 3B and 8B, B = 32 (Quadratic-SS B = 8)
    python -m benchmarks.roofline --shapes tiny --live 64   # seconds, for a check
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from packed_ss_jax import families, options
from packed_ss_jax import model as model_lib
from packed_ss_jax.model import Model
from packed_ss_jax.nemotron.program import SCHEDULES
from tools.synthetic_checkpoint import SHAPES, model_config

# Published peak HBM bandwidth (bytes/s) and dense bf16 tensor-core rate (FLOP/s):
# NVIDIA A100 datasheet (80GB SXM: 2,039 GB/s; BF16 312 TFLOPS dense),
# NVIDIA H100 datasheet (SXM: 3.35 TB/s; BF16 989 TFLOPS dense, 1,979 with sparsity),
# NVIDIA H200 datasheet (SXM: 4.8 TB/s; BF16 989 TFLOPS dense, 1,979 with sparsity).
DEVICES = {
    "A100 80GB SXM": (2.039e12, 312e12),
    "H100 SXM": (3.35e12, 989e12),
    "H200": (4.8e12, 989e12),
}
# Tokens per NFE, Packed-SS over Linear-SS, greedy, B = 32 (paper Section 4: "a 13.4-20.3%
# increase in tokens per NFE" over the ten Nemotron 3B/8B settings; the per-task table
# values are not in the text). One absolute pair is (App. F.2, Tables 4-5): 8B, GSM8K,
# draft-only LoRA, 512-token cap: Packed-SS 274.2 tokens in 1 + 47.44 NFE (5.66 per NFE),
# Linear-SS 272.2 tokens in 1 + 2 x 27.02 NFE (4.95 per NFE), a ratio of 1.144.
TOKENS_PER_NFE = {"low": 1.134, "high": 1.203, "8B GSM8K LoRA": (274.2 / 48.44) / (272.2 / 55.04)}
# Model calls per loop step, and the block size each schedule runs at in the paper
# (Branched-SS, beyond it, at Packed-SS's, with its default two branches).
CALLS = {"ar": 1, "linear": 2, "quadratic": 1, "packed": 1, "branched": 1}
BLOCK = {"ar": 32, "linear": 32, "quadratic": 8, "packed": 32, "branched": 32}
ROWS = {"ar": "1", "linear": "32 + 32", "quadratic": "72", "packed": "64", "branched": "96"}


@dataclasses.dataclass
class StepCost:
    flops: float
    bytes: float         # XLA's count, per step
    weight_bytes: float
    cache_bytes: float   # the live cache entries, all layers, k and v
    calls: int

    def seconds(self, bandwidth: float, peak: float, minimal: bool = False) -> float:
        """Projected seconds per call (the roofline bound); `minimal`: with the least
        traffic a call needs instead of XLA's byte count."""
        traffic = (self.weight_bytes + self.cache_bytes) * self.calls if minimal else self.bytes
        return max(self.flops / peak, traffic / bandwidth) / self.calls


@contextlib.contextmanager
def full_attention():
    """Every cache slot read, whatever the backend: the cache here holds exactly the
    live length, so the count is that of attending over the live slots."""
    saved = model_lib.LIVE_ATTENTION
    model_lib.LIVE_ATTENTION = ()
    try:
        yield
    finally:
        model_lib.LIVE_ATTENTION = saved


def step_cost(shape: str, schedule: str, live: int, prompt: int = 16) -> StepCost:
    """XLA's cost analysis of one loop step with `live` cached slots (abstract params).

    The step is the one a decode compiles: the request's program (`DecodeOptions.check`), the
    family's loop of it (`build`), its state made by the loop's first call on a
    `prompt`-token prompt, with a cache of `live` slots in all (capacity plus one block of
    headroom)."""
    c = model_config(shape, "bfloat16")
    params = jax.eval_shape(model_lib.unstack_layers, model_lib.abstract_params(c))
    m = Model(config=c, params=params, source="abstract")
    family = families.of(c)
    checked = options.DecodeOptions(
        schedule=schedule, width=BLOCK[schedule], max_new_tokens=1, eos_id=None,
        cache_size=live - family.width(schedule, BLOCK[schedule])).check(family, c)
    program, limits = checked.program, checked.limits
    loop = family.build(m, program)
    state = jax.eval_shape(loop.init, params, jax.ShapeDtypeStruct((prompt,), jnp.int32),
                           jax.ShapeDtypeStruct((), jnp.int32), limits, jax.random.PRNGKey(0))
    with full_attention():
        exe = jax.jit(loop.step).lower(params, state).compile()
    cost = exe.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    weights = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    cache = 2 * c.num_layers * c.num_kv_heads * live * c.head_dim * 2
    return StepCost(float(cost["flops"]), float(cost["bytes accessed"]), float(weights),
                    float(cache), CALLS[schedule])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.roofline",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="3B,8B",
                   help=f"comma-separated, of {sorted(SHAPES)} (tiny: a check, in seconds)")
    p.add_argument("--live", type=int, default=1024,
                   help="cached slots each call attends over (prompt + tokens so far); more "
                        f"than the largest block size, {max(BLOCK.values())}")
    p.add_argument("--schedules", default=",".join(SCHEDULES),
                   help="comma-separated (the throughput ratios need linear and packed)")
    args = p.parse_args(argv)
    shapes = _names(p, "--shapes", args.shapes, SHAPES)
    schedules = _names(p, "--schedules", args.schedules, SCHEDULES)
    if args.live <= max(BLOCK.values()):
        p.error(f"--live {args.live}: the cache must hold more than a block "
                f"({max(BLOCK.values())} slots)")
    t0 = time.monotonic()
    costs = {(s, k): step_cost(s, k, args.live) for s in shapes for k in schedules}
    print(f"**Projection** (roofline bound, bf16, {args.live} cached slots; not a "
          "measurement). Per call: GFLOP and GB from XLA's cost analysis of one loop step; "
          "ms per call from XLA's bytes / from the minimal traffic (weights and live cache "
          "read once).\n")
    print("| model | schedule (rows/call) | GFLOP | GB (XLA) | GB (minimal) | "
          + " | ".join(f"{d} ms" for d in DEVICES) + " |")
    print("|---|---|---|---|---|" + "---|" * len(DEVICES))
    for (shape, sched), cost in costs.items():
        per_dev = [f"{1e3 * cost.seconds(bw, peak):.2f} / {1e3 * cost.seconds(bw, peak, True):.2f}"
                   for bw, peak in DEVICES.values()]
        print(f"| {shape} | {sched} ({ROWS[sched]}) | {cost.flops / cost.calls / 1e9:.0f} | "
              f"{cost.bytes / cost.calls / 1e9:.2f} | "
              f"{(cost.weight_bytes + cost.cache_bytes) / 1e9:.2f} | " + " | ".join(per_dev) + " |")
    if {"linear", "packed"} <= set(schedules):
        ratios(costs, shapes)
    print(f"\n({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0


def _names(p, flag: str, spec: str, allowed) -> list[str]:
    """'a,b' -> ['a', 'b'], each one of `allowed`; a usage error otherwise."""
    names = list(dict.fromkeys(x.strip() for x in spec.split(",") if x.strip()))
    if not names or any(x not in allowed for x in names):
        p.error(f"{flag}: expected one or more of {sorted(allowed)}, got {spec!r}")
    return names


def ratios(costs: dict, shapes: list[str]) -> None:
    """The Packed-SS / Linear-SS throughput table from the projected time per NFE."""
    print("\nPacked-SS / Linear-SS throughput = (tokens/NFE ratio) x (Linear-SS / Packed-SS "
          "time per NFE), projected with XLA's bytes / with the minimal traffic; tokens/NFE "
          "ratios from the paper (see TOKENS_PER_NFE):\n")
    print("| model | device | time/NFE ratio | "
          + " | ".join(f"throughput ratio at x{r:.3f} tokens/NFE" for r in TOKENS_PER_NFE.values())
          + " |")
    print("|---|---|---|" + "---|" * len(TOKENS_PER_NFE))
    for shape in shapes:
        for dev, (bw, peak) in DEVICES.items():
            linear, packed = costs[shape, "linear"], costs[shape, "packed"]
            speed = [linear.seconds(bw, peak, m) / packed.seconds(bw, peak, m)
                     for m in (False, True)]
            print(f"| {shape} | {dev} | {speed[0]:.3f} / {speed[1]:.3f} | "
                  + " | ".join(f"{r * speed[0]:.3f} / {r * speed[1]:.3f}"
                               for r in TOKENS_PER_NFE.values()) + " |")


if __name__ == "__main__":
    sys.exit(main())
