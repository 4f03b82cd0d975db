"""Public functions: `logits` (parity hook) and `decode` (every schedule)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import engine, requests
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
    requests.check_model(model)
    tokens = np.asarray(tokens)
    positions = np.asarray(positions)
    mask = np.asarray(mask, bool)
    T = tokens.shape[0] if tokens.ndim == 1 else -1
    if tokens.ndim != 1 or positions.shape != (T,) or mask.shape != (T, T):
        raise ValueError(f"expected tokens [T], positions [T], mask [T, T]; got {tokens.shape}, "
                         f"{positions.shape}, {mask.shape}")
    requests.check_ids(tokens, model.vocab_size, "tokens")
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
    requests.check_model(model)
    if getattr(getattr(model, "config", None), "family", None) == "setdlm":
        return _setdlm(model, prompt, locals())
    if window is not None or order != "ltr" or stop_sequences:
        raise requests.InputError("window, order and stop_sequences apply to SetDLM models "
                                  "only; this model decodes with block_size")
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise requests.InputError(f"unknown schedule {schedule!r}; expected one of "
                                  f"{sorted(SCHEDULES)}")
    sampler = requests.sampler(temperature, top_k, top_p)
    seed = requests.seed(seed)
    config = getattr(model, "config", None)
    if block_size is None:
        block_size = getattr(config, "block_size", 8)
    block_size = requests.integer(block_size, "block_size", 2)
    max_new_tokens = requests.integer(max_new_tokens, "max_new_tokens", 1)
    eos_id = requests.eos_id(eos_id, config, model.vocab_size)
    B = 1 if schedule == "ar" else block_size
    cache_size = requests.cache_size(cache_size, config, block=B, block_name="block_size",
                                     default=DEFAULT_CACHE_SIZE)
    ids = requests.prompt_ids(model, prompt)
    requests.fits(len(ids), max_new_tokens, cache_size)
    raw = engine.run(model, model.params, ids, schedule=schedule, block_size=B,
                     max_new=max_new_tokens, eos_id=eos_id, capacity=cache_size,
                     sampler=sampler, seed=seed)
    tokens = raw.tokens.tolist()
    text = model.tokenizer.decode(tokens) if getattr(model, "tokenizer", None) is not None else None
    return DecodeResult(tokens=tokens, nfe=raw.nfe, iterations=raw.iterations,
                        accept_hist=raw.accept_hist, wall_s=raw.wall_s, compile_s=raw.compile_s,
                        schedule=schedule, block_size=B, prompt_len=len(ids), text=text)


def _setdlm(model, prompt, args):
    """SetDLM has its own layouts and schedules (packed_ss_jax.setdlm); sampling is LTR only."""
    from .setdlm.decode import decode as setdlm_decode

    if args["block_size"] is not None:
        raise requests.InputError("SetDLM models take window= (W), not block_size")
    return setdlm_decode(model, prompt, schedule=args["schedule"], window=args["window"],
                         order=args["order"], stop_sequences=args["stop_sequences"],
                         max_new_tokens=args["max_new_tokens"], eos_id=args["eos_id"],
                         cache_size=args["cache_size"], temperature=args["temperature"],
                         top_k=args["top_k"], top_p=args["top_p"], seed=args["seed"])
