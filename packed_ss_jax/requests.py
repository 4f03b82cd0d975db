"""Checks of a decode request, shared by both families' decoders.

Every argument is checked (and normalised to a Python value) before anything is
allocated or compiled, so a careless call costs nothing and says what is wrong. NumPy
integers and floats are accepted wherever Python ones are (ids and sizes often come out
of arrays); booleans are refused where integers are expected (`True` is an `int` to
Python, never a sensible block size or token id).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from .sampling import Sampler

SEED_LIMIT = 2**32
# Positions, lengths and cache slots are int32 inside the programs; a cache past this
# would wrap them (it would not fit in memory either).
MAX_CACHE = 2**31 - 2**20


class InputError(ValueError):
    """A decode argument that cannot describe a request."""


class InputTypeError(InputError, TypeError):
    """A decode argument of the wrong type (also a TypeError, for callers that catch one)."""


def is_int(value) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def integer(value, name: str, minimum: int | None = None) -> int:
    """`value` as an int >= minimum; the message names the argument."""
    bound = "" if minimum is None else f" >= {minimum}"
    if not is_int(value):
        raise InputTypeError(f"{name} must be an integer{bound}, got {value!r}")
    if minimum is not None and value < minimum:
        raise InputError(f"{name} must be an integer{bound}, got {value!r}")
    return int(value)


def check_model(model) -> None:
    """Refuses anything that is not a model (a params dict, a path, None) up front."""
    needed = ("config", "params", "forward", "empty_cache", "vocab_size", "mask_id", "key")
    if all(hasattr(model, a) for a in needed):
        return
    got = type(model).__name__
    hint = ""
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        hint = f"; load the checkpoint first: model = packed_ss_jax.load({str(model)!r})"
    elif isinstance(model, Mapping):
        hint = ("; a params dict alone is not a model: wrap it as "
                "packed_ss_jax.Model(config=..., params=...)")
    raise InputTypeError(f"expected a packed_ss_jax.Model (from packed_ss_jax.load), "
                         f"got {got}{hint}")


def _number(value):
    if isinstance(value, (np.floating, np.integer)) and not isinstance(value, np.bool_):
        return value.item()
    return value


def sampler(temperature, top_k, top_p) -> Sampler:
    """The sampling settings; temperature 0 gives the one greedy program."""
    temperature, top_p = _number(temperature), _number(top_p)
    if is_int(top_k):
        top_k = int(top_k)
    try:
        s = Sampler(temperature, top_k, top_p)
    except (ValueError, TypeError) as e:
        raise InputError(str(e)) from None
    # Truncation does not change an argmax: every greedy request shares one program.
    return Sampler() if s.greedy else s


def seed(value) -> int:
    if not is_int(value) or not 0 <= value < SEED_LIMIT:
        raise InputError(f"seed must be an integer in [0, 2**32), got {value!r}")
    return int(value)


def seeds(values) -> np.ndarray:
    """A 1-D, non-empty array of seeds, each in [0, 2**32)."""
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"seeds must be a non-empty 1-D sequence of integers, got {values!r}")
    if arr.min() < 0 or arr.max() >= SEED_LIMIT:
        raise InputError("seeds must be integers in [0, 2**32)")
    return arr


def eos_id(value, config, vocab: int) -> int | None:
    """-1 (the config's EOS), None (no EOS stop) or a token id."""
    if value is None:
        return None
    if is_int(value) and value == -1:
        value = getattr(config, "eos_token_id", None)
        if value is not None and not 0 <= value < vocab:
            raise InputError(f"the config's eos_token_id {value} is outside the vocabulary "
                             f"[0, {vocab}); pass eos_id=None or a valid id")
        return value
    if not is_int(value):
        raise InputTypeError(f"eos_id must be a token id, -1 (the config's EOS) or None, "
                             f"got {value!r}")
    if not 0 <= value < vocab:
        raise InputError(f"eos_id {value} is outside the vocabulary [0, {vocab})")
    return int(value)


def cache_size(value, config, *, block: int, block_name: str, default: int) -> int:
    """KV slots (None: `default`), at least one block (`block` rows under `block_name`)."""
    if value is None:
        value = min(default, getattr(config, "max_position_embeddings", default))
    value = integer(value, "cache_size", 1)
    if value > MAX_CACHE:
        raise InputError(f"cache_size {value} is too large (at most {MAX_CACHE}: positions "
                         "are int32)")
    if block > value:
        raise InputError(f"{block_name} {block} does not fit the cache ({value} slots): use "
                         f"{block_name} <= {value} or a larger cache_size")
    return value


def fits(prompt_len: int, max_new: int, cache: int) -> None:
    if prompt_len + max_new > cache:
        raise InputError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new}) = "
                         f"{prompt_len + max_new} exceeds the cache ({cache} slots); "
                         "shorten the request or pass a larger cache_size")


def check_ids(ids: np.ndarray, vocab: int, what: str) -> None:
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.size:
        raise InputError(f"{what} contain ids outside the vocabulary [0, {vocab}): "
                         f"{sorted(set(bad.tolist()))[:10]}")


def token_list(seq, what: str) -> list[int]:
    """A sequence of integer token ids (a 1-D NumPy array included) as a list of ints."""
    if isinstance(seq, np.ndarray):
        if seq.ndim != 1:
            raise InputTypeError(f"{what} must be one sequence of token ids, got an array of "
                                 f"shape {seq.shape}")
    elif isinstance(seq, (str, bytes, Mapping, set, frozenset)) or not isinstance(seq, Iterable):
        # a string or bytes would be split into characters, a set has no order
        raise InputTypeError(f"{what} must be a sequence of integer token ids, got "
                             f"{type(seq).__name__}")
    ids = list(seq)
    bad = [t for t in ids if not is_int(t)]
    if bad:
        raise InputTypeError(f"{what} must be integer token ids, got {bad[0]!r}")
    return [int(t) for t in ids]


def prompt_ids(model, prompt) -> np.ndarray:
    """The prompt as int32 ids: text through the model's tokenizer, or token ids."""
    if isinstance(prompt, str):
        if getattr(model, "tokenizer", None) is None:
            raise InputError("prompt is a string but this model has no tokenizer; pass token ids")
        ids = model.tokenizer.encode(prompt).ids
    else:
        try:
            ids = token_list(prompt, "prompt")
        except InputTypeError as e:
            raise InputTypeError(f"prompt must be a string or a sequence of integer token ids "
                                 f"({e})") from None
    if not ids:
        raise InputError("prompt is empty: at least one token is needed")
    arr = np.asarray(ids, np.int64)
    check_ids(arr, model.vocab_size, "prompt")
    return arr.astype(np.int32)

