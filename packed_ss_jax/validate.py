"""The checks of the values a decode request is made of, one value at a time: integers,
text, the sampling settings, seeds, EOS, the cache size, token ids and prompts (how the
options combine is checked once, by `options.DecodeOptions.check`).

Every argument is checked (and normalised to a Python value) before anything is
allocated or compiled, so a careless call costs nothing and says what is wrong. NumPy
integers and floats are accepted wherever Python ones are (ids and sizes often come out
of arrays); booleans are refused where integers are expected (`True` is an `int` to
Python, never a sensible block size or token id).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np

from .sampling import Sampler

SEED_LIMIT = 2**32
# Positions, lengths and cache positions are int32 inside the programs; a cache past this
# would wrap them (it would not fit in memory either).
MAX_CACHE = 2**31 - 2**20
INT32_MAX = 2**31 - 1
# The smallest normal float32. A top_p below it is 0 or subnormal once the program holds
# it as a float32 (XLA's CPU backend flushes subnormals to 0); every such top_p keeps the
# most likely token alone, as this one does, so they all share its program.
TOP_P_TINY = float(np.finfo(np.float32).tiny)


class InputError(ValueError):
    """A decode argument that cannot describe a request. `param`: the name of the argument
    (the request field) it is about, where one is: "temperature", "stop_sequences",
    "max_new_tokens", "prompt", "block_size", ..."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class InputTypeError(InputError, TypeError):
    """A decode argument of the wrong type (also a TypeError, for callers that catch one)."""


@contextlib.contextmanager
def about(param: str):
    """InputErrors raised inside without a `param` are about `param` (the checks of a
    value that do not know which argument holds it: a stop marker's ids, a template's
    keywords)."""
    try:
        yield
    except InputError as e:
        if e.param is None:
            e.param = param
        raise


def is_int(value) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def integer(value, name: str, minimum: int | None = None, maximum: int | None = None,
            why: str = "") -> int:
    """`value` as an int in [minimum, maximum]; the message names the argument, and for a
    value past `maximum`, `why` that is the bound."""
    bound = "" if minimum is None else f" >= {minimum}"
    if not is_int(value):
        raise InputTypeError(f"{name} must be an integer{bound}, got {value!r}", name)
    if minimum is not None and value < minimum:
        raise InputError(f"{name} must be an integer{bound}, got {value!r}", name)
    if maximum is not None and value > maximum:
        raise InputError(f"{name} {value} is too large: at most {maximum}"
                         + (f" ({why})" if why else ""), name)
    return int(value)


