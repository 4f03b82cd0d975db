"""The Nemotron-Labs-Diffusion schedules: one pure `step(state) -> state` each, how
each starts, and the decode program that runs them.

`build(m, program)` returns the `Loop` (loop.py) the engine compiles: `run(params,
prompt, prompt_len, limits, key) -> outcome`, the first call followed by
`lax.while_loop` over the schedule's step, or its pieces over slots (batched.py).
The prompt length and the limits (length limit, stop markers with EOS) are traced, so
they never recompile.
"""


import functools

from ..loop import Loop
from .schedules import ar, branched, linear, packed, quadratic
from .prefill import first_call, prefill

# name -> (first call, loop step). AR and Linear-SS start with a plain prefill;
# Packed-SS and Quadratic-SS draft a full block in their first call (App. E.2).
SCHEDULES = {
    "ar": (prefill, ar.step),
    "linear": (prefill, linear.step),
    "quadratic": (first_call, quadratic.step),
    "packed": (first_call, packed.step),
    "branched": (first_call, branched.step),   # Packed-SS plus branches (`branches`)
}


def iteration_rows(schedule: str, B: int, branches: int = 1) -> tuple[int, ...]:
    """The rows of each call of one loop iteration (the static shapes the layouts build:
    what a call costs, however few of its rows are live)."""
    return {"ar": (1,), "linear": (B, B), "packed": (2 * B,), "quadratic": (B * (B + 1),),
            "branched": ((branches + 1) * B,)}[schedule]


def build(m, program) -> Loop:
    """The decode loop of one program; `program.width` is the block size B (1 for AR)."""
    first, step = SCHEDULES[program.schedule]
    B, sampling = program.width, program.sampling
    if program.schedule == "branched":
        step = functools.partial(step, branches=program.branches)

    def init(params, prompt, n, limits, key, some_argmax=None):
        sampler = sampling.bind(limits["temperature"], limits["top_p"])
        if some_argmax is not None:
            sampler = sampler.replace(some_argmax=some_argmax)
        s = first(m, params, prompt, n, B=B, capacity=program.capacity,
                  max_new=limits["max_new"], stop_tok=limits["stop_tok"],
                  stop_len=limits["stop_len"], sampler=sampler, key=key)
        if some_argmax is None:
            return s
        return s.replace(sampler=s.sampler.replace(some_argmax=None))  # the state's own

    def sampler_of(s):
        return sampling.bind(None, None) if sampling.greedy else s.sampler

    def outcome(s):
        return dict(tokens=s.out, n_tokens=s.n_tokens, nfe=s.nfe, iterations=s.iterations,
                    accept_hist=s.accept_hist, nonfinite_at=s.nonfinite_at, stopped=s.stopped)

    def batch_step(params, s, plan):
        return step(m, params, s, B=B, sampler=s.sampler.replace(plan=plan))

    return Loop(init=init, step=lambda params, s: step(m, params, s, B=B, sampler=sampler_of(s)),
                outcome=outcome, progress=lambda s: (s.out, s.n_tokens, s.done),
                batch_step=None if sampling.greedy else batch_step,
                batch_init=None if sampling.greedy else init)
