"""A family's decode program as the pieces every path runs.

Every family decodes the same way: a first call makes the loop state, then one
schedule step at a time until the state says done. `Loop` keeps those parts apart:

- `init(params, prompt, prompt_len, limits, key) -> state`: the first call;
- `step(params, state) -> state`: one iteration;
- `batch_step(params, state, plan) -> state` (sampled programs; None otherwise): the
  step given its batch's plan (`sampling.batch_plan`), for the vmapped step of a batch
  (batched.step_batch); `batch_init(params, prompt, prompt_len, limits, key, some_argmax)`
  likewise for a batch's first call, where it differs for greedy rows (batched.start_batch);
- `outcome(state) -> dict`: what a decode returns, from any state;
- `progress(state) -> (tokens, count, done)`: the output so far: `count` leading entries
  of `tokens` are final (no later iteration changes or drops them);
- `run(params, prompt, prompt_len, limits, key) -> outcome`: the first call and
  `lax.while_loop` over the step, in one program (what `Engine.decode` compiles).

The slot functions (batched.py) run the same `init` and `step` over slots, so every path
executes the very same steps on the same state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax


@dataclasses.dataclass(frozen=True)
class Loop:
    init: Callable[..., Any]          # (params, prompt, prompt_len, limits, key) -> state
    step: Callable[[Any, Any], Any]   # (params, state) -> state, one schedule iteration
    outcome: Callable[[Any], dict]    # state -> the outcome dict
    progress: Callable[[Any], tuple]  # state -> (tokens, final count, done)
    batch_step: Callable[..., Any] | None = None   # (params, state, plan) -> state
    batch_init: Callable[..., Any] | None = None   # init(..., key, some_argmax) -> state

    def run(self, params, prompt, prompt_len, limits, key):
        s = self.init(params, prompt, prompt_len, limits, key)
        s = jax.lax.while_loop(lambda s: ~s.done, lambda s: self.step(params, s), s)
        return self.outcome(s)