def text(value: str, what: str, param: str | None = None) -> str:
    """`value` if it is valid Unicode text. A lone surrogate (what a JSON "\\ud800" escape or
    invalid UTF-8 on a command line decodes to) cannot be encoded, so no tokenizer or
    template can take it: refused here with the place (`what`) named."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{what} is not valid Unicode text: a lone surrogate "
                         f"(U+{ord(value[e.start]):04X}) at character {e.start}",
                         param) from None
    return value


def encode(tokenizer, value: str, *, add_special_tokens: bool = True) -> list[int]:
    """The ids of `value`. Through `encode_batch`, which lets go of the GIL while it
    works: a long prompt tokenized on a server's worker thread does not stall its event
    loop (`encode` holds the GIL throughout)."""
    return tokenizer.encode_batch([value], add_special_tokens=add_special_tokens)[0].ids


def check_model(model) -> None:
    """Refuses anything that is not a model (a params dict, a path, None) up front."""
    needed = ("config", "params", "forward", "empty_cache", "vocab_size", "mask_id",
              "program_key")
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
                         f"got {got}{hint}", "model")


def _number(value):
    if isinstance(value, (np.floating, np.integer)) and not isinstance(value, np.bool_):
        return value.item()
    return value


def sampler(temperature, top_k, top_p) -> Sampler:
    """The sampling settings; temperature 0 gives the one greedy program."""
    temperature, top_p = _number(temperature), _number(top_p)
    if is_int(top_k):
        top_k = integer(top_k, "top_k", 1, INT32_MAX, "an int32; any top_k at least the "
                                                      "vocabulary keeps every token")
    try:
        s = Sampler(temperature, top_k, top_p)
    except (ValueError, TypeError) as e:   # its message starts with the argument's name
        name = next((n for n in ("temperature", "top_k", "top_p") if str(e).startswith(n)),
                    None)
        raise InputError(str(e), name) from None
    # Truncation does not change an argmax: every greedy request shares one program.
    if s.greedy:
        return Sampler()
    if s.top_p is not None and s.top_p < TOP_P_TINY:
        s = dataclasses.replace(s, top_p=TOP_P_TINY)
    return s


def seed(value) -> int:
    if not is_int(value) or not 0 <= value < SEED_LIMIT:
        raise InputError(f"seed must be an integer in [0, 2**32), got {value!r}", "seed")
    return int(value)


def seeds(values, name: str = "seeds") -> np.ndarray:
    """A 1-D, non-empty uint32 array of seeds, each in [0, 2**32). Each is checked as a
    Python value first: NumPy would raise OverflowError on a seed past int64, or turn a
    list mixing -1 and 2**63 into floats."""
    if isinstance(values, np.ndarray) and values.ndim != 1:
        raise InputError(f"{name} must be a non-empty 1-D sequence of integers, got an array "
                         f"of shape {values.shape}", name)
    if (isinstance(values, (str, bytes, Mapping, set, frozenset))
            or not isinstance(values, Iterable)):
        raise InputError(f"{name} must be a non-empty 1-D sequence of integers, got "
                         f"{values!r:.80}", name)
    values = list(values)
    if not values:
        raise InputError(f"{name} must be a non-empty 1-D sequence of integers, got none",
                         name)
    for i, v in enumerate(values):
        if not is_int(v) or not 0 <= v < SEED_LIMIT:
            raise InputError(f"{name}[{i}] must be an integer in [0, 2**32), got {v!r:.80}",
                             name)
    return np.asarray([int(v) for v in values], np.uint32)


def check_ids(ids: np.ndarray, vocab: int, what: str) -> None:
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.size:
        raise InputError(f"{what}: ids outside the vocabulary [0, {vocab}): "
                         f"{sorted(set(bad.tolist()))[:10]}", what)


def id_array(ids: list[int], vocab: int, what: str, param: str | None = None) -> np.ndarray:
    """Python int ids as an int32 array, each checked against the vocabulary first (an id
    past int64, e.g. 2**70, would make NumPy raise OverflowError)."""
    bad = sorted({t for t in ids if not 0 <= t < vocab})
    if bad:
        raise InputError(f"{what}: ids outside the vocabulary [0, {vocab}): {bad[:10]}", param)
    return np.asarray(ids, np.int32)


def token_list(seq, what: str, param: str | None = None) -> list[int]:
    """A sequence of integer token ids (a 1-D NumPy array included) as a list of ints."""
    if isinstance(seq, np.ndarray):
        if seq.ndim != 1:
            raise InputTypeError(f"{what} must be one sequence of token ids, got an array of "
                                 f"shape {seq.shape}", param)
    elif isinstance(seq, (str, bytes, Mapping, set, frozenset)) or not isinstance(seq, Iterable):
        # a string or bytes would be split into characters, a set has no order
        raise InputTypeError(f"{what} must be a sequence of integer token ids, got "
                             f"{type(seq).__name__}", param)
    ids = list(seq)
    bad = [t for t in ids if not is_int(t)]
    if bad:
        raise InputTypeError(f"{what} must be integer token ids, got {bad[0]!r}", param)
    return [int(t) for t in ids]


def prompt_ids(model, prompt, where: str = "") -> np.ndarray:
    """The prompt as int32 ids: text through the model's tokenizer, or token ids. `where`
    starts the messages (a batch's "prompts[3]: ")."""
    if isinstance(prompt, str):
        if getattr(model, "tokenizer", None) is None:
            raise InputError(f"{where}prompt is a string but this model has no tokenizer; pass "
                             "token ids", "prompt")
        ids = encode(model.tokenizer, text(prompt, f"{where}prompt", "prompt"))
    else:
        # A generator or other one-shot iterable of prompts is no batch (it could be read
        # once only): say so where its items are not ids.
        hint = "" if isinstance(prompt, (list, tuple, np.ndarray)) else (
            "; a batch of prompts must be a list")
        try:
            ids = token_list(prompt, "prompt")
        except InputTypeError as e:
            raise InputTypeError(f"{where}prompt must be a string or a sequence of integer "
                                 f"token ids ({e}){hint}", "prompt") from None
    if not ids:
        raise InputError(f"{where}prompt is empty: at least one token is needed", "prompt")
    return id_array(ids, model.vocab_size, f"{where}prompt", "prompt")


def prompt_list(prompts) -> list:
    """A batch's prompts as a list, read once: a list or tuple of prompts (strings or
    token-id sequences), a 2-D array (one prompt a row) or another iterable of prompts (a
    generator). A string or bytes would be split into one-character prompts, a set or a
    dict has no order, and a list of ids is one prompt: all refused."""
    name = type(prompts).__name__
    if isinstance(prompts, (str, bytes, bytearray)):
        raise InputTypeError(f"prompts must be a list of prompts, got a {name} (it would be "
                             f"decoded one character at a time): pass [prompt] for one prompt",
                             "prompts")
    if isinstance(prompts, np.ndarray):
        if prompts.ndim != 2:
            raise InputTypeError(f"prompts must be a list of prompts or a 2-D array of token "
                                 f"ids (one prompt a row), got an array of shape {prompts.shape}",
                                 "prompts")
        items = list(prompts)
    elif isinstance(prompts, (Mapping, set, frozenset)) or not isinstance(prompts, Iterable):
        raise InputTypeError(f"prompts must be a list of prompts (strings or token-id lists), "
                             f"got {name}" + (" (no order)" if isinstance(
                                 prompts, (Mapping, set, frozenset)) else ""), "prompts")
    else:
        items = list(prompts)
    if not items:
        raise InputError("prompts must be a non-empty list of prompts, got none", "prompts")
    if any(is_int(p) for p in items):
        raise InputTypeError("prompts must be a list of prompts, got token ids: pass [ids] "
                             "for one prompt", "prompts")
    return items


def seeds_for(value, n: int) -> list[int]:
    """One seed per prompt: `value` one seed for all, or the list of one per prompt."""
    if is_int(value):
        return [seed(value)] * n
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InputError(f"seed must be an integer in [0, 2**32) or a list of one per prompt, "
                         f"got {value!r:.80}", "seed")
    values = [int(x) for x in seeds(value, "seed")]
    if len(values) != n:
        raise InputError(f"seed: {len(values)} seeds for {n} prompts; give one seed or one "
                         "per prompt", "seed")
    return values
