"""Hooks for looking inside an engine's programs without decoding: `lower` (a request's
decode program lowered, to read its HLO, cost and memory, also for abstract weights) and
`forward` (one full forward with no cache, the parity hook behind `logits`)."""

from __future__ import annotations

import jax

from .engine import Engine, arguments, seeded
from .options import Request
from .programs import Key


def lower(engine: Engine, request: Request):
    """The decode program of a request, lowered for the model's params: arrays, or
    `jax.ShapeDtypeStruct`s to read a real-size program's HLO, cost and memory without
    allocating any weight."""
    run = seeded(engine.loop(request.program).run)
    return jax.jit(run).lower(engine.model.params, *arguments(request))


def forward(engine: Engine, tokens, positions, mask, draft_rows):
    """One full forward with no cache: (logits [T, V], kv)."""
    m = engine.model

    def full(params, tokens, positions, mask, draft_rows):
        return m.forward(params, tokens, positions, mask, m.empty_cache(0), 0, draft_rows)

    args = (tokens, positions, mask, draft_rows)
    exe, _ = engine.compile(Key("forward", rows=tokens.shape[0]), full, m.params, *args)
    return exe(m.params, *args)
