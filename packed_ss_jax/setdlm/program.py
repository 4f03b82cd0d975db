"""The SetDLM decode program: the prompt call, then `lax.while_loop` over one schedule step.

`build(m, program)` returns the `Loop` (loop.py) the engine compiles: `run(params,
prompt, prompt_len, limits, key) -> outcome`, or its pieces over slots (batched.py). The
prompt length, the length limit and the stop markers (`limits`: the
length limit and a fixed-size table of markers, EOS included, see stops.py) are traced,
so they never recompile.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from .. import cache as cache_lib
from .. import calls
from ..loop import Loop
from ..reductions import leading_true
from ..sampling import StoredQ
from .schedules import SCHEDULES
from .state import State

ORDERS = ("ltr", "confidence")


def prompt_call(m, params, prompt, n, *, program, max_new, stop_tok, stop_len, sampler,
                key) -> State:
    """The prompt call (1 NFE): a causal pass that fills the cache (App. E.2)."""
    W, P = program.width, prompt.shape[0]
    _, kv = calls.run_call(m, params, calls.prefill(prompt), m.empty_cache(0), 0,
                           jnp.zeros(1, jnp.int32))
    # Headroom past `capacity` keeps every commit of up to 1 + 2W rows in range.
    S, out_len = program.capacity + 2 * W + 2, program.capacity + W
    cache = cache_lib.commit(m.empty_cache(S), kv, jnp.arange(P), 0)
    Np = W if program.schedule == "native" else 1
    iters = 2 * program.capacity + 2  # E or the unresolved count below E drops every iteration
    sampled = {} if sampler.greedy else dict(
        key=key, q=StoredQ.empty(sampler, W, m.vocab_size), q_out=jnp.full(W, -1, jnp.int32),
        sampler=sampler)
    return State(
        cache=cache, cache_len=jnp.asarray(n, jnp.int32), position_out=jnp.full(S, -1, jnp.int32),
        n=jnp.asarray(n, jnp.int32), tok=jnp.zeros(out_len, jnp.int32), res=jnp.zeros(out_len, bool),
        draft=jnp.zeros(out_len, jnp.int32), has_draft=jnp.zeros(out_len, bool),
        score=jnp.full(out_len, -jnp.inf, jnp.float32), pend_tok=jnp.zeros(Np, jnp.int32),
        pend_out=jnp.full(Np, -1, jnp.int32), pend_n=jnp.int32(0),
        E=jnp.asarray(max_new, jnp.int32), stop_tok=stop_tok, stop_len=stop_len,
        done=jnp.bool_(False), nfe=jnp.int32(1), iterations=jnp.int32(0), rows=jnp.int32(0),
        max_rows=jnp.int32(0), accept_hist=jnp.zeros(W + 1, jnp.int32),
        trace_out=jnp.full((iters, W), -1, jnp.int32), trace_A=jnp.zeros(iters, jnp.int32),
        trace_fed=jnp.zeros(iters, jnp.int32), **sampled)


def iteration_rows(schedule: str, W: int, branches: int = 1) -> tuple[int, ...]:
    """The rows of each call of one loop iteration (the static shapes the layouts build:
    what a call costs, however few of its rows are live)."""
    return {"serial": (2,), "native": (2 * W,), "linear": (1 + W, 2 * W),
            "packed": (1 + 3 * W,), "quadratic": (1 + 2 * W + W * W,),
            "branched": (1 + (2 + branches) * W,)}[schedule]


def build(m, program) -> Loop:
    """The decode loop of one program (see the module doc)."""
    step = SCHEDULES[program.schedule]
    if program.schedule == "branched":
        step = functools.partial(step, branches=program.branches)

    def init(params, prompt, n, limits, key):
        sampler = program.sampling.bind(limits["temperature"], limits["top_p"])
        return prompt_call(m, params, prompt, n, program=program, max_new=limits["max_new"],
                           stop_tok=limits["stop_tok"], stop_len=limits["stop_len"],
                           sampler=sampler, key=key)

    def sampler_of(s):
        return program.sampling.bind(None, None) if program.sampling.greedy else s.sampler

    def outcome(s):
        return dict(tokens=s.tok, n_tokens=s.E, nfe=s.nfe, iterations=s.iterations,
                    accept_hist=s.accept_hist, nonfinite_at=s.nonfinite_at, stopped=s.stopped,
                    rows=s.rows, max_rows=s.max_rows, trace_order=s.trace_out,
                    trace_accepted=s.trace_A, trace_fed=s.trace_fed)

    def progress(s):
        # The resolved prefix is final: a stop marker completed later ends past it (its
        # tokens are not all in the prefix), so E never shrinks below it.
        return s.tok, jnp.minimum(leading_true(s.res), s.E), s.done

    def batch_step(params, s, plan):
        return step(m, params, s, W=program.width, order=program.order,
                    sampler=s.sampler.replace(plan=plan))

    return Loop(init=init, outcome=outcome, progress=progress,
                step=lambda params, s: step(m, params, s, W=program.width, order=program.order,
                                            sampler=sampler_of(s)),
                batch_step=None if program.sampling.greedy else batch_step)
