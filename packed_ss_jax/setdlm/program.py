"""The SetDLM decode program: the prompt call, then `lax.while_loop` over one schedule step.

`build(m, program)` returns the pure function the driver (engine.py) compiles:
`run(params, prompt, n, limits, key) -> outcome`. The prompt length, the length limit
and the stop markers (`limits`: the length limit and a fixed-size table of markers, EOS
included) are traced, so they never recompile.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from .. import cache as cache_lib
from .. import layouts as base_layouts
from .. import requests
from ..requests import InputError, InputTypeError
from ..sampling import StoredQ
from .schedules import SCHEDULES
from .state import State

ORDERS = ("ltr", "confidence")
MAX_STOPS = 8       # stop markers per request (EOS included)
MAX_STOP_LEN = 16   # tokens per marker


def start(m, params, prompt, n, *, p, max_new, stop_tok, stop_len, key) -> State:
    """The prompt call (1 NFE): a causal pass that fills the cache (App. E.2)."""
    W, P = p.width, prompt.shape[0]
    call = base_layouts.prefill(prompt)
    _, kv = m.forward(params, call.tokens, call.positions, call.mask, m.empty_cache(0), 0,
                      call.draft_rows, jnp.zeros(1, jnp.int32))
    # Headroom past `capacity` keeps every commit of up to 1 + 2W rows in range.
    S, C = p.capacity + 2 * W + 2, p.capacity + W
    cache = cache_lib.commit(m.empty_cache(S), kv, jnp.arange(P), 0)
    Np = W if p.schedule == "native" else 1
    iters = 2 * p.capacity + 2  # E or the unresolved count below E drops every iteration
    sampled = {} if p.sampler.greedy else dict(
        key=key, q=StoredQ.empty(p.sampler, W, m.vocab_size), q_out=jnp.full(W, -1, jnp.int32))
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


def parts(m, p):
    """The decode program in three pure pieces, `start(params, prompt, n, limits, key)
    -> State`, `step(params, State) -> State` and `outcome(State) -> dict` (see
    schedules.parts for the Nemotron family's)."""
    step_fn = SCHEDULES[p.schedule]

    def begin(params, prompt, n, limits, key):
        return start(m, params, prompt, n, p=p, max_new=limits["max_new"],
                     stop_tok=limits["stop_tok"], stop_len=limits["stop_len"], key=key)

    def step(params, s):
        return step_fn(m, params, s, W=p.width, order=p.order, sampler=p.sampler)

    def outcome(s):
        return dict(tokens=s.tok, n_tokens=s.E, nfe=s.nfe, iterations=s.iterations,
                    accept_hist=s.hist, nonfinite_at=s.nonfinite_at, rows=s.rows,
                    max_rows=s.max_rows, trace_order=s.trace_out, trace_accepted=s.trace_A,
                    trace_fed=s.trace_fed)

    return begin, step, outcome


def build(m, p):
    """The pure decode function of one program (see the module doc)."""
    begin, step, outcome = parts(m, p)

    def run(params, prompt, n, limits, key):
        s = begin(params, prompt, n, limits, key)
        s = jax.lax.while_loop(lambda s: ~s.done, lambda s: step(params, s), s)
        return outcome(s)

    return run


def limits(tokenizer, vocab: int, max_new: int, eos_id: int | None, stop_sequences) -> dict:
    """The traced limits: the length limit and the stop-marker table (EOS included).

    A marker is a token-id list, or a string when a tokenizer is given; it counts once
    all its tokens are accepted, and the output ends with the earliest (App. E.2)."""
    if stop_sequences is None:
        stop_sequences = ()
    if isinstance(stop_sequences, (str, bytes)) or not isinstance(stop_sequences, Iterable):
        # A bare string would become one marker per character.
        raise InputTypeError(f"stop_sequences must be a list of markers (strings or token-id "
                             f"lists), e.g. ['\\n\\n'] or [[13, 13]]; got {stop_sequences!r}")
    markers = []
    for seq in stop_sequences:
        if isinstance(seq, str):
            if tokenizer is None:
                raise InputError(f"stop sequence {seq!r} is a string but this model has no "
                                 "tokenizer; pass token ids")
            seq = tokenizer.encode(seq, add_special_tokens=False).ids
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
        requests.check_ids(np.asarray(seq, np.int64), vocab, "stop sequence")
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
    return {"max_new": np.int32(max_new), "stop_tok": tok, "stop_len": length}
