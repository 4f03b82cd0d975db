"""Public functions: `logits` (parity hook) and `decode` (every schedule)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import engine
from .sampling import Sampler
from .schedules import SCHEDULES

DEFAULT_CACHE_SIZE = 4096


@dataclasses.dataclass
class DecodeResult:
    tokens: list[int]        # generated ids, prompt excluded, EOS included if emitted
    nfe: int                 # forward passes, prompt processing included
    iterations: int          # decoder iterations, the first call included
    accept_hist: np.ndarray  # accept_hist[k]: iterations that appended k tokens
    wall_s: float            # decoder wall time (synchronised; compile excluded)
    compile_s: float         # compile time paid by this call (0 when already compiled)
    schedule: str
    block_size: int
    prompt_len: int
    text: str | None = None

    @property
    def tokens_per_nfe(self) -> float:
        return len(self.tokens) / self.nfe

    @property
    def time_per_nfe_ms(self) -> float:
        return 1e3 * self.wall_s / self.nfe

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else float("inf")


def logits(model, tokens, positions, mask, draft_rows=None) -> np.ndarray:
    """One full forward with no cache: tokens/positions [T], mask [T, T] -> [T, V] float32.

    `draft_rows` ([T] bool, optional) switches the draft-only adapter on for those rows.
    """
    tokens = np.asarray(tokens)
    positions = np.asarray(positions)
    mask = np.asarray(mask, bool)
    T = tokens.shape[0] if tokens.ndim == 1 else -1
    if tokens.ndim != 1 or positions.shape != (T,) or mask.shape != (T, T):
        raise ValueError(f"expected tokens [T], positions [T], mask [T, T]; got {tokens.shape}, "
                         f"{positions.shape}, {mask.shape}")
    _check_ids(tokens, model.vocab_size, "tokens")
    rows = np.zeros(T, bool) if draft_rows is None else np.asarray(draft_rows, bool)
    out, _ = _forward_nocache(model)(model.params, jnp.asarray(tokens, jnp.int32),
                                     jnp.asarray(positions, jnp.int32), jnp.asarray(mask),
                                     jnp.asarray(rows))
    return np.asarray(out, np.float32)


_nocache: dict = {}


def _forward_nocache(model):
    if model.key not in _nocache:
        _nocache[model.key] = jax.jit(
            lambda p, t, pos, m, r: model.forward(p, t, pos, m, model.empty_cache(0), 0, r))
    return _nocache[model.key]


def _check_ids(ids: np.ndarray, vocab: int, what: str):
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.size:
        raise ValueError(f"{what} contain ids outside the vocabulary [0, {vocab}): "
                         f"{sorted(set(bad.tolist()))[:10]}")


def _prompt_ids(model, prompt) -> np.ndarray:
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise ValueError("prompt is a string but this model has no tokenizer; pass token ids")
        ids = model.tokenizer.encode(prompt).ids
    else:
        ids = list(prompt)
        if any(isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) for t in ids):
            raise TypeError("prompt must be a string or a sequence of integer token ids")
    if not ids:
        raise ValueError("prompt is empty: at least one token is needed")
    ids = np.asarray(ids, np.int64)
    _check_ids(ids, model.vocab_size, "prompt")
    return ids.astype(np.int32)


def decode(model, prompt: str | Sequence[int], *, schedule: str = "packed",
           block_size: int | None = None, max_new_tokens: int = 128, eos_id: int | None = -1,
           temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           seed: int = 0, cache_size: int | None = None, window: int | None = None,
           order: str = "ltr", stop_sequences: Sequence = ()) -> DecodeResult:
    """Decoding with one schedule: "ar", "linear", "quadratic" or "packed".

    temperature 0 is greedy (the speculative schedules return exactly the AR argmax
    tokens). temperature > 0 samples exactly from the AR model's tempered, top-k /
    top-p truncated distribution (speculative rejection sampling); `seed` makes a run
    reproducible.

    block_size: B >= 2 (speculative width W = B - 1); default the config's block size
                (ignored by "ar").
    eos_id:     stop at the first accepted EOS; -1 (default) uses the config's EOS,
                None disables EOS stopping.
    cache_size: KV slots for prompt + output (default min(4096, max positions)); it
                is part of the compiled shape, so keep it fixed across calls.
    SetDLM models (config.family "setdlm") take `window` (W >= 1), `order` ("ltr" or
    "confidence") and `stop_sequences` (multi-token markers) instead of `block_size`, and
    the schedules "packed", "linear", "quadratic", "native" and "serial"; they sample
    (temperature > 0) with order "ltr" and the schedules other than "native"; see
    `packed_ss_jax.setdlm.decode.decode`.
    """
    if getattr(getattr(model, "config", None), "family", None) == "setdlm":
        return _setdlm(model, prompt, locals())
    if window is not None or order != "ltr" or stop_sequences:
        raise ValueError("window, order and stop_sequences apply to SetDLM models only; "
                         "this model decodes with block_size")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {sorted(SCHEDULES)}")
    sampler = Sampler(temperature, top_k, top_p)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    if sampler.greedy:
        sampler = Sampler()  # truncation does not change an argmax: one greedy program
    config = getattr(model, "config", None)
    if block_size is None:
        block_size = getattr(config, "block_size", 8)
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 2:
        raise ValueError(f"block_size must be an integer >= 2, got {block_size!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if eos_id == -1:
        eos_id = getattr(config, "eos_token_id", None)
    if eos_id is not None and not 0 <= eos_id < model.vocab_size:
        raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {model.vocab_size})")
    if cache_size is None:
        cache_size = min(DEFAULT_CACHE_SIZE, getattr(config, "max_position_embeddings",
                                                     DEFAULT_CACHE_SIZE))
    ids = _prompt_ids(model, prompt)
    if len(ids) + max_new_tokens > cache_size:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = "
                         f"{len(ids) + max_new_tokens} exceeds the cache ({cache_size} slots); "
                         "shorten the request or pass a larger cache_size")
    B = 1 if schedule == "ar" else int(block_size)
    raw = engine.run(model, model.params, ids, schedule=schedule, block_size=B,
                     max_new=int(max_new_tokens), eos_id=eos_id, capacity=int(cache_size),
                     sampler=sampler, seed=int(seed))
    tokens = raw.tokens.tolist()
    text = model.tokenizer.decode(tokens) if getattr(model, "tokenizer", None) is not None else None
    return DecodeResult(tokens=tokens, nfe=raw.nfe, iterations=raw.iterations,
                        accept_hist=raw.accept_hist, wall_s=raw.wall_s, compile_s=raw.compile_s,
                        schedule=schedule, block_size=B, prompt_len=len(ids), text=text)


def _setdlm(model, prompt, args):
    """SetDLM has its own layouts and schedules (packed_ss_jax.setdlm); sampling is LTR only."""
    from .setdlm.decode import decode as setdlm_decode

    if args["block_size"] is not None:
        raise ValueError("SetDLM models take window= (W), not block_size")
    return setdlm_decode(model, prompt, schedule=args["schedule"], window=args["window"],
                         order=args["order"], stop_sequences=args["stop_sequences"],
                         max_new_tokens=args["max_new_tokens"], eos_id=args["eos_id"],
                         cache_size=args["cache_size"], temperature=args["temperature"],
                         top_k=args["top_k"], top_p=args["top_p"], seed=args["seed"])
