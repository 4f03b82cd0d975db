"""A family's decode program as a loop the host can run whole or in chunks.

Every family decodes the same way: a first call makes the loop state, then
`lax.while_loop` runs one schedule step until the state says done. `Loop` keeps those
parts apart so that one set of pieces gives

- `run(params, prompt, n, limits, key) -> outcome`: the first call and the whole loop in
  one program (what `decode` compiles);
- `start(params, prompt, n, limits, key) -> state`: the first call only;
- `resume(params, state, k) -> state`: the same loop body, stopping after at most `k`
  more iterations (`k` traced) or when done. The driver donates the state, so the KV
  cache stays where it lies between launches;
- `outcome(state) -> dict`: what `run` returns, from any finished state;
- `progress(state) -> (tokens, count, done)`: the output so far, for streaming: `count`
  leading entries of `tokens` are final (no later iteration changes or drops them).

`run` is `outcome(resume(params, start(...), infinity))`: the chunks execute the very
same steps on the very same state, so a chunked decode returns the one-shot tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Loop:
    init: Callable[..., Any]          # (params, prompt, n, limits, key) -> state
    step: Callable[[Any, Any], Any]   # (params, state) -> state, one schedule iteration
    outcome: Callable[[Any], dict]    # state -> the outcome dict
    progress: Callable[[Any], tuple]  # state -> (tokens, final count, done)

    def start(self, params, prompt, n, limits, key):
        return self.init(params, prompt, n, limits, key)

    def resume(self, params, state, k):
        """At most `k` more iterations of the loop, fewer if it finishes."""
        def cond(carry):
            s, i = carry
            return ~s.done & (i < k)

        def body(carry):
            s, i = carry
            return self.step(params, s), i + 1

        state, _ = jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
        return state

    def run(self, params, prompt, n, limits, key):
        s = self.init(params, prompt, n, limits, key)
        s = jax.lax.while_loop(lambda s: ~s.done, lambda s: self.step(params, s), s)
        return self.outcome(s)

    # A Loop is also the one-shot decode function itself.
    def __call__(self, params, prompt, n, limits, key):
        return self.run(params, prompt, n, limits, key)
