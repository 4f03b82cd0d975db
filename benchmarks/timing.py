"""Split decoder wall time into model execution and non-model decoder work (paper F.3).

The decode runs as one XLA program, so the split is measured by replay: every call
type a schedule makes (same layout, same shapes, same cache buffer) is timed on its
own, K times inside one jitted loop (a data dependency between iterations keeps XLA
from hoisting it), and a decode's model time is the sum over its calls. The rest of
the wall time (acceptance, sampling, cache commits, stopping, loop control) is the
non-model decoder work.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from packed_ss_jax import layouts

REPEAT = 16


def _calls(model, schedule: str, B: int, bucket: int, capacity: int):
    """{call name: (layout, cache slots, out_rows)} for one schedule, as the engine makes them."""
    m, W = model.mask_id, B - 1
    x, c = jnp.int32(1), jnp.int32(bucket)
    draft = jnp.full(W, 2, jnp.int32)
    prompt = jnp.ones(bucket, jnp.int32)
    n = jnp.int32(bucket)
    cache = capacity + B
    calls = {
        "prefill": (layouts.prefill(prompt), 0, (n - 1)[None]),
        "first_call": (layouts.first_call(prompt, n, B, m), 0,
                       jnp.concatenate([(n - 1)[None], bucket + 1 + jnp.arange(W)])),
        "single": (layouts.single(x, c), cache, None),
        "draft": (layouts.draft_block(x, c, B, m), cache, jnp.arange(1, B)),
        "verify": (layouts.verify(x, draft, c), cache, None),
        "packed": (layouts.packed(x, draft, c, m), cache,
                   jnp.concatenate([jnp.arange(B), B + 1 + jnp.arange(W)])),
        "quadratic": (layouts.quadratic(x, draft, c, m), cache, None),
    }
    wanted = {"ar": ["prefill", "single"], "linear": ["prefill", "draft", "verify"],
              "packed": ["prefill", "first_call", "draft", "packed"],
              "quadratic": ["prefill", "first_call", "draft", "quadratic"]}[schedule]
    return {k: calls[k] for k in wanted}


def time_forward(forward, params, call, cache, cache_len, out_rows, repeat: int = REPEAT) -> float:
    """Seconds per call of `forward` on one layout: `repeat` calls inside one jitted loop,
    best of three. Each call's input depends on the previous output, so XLA cannot hoist
    the call out of the loop."""

    @jax.jit
    def run(params, tokens, cache, cache_len):
        def body(i, carry):
            tokens, acc = carry
            logits, _ = forward(params, tokens, call.positions, call.mask, cache, cache_len,
                                call.draft_rows, out_rows)
            flag = (logits[0, 0] > 1e30).astype(jnp.int32)
            return tokens.at[0].add(flag), acc + logits[0, 0]
        return jax.lax.fori_loop(0, repeat, body, (tokens, jnp.float32(0)))

    args = (params, call.tokens, cache, jnp.int32(cache_len))
    jax.block_until_ready(run(*args))  # compile
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best


_cost_cache: dict = {}


def call_costs(model, schedule: str, B: int, bucket: int, capacity: int) -> dict[str, float]:
    """Seconds per call of each call type of a schedule."""
    key = (model.key, schedule, B, bucket, capacity)
    if key not in _cost_cache:
        _cost_cache[key] = {
            name: time_forward(model.forward, model.params, call, model.empty_cache(slots),
                               min(slots, 1), rows)
            for name, (call, slots, rows) in _calls(model, schedule, B, bucket, capacity).items()}
    return _cost_cache[key]


def call_counts(schedule: str, nfe: int, iterations: int, greedy: bool) -> dict[str, int]:
    """How many calls of each type a decode made (from its NFE and iterations)."""
    if schedule == "ar":
        return {"prefill": 1, "single": nfe - 1}
    if schedule == "linear":
        return {"prefill": 1, "draft": (nfe - 1) // 2, "verify": (nfe - 1) // 2}
    step = {"packed": "packed", "quadratic": "quadratic"}[schedule]
    if greedy:
        return {"first_call": 1, step: iterations - 1}
    # sampling: prefill, then (unless the first token ended it) a drafting call
    return {"prefill": 1, "draft": nfe - iterations, step: iterations - 1}


def model_time(costs: dict[str, float], counts: dict[str, int]) -> float:
    return float(sum(costs[k] * n for k, n in counts.items() if n))
