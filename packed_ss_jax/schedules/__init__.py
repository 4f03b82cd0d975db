"""The Nemotron-Labs-Diffusion schedules: one pure `step(state) -> state` each, how
each starts, and the decode program that runs them.

`build(m, program)` returns the pure function the driver (engine.py) compiles:
`run(params, prompt, n, limits, key) -> outcome`, the first call followed by
`lax.while_loop` over the schedule's step. The prompt length and the limits (length
limit, EOS id) are traced, so they never recompile.
"""

import jax
import numpy as np

from . import ar, linear, packed, quadratic
from .prefill import first_call, prefill

# name -> (first call, loop step). AR and Linear-SS start with a plain prefill;
# Packed-SS and Quadratic-SS draft a full block in their first call (App. E.2).
SCHEDULES = {
    "ar": (prefill, ar.step),
    "linear": (prefill, linear.step),
    "quadratic": (first_call, quadratic.step),
    "packed": (first_call, packed.step),
}


def parts(m, p):
    """The decode program of one program `p` in three pure pieces, `p.width` the block
    size B (1 for AR):

        start(params, prompt, n, limits, key) -> State   the first call
        step(params, State) -> State                     one loop iteration
        outcome(State) -> dict                           what the driver reads

    `build` runs them as one `lax.while_loop`; the batched driver (batched.py) runs
    `step` over a batch of states in one loop."""
    init, step_fn = SCHEDULES[p.schedule]
    B, sampler = p.width, p.sampler

    def start(params, prompt, n, limits, key):
        return init(m, params, prompt, n, B=B, capacity=p.capacity, max_new=limits["max_new"],
                    eos_id=limits["eos_id"], sampler=sampler, key=key)

    def step(params, s):
        return step_fn(m, params, s, B=B, sampler=sampler)

    def outcome(s):
        return dict(tokens=s.out, n_tokens=s.n_out, nfe=s.nfe, iterations=s.iterations,
                    accept_hist=s.hist, nonfinite_at=s.nonfinite_at)

    return start, step, outcome


def build(m, p):
    """The pure decode function of one program: the first call, then the loop."""
    start, step, outcome = parts(m, p)

    def run(params, prompt, n, limits, key):
        s = start(params, prompt, n, limits, key)
        s = jax.lax.while_loop(lambda s: ~s.done, lambda s: step(params, s), s)
        return outcome(s)

    return run


def limits(max_new: int, eos_id: int | None) -> dict:
    """The traced limits: the length limit and the EOS id (-1: no EOS stop)."""
    return {"max_new": np.int32(max_new), "eos_id": np.int32(-1 if eos_id is None else eos_id)}
