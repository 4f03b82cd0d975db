"""The Nemotron-Labs-Diffusion schedules: one pure `step(state) -> state` each, how
each starts, and the decode program that runs them.

`build(m, program)` returns the `Loop` (loop.py) the driver (engine.py) compiles:
`run(params, prompt, n, limits, key) -> outcome`, the first call followed by
`lax.while_loop` over the schedule's step, or the same in chunks (`start`, `resume`).
The prompt length and the limits (length limit, stop markers with EOS) are traced, so
they never recompile.
"""

import numpy as np

from .. import stops
from ..loop import Loop
from .schedules import ar, linear, packed, quadratic
from .prefill import first_call, prefill

# name -> (first call, loop step). AR and Linear-SS start with a plain prefill;
# Packed-SS and Quadratic-SS draft a full block in their first call (App. E.2).
SCHEDULES = {
    "ar": (prefill, ar.step),
    "linear": (prefill, linear.step),
    "quadratic": (first_call, quadratic.step),
    "packed": (first_call, packed.step),
}


def build(m, p) -> Loop:
    """The decode loop of one program; `p.width` is the block size B (1 for AR)."""
    first, step = SCHEDULES[p.schedule]
    B, sampler = p.width, p.sampler

    def init(params, prompt, n, limits, key):
        return first(m, params, prompt, n, B=B, capacity=p.capacity, max_new=limits["max_new"],
                     stop_tok=limits["stop_tok"], stop_len=limits["stop_len"], sampler=sampler,
                     key=key)

    def outcome(s):
        return dict(tokens=s.out, n_tokens=s.n_out, nfe=s.nfe, iterations=s.iterations,
                    accept_hist=s.hist, nonfinite_at=s.nonfinite_at)

    return Loop(init=init, step=lambda params, s: step(m, params, s, B=B, sampler=sampler),
                outcome=outcome, progress=lambda s: (s.out, s.n_out, s.done))


def limits(tokenizer, vocab: int, max_new: int, eos_id: int | None, stop_sequences) -> dict:
    """The traced limits: the length limit and the stop-marker table, EOS included."""
    return {"max_new": np.int32(max_new), **stops.table(tokenizer, vocab, eos_id, stop_sequences)}
