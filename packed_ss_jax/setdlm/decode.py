"""SetDLM decode driver: the prompt call, then `lax.while_loop` over one schedule step.

One program per (model config, schedule, W, order, prompt bucket, cache size, sampler)
is compiled ahead of time through the engine's cache; the prompt length, the length
limit, the stop markers and the seed are traced arguments, so they never recompile.
temperature 0 runs the greedy steps (setdlm.schedules); temperature > 0 the exact
LTR sampling steps (setdlm.sampled).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import cache as cache_lib
from .. import engine
from .. import layouts as base_layouts
from .. import requests
from ..api import DecodeResult
from ..requests import InputError, InputTypeError
from ..sampling import Sampler
from .sampled import SAMPLED, empty_q
from .schedules import SCHEDULES
from .state import State

ORDERS = ("ltr", "confidence")
MAX_STOPS = 8       # stop markers per request (EOS included)
MAX_STOP_LEN = 16   # tokens per marker


@dataclasses.dataclass(frozen=True)
class Program:
    schedule: str
    window: int
    order: str
    bucket: int
    capacity: int
    sampler: Sampler = Sampler()


@dataclasses.dataclass
class SetDLMResult(DecodeResult):
    window: int = 0
    order: str = "ltr"
    rows: int = 0                  # uncached rows evaluated after the prompt call
    max_rows: int = 0              # most rows in one call after the prompt call
    orders: list = dataclasses.field(default_factory=list)    # pi_t per iteration
    accepted: list = dataclasses.field(default_factory=list)  # A_t per iteration
    # Accepted tokens each iteration leaves to be fed as clean rows in the next call
    # (the correction, p_{t+1}; for "native" every committed token).
    fed: list = dataclasses.field(default_factory=list)


def start(m, params, prompt, n, *, p: Program, max_new, stop_tok, stop_len, seed=0) -> State:
    """The prompt call (1 NFE): a causal pass that fills the cache (App. E.2)."""
    W, P = p.window, prompt.shape[0]
    call = base_layouts.prefill(prompt)
    _, kv = m.forward(params, call.tokens, call.positions, call.mask, m.empty_cache(0), 0,
                      call.draft_rows, jnp.zeros(1, jnp.int32))
    # Headroom past `capacity` keeps every commit of up to 1 + 2W rows in range.
    cache = cache_lib.commit(m.empty_cache(p.capacity + 2 * W + 2), kv, jnp.arange(P), 0)
    S, C = p.capacity + 2 * W + 2, p.capacity + W
    Np = W if p.schedule == "native" else 1
    iters = 2 * p.capacity + 2  # E or the unresolved count below E drops every iteration
    sampled = {} if p.sampler.greedy else dict(
        key=jax.random.PRNGKey(seed), q=empty_q(p.sampler, W, m.vocab_size),
        q_out=jnp.full(W, -1, jnp.int32))
    return State(
        cache=cache, cache_len=jnp.asarray(n, jnp.int32), slot_out=jnp.full(S, -1, jnp.int32),
        n=jnp.asarray(n, jnp.int32), tok=jnp.zeros(C, jnp.int32), res=jnp.zeros(C, bool),
        draft=jnp.zeros(C, jnp.int32), has_draft=jnp.zeros(C, bool),
        score=jnp.full(C, -jnp.inf, jnp.float32), pend_tok=jnp.zeros(Np, jnp.int32),
        pend_out=jnp.full(Np, -1, jnp.int32), pend_n=jnp.int32(0),
        E=jnp.asarray(max_new, jnp.int32), stop_tok=stop_tok, stop_len=stop_len,
        done=jnp.bool_(False), nfe=jnp.int32(1), iterations=jnp.int32(0), rows=jnp.int32(0),
        max_rows=jnp.int32(0), hist=jnp.zeros(W + 1, jnp.int32),
        trace_out=jnp.full((iters, W), -1, jnp.int32), trace_A=jnp.zeros(iters, jnp.int32),
        trace_fed=jnp.zeros(iters, jnp.int32), **sampled)


def build(m, p: Program):
    W, order, sampler = p.window, p.order, p.sampler

    def run(params, prompt, n, max_new, stop_tok, stop_len, seed):
        s = start(m, params, prompt, n, p=p, max_new=max_new, stop_tok=stop_tok,
                  stop_len=stop_len, seed=seed)
        if sampler.greedy:
            step = lambda s: SCHEDULES[p.schedule](m, params, s, W=W, order=order)  # noqa: E731
        else:
            step = lambda s: SAMPLED[p.schedule](m, params, s, W=W, sampler=sampler)  # noqa: E731
        s = jax.lax.while_loop(lambda s: ~s.done, step, s)
        return (s.tok, s.E, s.nfe, s.iterations, s.rows, s.max_rows, s.hist, s.trace_out,
                s.trace_A, s.trace_fed, s.nonfinite_at)

    return run


def _stop_table(model, stop_sequences, eos_id):
    if stop_sequences is None:
        stop_sequences = ()
    if isinstance(stop_sequences, (str, bytes)) or not isinstance(stop_sequences, Iterable):
        # A bare string would become one marker per character.
        raise InputTypeError(f"stop_sequences must be a list of markers (strings or token-id "
                             f"lists), e.g. ['\\n\\n'] or [[13, 13]]; got {stop_sequences!r}")
    markers = []
    for seq in stop_sequences:
        if isinstance(seq, str):
            if model.tokenizer is None:
                raise InputError(f"stop sequence {seq!r} is a string but this model has no "
                                 "tokenizer; pass token ids")
            seq = model.tokenizer.encode(seq, add_special_tokens=False).ids
        if requests.is_int(seq):
            seq = [seq]
        try:
            seq = requests.token_list(seq, "stop sequence")
        except InputTypeError:
            raise InputTypeError(f"stop sequence {seq!r} must be integer token ids (or a "
                                 "string)") from None
        if not seq:
            raise InputError("empty stop sequence: every stop marker needs at least one token")
        if len(seq) > MAX_STOP_LEN:
            raise InputError(f"stop sequence of {len(seq)} tokens is longer than {MAX_STOP_LEN}")
        requests.check_ids(np.asarray(seq, np.int64), model.vocab_size, "stop sequence")
        markers.append(seq)
    if eos_id is not None:
        markers.append([eos_id])
    if len(markers) > MAX_STOPS:
        raise InputError(f"{len(markers)} stop markers (EOS included); at most {MAX_STOPS}")
    tok = np.zeros((MAX_STOPS, MAX_STOP_LEN), np.int32)
    length = np.zeros(MAX_STOPS, np.int32)
    for i, seq in enumerate(markers):
        tok[i, : len(seq)] = seq
        length[i] = len(seq)
    return jnp.asarray(tok), jnp.asarray(length)


def _prepare(model, prompt, *, schedule, window, order, stop_sequences, max_new_tokens, eos_id,
             cache_size, temperature, top_k, top_p):
    """Validated arguments: the program, its traced arguments (seed excluded) and the prompt."""
    requests.check_model(model)
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise InputError(f"unknown schedule {schedule!r} for SetDLM; expected one of "
                         f"{sorted(SCHEDULES)}")
    if not isinstance(order, str) or order not in ORDERS:
        raise InputError(f"unknown order {order!r}; expected one of {ORDERS}")
    if order != "ltr" and schedule in ("native", "serial"):
        raise InputError(f"schedule {schedule!r} has no verification order; use order='ltr'")
    sampler = requests.sampler(temperature, top_k, top_p)
    if not sampler.greedy:
        if schedule not in SAMPLED:
            raise InputError(f"schedule {schedule!r} is greedy only: temperature must be 0; "
                             f"sampling is supported by {sorted(SAMPLED)}")
        if order != "ltr":
            raise InputError("any-order sampling is not supported: temperature > 0 needs "
                             "order='ltr'")
    config = model.config
    W = requests.integer(config.block_size if window is None else window, "window", 1)
    if schedule == "serial":
        W = 1
    max_new = requests.integer(max_new_tokens, "max_new_tokens", 1)
    eos_id = requests.eos_id(eos_id, config, model.vocab_size)
    stop_tok, stop_len = _stop_table(model, stop_sequences, eos_id)
    cache_size = requests.cache_size(cache_size, config, block=W, block_name="window",
                                     default=4096)
    ids = requests.prompt_ids(model, prompt)
    requests.fits(len(ids), max_new, cache_size)
    p = Program(schedule, W, order, engine.bucket_for(len(ids), cache_size), cache_size, sampler)
    padded = np.zeros(p.bucket, np.int32)
    padded[: len(ids)] = ids
    args = (jnp.asarray(padded), jnp.int32(len(ids)), jnp.int32(max_new), stop_tok, stop_len)
    return p, args, ids


def decode(model, prompt: str | Sequence[int], *, schedule: str = "packed",
           window: int | None = None, order: str = "ltr",
           stop_sequences: Sequence[Sequence[int] | str] = (), max_new_tokens: int = 128,
           eos_id: int | None = -1, cache_size: int | None = None, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None,
           seed: int = 0) -> SetDLMResult:
    """SetDLM decoding (see `packed_ss_jax.decode`).

    schedule: "packed", "linear", "quadratic", "native" (the release's threshold
              decoder) or "serial" (one token per call, the reference).
    window:   W >= 1, the active window (default: the checkpoint's desired block size).
    order:    "ltr" or "confidence" (App. E.6); "native" and "serial" are LTR only.
    stop_sequences: markers (token-id lists, or strings with a tokenizer); one counts once
              all its tokens are accepted, and the output ends with the earliest (E.2).
    eos_id:   a one-token marker; -1 (default) uses the config's EOS, None disables it.
    temperature, top_k, top_p: 0 is greedy; > 0 samples exactly from the tempered,
              truncated SetDLM AR conditional (MASK excluded), LTR order only, with the
              schedules "packed", "linear", "quadratic" and "serial"; `seed` reproduces
              a run.
    """
    p, args, ids = _prepare(model, prompt, schedule=schedule, window=window, order=order,
                            stop_sequences=stop_sequences, max_new_tokens=max_new_tokens,
                            eos_id=eos_id, cache_size=cache_size, temperature=temperature,
                            top_k=top_k, top_p=top_p)
    args = args + (jnp.asarray(requests.seed(seed), jnp.uint32),)
    W = p.window
    exe, compile_s = engine.aot(("setdlm", model.key, p), build(model, p), model.params, *args)
    t0 = time.perf_counter()
    out = jax.block_until_ready(exe(model.params, *args))
    wall = time.perf_counter() - t0
    tok, E, nfe, iters, rows, max_rows, hist, trace_out, trace_A, trace_fed, bad_at = \
        jax.device_get(out)
    engine.check_finite(bad_at, iters, tok)
    E, iters = int(E), int(iters)
    tokens = tok[:E].tolist()
    text = model.tokenizer.decode(tokens) if getattr(model, "tokenizer", None) is not None else None
    orders = [[int(o) for o in row if o >= 0] for row in trace_out[:iters]]
    return SetDLMResult(
        tokens=tokens, nfe=int(nfe), iterations=iters, accept_hist=np.asarray(hist),
        wall_s=wall, compile_s=compile_s, schedule=schedule, block_size=W + 1,
        prompt_len=len(ids), text=text, window=W, order=order, rows=int(rows),
        max_rows=int(max_rows), orders=orders, accepted=[int(a) for a in trace_A[:iters]],
        fed=[int(f) for f in trace_fed[:iters]])


def run_many(model, prompt: Sequence[int], seeds, **kwargs):
    """Many independent samples of one prompt in one call: the decode vmapped over seeds.

    Takes `decode`'s keyword arguments (seed excluded); returns tokens [N, C] and the
    output lengths [N]. Row i equals `decode(..., seed=seeds[i]).tokens`.
    """
    p, args, _ = _prepare(model, prompt, **{
        "schedule": "packed", "window": None, "order": "ltr", "stop_sequences": (),
        "max_new_tokens": 128, "eos_id": -1, "cache_size": None, "temperature": 0.0,
        "top_k": None, "top_p": None, **kwargs})
    seeds = requests.seeds(seeds)
    many = jax.vmap(build(model, p), in_axes=(None,) * 6 + (0,))
    args = args + (jnp.asarray(seeds, jnp.uint32),)
    exe, _ = engine.aot(("setdlm", model.key, p, "many", len(seeds)), many, model.params, *args)
    out = jax.device_get(exe(model.params, *args))
    tok, E, iters, bad_at = out[0], out[1], out[3], out[-1]
    engine.check_finite(bad_at, iters, tok)
    return np.asarray(tok), np.asarray(E)
