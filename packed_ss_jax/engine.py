"""The decode driver: first call, then `lax.while_loop` over one schedule step.

One program per (model config, schedule, B, prompt bucket, cache size, sampler) is
lowered and compiled ahead of time and kept; the prompt length, `max_new_tokens`,
the EOS id and the seed are traced arguments, so they never recompile. Nothing
returns to the host until the loop has stopped.

A loop that read NaN or Inf logits stops there and reports where (see
schedules/state.py, setdlm/state.py); `check_finite` turns that into a
`NonFiniteError` on the host, for every family and schedule.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

from .sampling import Sampler
from .schedules import SCHEDULES

MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Program:
    schedule: str
    block_size: int
    bucket: int
    capacity: int
    sampler: Sampler = Sampler()


@dataclasses.dataclass
class RawResult:
    tokens: np.ndarray
    nfe: int
    iterations: int
    accept_hist: np.ndarray
    wall_s: float
    compile_s: float


_compiled: dict[tuple[Hashable, Program], Callable] = {}


class NonFiniteError(FloatingPointError, ValueError):
    """The decode loop read NaN or Inf logits and stopped: the model's weights or the
    prompt's embeddings hold non-finite numbers. `tokens` holds the tokens generated
    before that point (each chosen from finite logits)."""

    def __init__(self, iteration: int, position: int, tokens: list[int]):
        self.iteration, self.position, self.tokens = iteration, position, tokens
        super().__init__(
            f"non-finite logits (NaN or Inf) in decoder iteration {iteration}, at generated "
            f"position {position}: the model's weights or the prompt's embeddings hold NaN "
            f"or Inf, so decoding stopped there ({position} tokens generated before it)")

    def __reduce__(self):
        return type(self), (self.iteration, self.position, self.tokens)


def check_finite(nonfinite_at, iterations, tokens) -> None:
    """Raises NonFiniteError if the loop stopped on non-finite logits (`nonfinite_at`:
    the generated position, -1 when every logits row it read was finite). With a leading
    sample axis (vmapped decodes), for the first sample that stopped."""
    at = np.asarray(nonfinite_at)
    if at.ndim:
        bad = np.flatnonzero(at >= 0)
        if bad.size:
            i = bad[0]
            check_finite(at[i], np.asarray(iterations)[i], np.asarray(tokens)[i])
        return
    if at >= 0:
        raise NonFiniteError(int(iterations), int(at), [int(t) for t in np.asarray(tokens)[:at]])


def bucket_for(n: int, capacity: int) -> int:
    """Prompt length rounded up to a power of two (at least MIN_BUCKET, at most capacity)."""
    b = MIN_BUCKET
    while b < n:
        b *= 2
    return min(b, capacity)


def build(m, p: Program) -> Callable:
    """The pure decode function of one program (not yet jitted)."""
    init, step = SCHEDULES[p.schedule]
    B = p.block_size

    sampler = p.sampler

    def run(params, prompt, n, max_new, eos_id, seed):
        key = jax.random.PRNGKey(seed)
        s = init(m, params, prompt, n, B=B, capacity=p.capacity, max_new=max_new, eos_id=eos_id,
                 sampler=sampler, key=key)
        s = jax.lax.while_loop(lambda s: ~s.done,
                               lambda s: step(m, params, s, B=B, sampler=sampler), s)
        return s.out, s.n_out, s.nfe, s.iterations, s.hist, s.nonfinite_at

    return run


def _args(prompt_ids: np.ndarray, bucket: int, max_new: int, eos_id: int | None, seed=0):
    padded = np.zeros(bucket, np.int32)
    padded[: len(prompt_ids)] = prompt_ids
    return (jnp.asarray(padded), jnp.int32(len(prompt_ids)), jnp.int32(max_new),
            jnp.int32(-1 if eos_id is None else eos_id), jnp.asarray(seed, jnp.uint32))


def compiled(m, params, p: Program) -> tuple[Callable, float]:
    """The compiled program and the seconds spent compiling it now (0.0 when cached)."""
    return aot((m.key, p), build(m, p), params, *_args(np.zeros(1, np.int32), p.bucket, 1, None))


def clear_cache() -> None:
    _compiled.clear()


def aot(key: Hashable, fn: Callable, *args) -> tuple[Callable, float]:
    """`fn` lowered and compiled for `args` once per hashable `key` (every decode program,
    of any family, goes through here); returns it and the seconds spent compiling now."""
    if key in _compiled:
        return _compiled[key], 0.0
    t0 = time.perf_counter()
    exe = jax.jit(fn).lower(*args).compile()
    _compiled[key] = exe
    return exe, time.perf_counter() - t0


def run(m, params, prompt_ids: np.ndarray, *, schedule: str, block_size: int, max_new: int,
        eos_id: int | None, capacity: int, sampler: Sampler = Sampler(), seed: int = 0) -> RawResult:
    p = Program(schedule, block_size, bucket_for(len(prompt_ids), capacity), capacity, sampler)
    exe, compile_s = compiled(m, params, p)
    args = _args(prompt_ids, p.bucket, max_new, eos_id, seed)
    t0 = time.perf_counter()
    out = jax.block_until_ready(exe(params, *args))
    wall = time.perf_counter() - t0
    tokens, n_out, nfe, iterations, hist, nonfinite_at = jax.device_get(out)
    check_finite(nonfinite_at, iterations, tokens)
    return RawResult(tokens=np.asarray(tokens[:n_out]), nfe=int(nfe), iterations=int(iterations),
                     accept_hist=np.asarray(hist), wall_s=wall, compile_s=compile_s)


def run_many(m, params, prompt_ids: np.ndarray, seeds: np.ndarray, *, schedule: str,
             block_size: int, max_new: int, eos_id: int | None, capacity: int,
             sampler: Sampler) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Many independent samples of one prompt in one call: the decode vmapped over seeds.

    Returns tokens [N, capacity], lengths [N], nfe [N]. Row i equals `run(..., seed=seeds[i])`;
    raises NonFiniteError as `run` does if any sample met non-finite logits.
    """
    p = Program(schedule, block_size, bucket_for(len(prompt_ids), capacity), capacity, sampler)
    many = jax.vmap(build(m, p), in_axes=(None, None, None, None, None, 0))
    args = _args(prompt_ids, p.bucket, max_new, eos_id)[:-1] + (jnp.asarray(seeds, jnp.uint32),)
    exe, _ = aot((m.key, p, "many", len(seeds)), many, params, *args)
    out, n_out, nfe, iterations, _, nonfinite_at = jax.device_get(exe(params, *args))
    check_finite(nonfinite_at, iterations, out)
    return np.asarray(out), np.asarray(n_out), np.asarray(nfe)
