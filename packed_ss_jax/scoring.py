"""Scoring a sequence: the log-probability of each token given the ones before it, left
to right, from one verifier forward over the whole sequence (the family's `score`
layout), with the most likely tokens at each position. These are the AR model's
log-probabilities, the same whatever schedule decoded the sequence; the server's
`logprobs` and `echo` are this. One program per length bucket (a power of two), compiled
by the model's engine."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from . import options, validate
from .engine import Engine, to_host
from .programs import Key

MAX_TOP = 20   # the most likely tokens reported per position (OpenAI's limit)


@dataclasses.dataclass
class Scores:
    """`score` of a sequence (host arrays, one entry per token)."""

    logp: np.ndarray       # [n] log p(token i | tokens < i); NaN at 0
    top_ids: np.ndarray    # [n, top] the most likely tokens at each position, best first
    top_logp: np.ndarray   # [n, top] their log-probabilities


def score(engine: Engine, ids, top: int = 0) -> Scores:
    """The log-probability of every token of `ids` (int ids) given the ones before it, and
    the `top` most likely tokens at each position; entry 0 predicts nothing (NaN)."""
    ids = np.asarray(ids, np.int32)
    n = int(ids.shape[0])
    top = validate.integer(top, "top", 0, MAX_TOP)
    padded = np.zeros(bucket(n), np.int32)
    padded[:n] = ids
    exe = _program(engine, padded.shape[0])
    logp, top_ids, top_logp = map(np.array, to_host(exe(engine.model.params,
                                                        *engine.place((padded,)))))
    logp[0] = np.nan
    return Scores(logp[:n], top_ids[:n, :top], top_logp[:n, :top])


def bucket(n: int) -> int:
    """The padded length a sequence of n ids is scored at."""
    return options.bucket_for(n, validate.MAX_CACHE)


def _program(engine: Engine, length: int):
    m, family = engine.model, engine.family
    vocab = m.config.vocab_size

    def scores(params, tokens):
        call, rows = family.score(tokens, m.config)
        logits, _ = m.forward(params, call.tokens, call.positions, call.mask,
                              m.empty_cache(0), 0, call.draft_rows, jnp.asarray(rows))
        logp = jax.nn.log_softmax(logits[:, :vocab].astype(jnp.float32), axis=-1)
        top_logp, top_ids = jax.lax.top_k(logp, MAX_TOP)
        return jnp.take_along_axis(logp, tokens[:, None], 1)[:, 0], top_ids, top_logp

    exe, _ = engine.compile(Key("score", rows=length), scores, m.params,
                            *engine.place((np.zeros(length, np.int32),)))
    return exe
