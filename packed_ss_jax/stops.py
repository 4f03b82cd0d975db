"""Stop markers, for every family: the traced marker table, its test on device, and the
text stops checked on the host.

A marker is a token-id sequence (EOS is the one-token marker); it counts once all its
tokens are accepted, and the output ends with the marker that ends earliest (App. E.2).
The table has a fixed shape (MAX_STOPS x MAX_STOP_LEN, lengths beside it), so new markers
never recompile. A stop given as text is also searched for in the decoded text after the
loop (`cut_text`): the model may spell the string with other tokens than the tokenizer's
own encoding (which the table holds), or across token boundaries, and the output must
still end at its earliest occurrence.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

import jax.numpy as jnp
import numpy as np

from . import validate
from .validate import InputError, InputTypeError

MAX_STOPS = 8       # stop markers per request (EOS included)
MAX_STOP_LEN = 16   # tokens per marker


def markers(stop_sequences) -> tuple:
    """The stop markers as a tuple, read once: a generator (any one-shot iterable) would be
    empty when read again, and the markers are read twice (the table, then the text
    stops). Strings are checked to be valid Unicode text."""
    if isinstance(stop_sequences, tuple) or stop_sequences is None:
        seqs = stop_sequences or ()
    elif (isinstance(stop_sequences, (str, bytes, bytearray, Mapping))
          or not isinstance(stop_sequences, Iterable)):
        # A bare string would become one marker per character.
        raise InputTypeError(f"stop_sequences must be a list of markers (strings or token-id "
                             f"lists), e.g. ['\\n\\n'] or [[13, 13]]; got {stop_sequences!r:.80}")
    else:  # an iterator may never end: read no more than can be refused
        seqs = tuple(itertools.islice(stop_sequences, MAX_STOPS + 1))
    if len(seqs) > MAX_STOPS:
        raise InputError(f"more than {MAX_STOPS} stop markers; at most {MAX_STOPS} (EOS "
                         "included)")
    for i, seq in enumerate(seqs):
        if isinstance(seq, str):
            validate.text(seq, f"stop sequence {i}")
    return seqs


def table(tokenizer, vocab: int, eos_id: int | None, stop_sequences) -> dict:
    """The traced marker table {stop_tok [K, Lm] (left-aligned), stop_len [K] (0: unused)}.

    A marker is a token-id list, or a string when a tokenizer is given (its encoding)."""
    seqs = markers(stop_sequences)
    if len(seqs) + (eos_id is not None) > MAX_STOPS:
        # Before reading any: a long list of markers costs nothing to refuse.
        raise InputError(f"{len(seqs) + (eos_id is not None)} stop markers (EOS included); "
                         f"at most {MAX_STOPS}")
    found = []
    for seq in seqs:
        if isinstance(seq, str):
            if tokenizer is None:
                raise InputError(f"stop sequence {seq!r} is a string but this model has no "
                                 "tokenizer; pass token ids")
            if not seq:
                raise InputError("empty stop sequence: every stop marker needs at least one "
                                 "character")
            seq = validate.encode(tokenizer, seq, add_special_tokens=False)
        if validate.is_int(seq):
            seq = [seq]
        elif isinstance(seq, Iterable) and not hasattr(seq, "__len__"):
            seq = list(itertools.islice(seq, MAX_STOP_LEN + 1))  # it may never end
        try:
            seq = validate.token_list(seq, "stop sequence")
        except InputTypeError:
            raise InputTypeError(f"stop sequence {seq!r:.80} must be integer token ids (or a "
                                 "string)") from None
        if not seq:
            raise InputError("empty stop sequence: every stop marker needs at least one token")
        if len(seq) > MAX_STOP_LEN:
            raise InputError(f"stop sequence of {len(seq)} tokens is longer than {MAX_STOP_LEN} "
                             "tokens")
        found.append(validate.id_array(seq, vocab, "stop sequence").tolist())
    if eos_id is not None:
        found.append([eos_id])
    tok = np.zeros((MAX_STOPS, MAX_STOP_LEN), np.int32)
    length = np.zeros(MAX_STOPS, np.int32)
    for i, seq in enumerate(found):
        tok[i, : len(seq)] = seq
        length[i] = len(seq)
    return {"stop_tok": tok, "stop_len": length}


def limits(tokenizer, vocab: int, max_new: int, eos_id: int | None, stop_sequences) -> dict:
    """A request's traced limits, the same for every family: the length limit and the
    stop-marker table (EOS included). A marker is a token-id list, or a string when a
    tokenizer is given; it counts once all its tokens are accepted, and the output ends
    with the earliest (App. E.2)."""
    return {"max_new": np.int32(max_new), **table(tokenizer, vocab, eos_id, stop_sequences)}


def of_request(tokenizer, vocab: int, max_new: int, eos_id: int | None,
               stop_sequences) -> tuple[dict, tuple[str, ...]]:
    """A request's `limits` and its stops given as `texts`, the markers read once (they
    may be an iterator)."""
    seqs = markers(stop_sequences)
    return limits(tokenizer, vocab, max_new, eos_id, seqs), texts(seqs)


def texts(stop_sequences) -> tuple[str, ...]:
    """The stops given as text (checked on the decoded text after the loop)."""
    return tuple(s for s in markers(stop_sequences) if isinstance(s, str))


# --- on device --------------------------------------------------------------------------------


def ends_in_new(out, n_tokens, new, count, stop_tok, stop_len):
    """[A] bool: a marker's last token is new[k] (k < count), for the output
    out[:n_tokens] + new[:count] (a prefix output: Nemotron's)."""
    A = new.shape[0]
    K, Lm = stop_tok.shape
    pos = n_tokens + jnp.arange(A)                              # position of new[k]
    j = jnp.arange(Lm)
    q = pos[:, None] - j[None, :]                            # [A, Lm] position j tokens back
    from_new = jnp.take(new, jnp.clip(q - n_tokens, 0, A - 1))
    from_out = jnp.take(out, jnp.clip(q, 0, out.shape[0] - 1))
    seq = jnp.where(q >= n_tokens, from_new, from_out)          # [A, Lm]
    # Marker i's token j back from its end: stop_tok[i, len_i - 1 - j].
    want = jnp.take_along_axis(stop_tok, jnp.clip(stop_len[:, None] - 1 - j[None, :], 0, Lm - 1),
                               axis=1)                       # [K, Lm]
    used = j[None, :] < stop_len[:, None]                    # [K, Lm]
    hit = (seq[:, None, :] == want[None]) & (q[:, None, :] >= 0)
    ok = jnp.all(hit | ~used[None], axis=-1) & (stop_len[None, :] > 0)  # [A, K]
    return jnp.any(ok, axis=-1) & (jnp.arange(A) < count)


# --- on the host ------------------------------------------------------------------------------


def find_text(text: str, strings) -> tuple[int, int] | None:
    """(start, end) of the stop string that ends earliest in `text` (None: none)."""
    best = None
    for s in strings:
        i = text.find(s)
        if i >= 0 and (best is None or i + len(s) < best[1]):
            best = (i, i + len(s))
    return best


def cut_text(decode, tokens: list[int], strings) -> tuple[list[int], str, int] | None:
    """The output cut at the earliest text stop: (tokens up to the one that completes it,
    the text up to the stop's end, where the stop starts in it); None when none occurs."""
    if not strings:
        return None
    text = decode(tokens)
    hit = find_text(text, strings)
    if hit is None:
        return None
    # The fewest tokens whose text holds a stop (decoded text grows with the tokens).
    lo, hi = 1, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if find_text(decode(tokens[:mid]), strings) is not None:
            hi = mid
        else:
            lo = mid + 1
    text = decode(tokens[:lo])
    start, end = find_text(text, strings)
    return tokens[:lo], text[:end], start


def _holdback(text: str, strings) -> int:
    """Characters at the end of `text` that may be the beginning of a stop string."""
    keep = 0
    for s in strings:
        for n in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:n]):
                keep = n
                break
    return keep


def shown(text: str, strings) -> int | None:
    """How many leading characters of a stream's `text` may be shown: all but an end
    that may begin a stop string; None once a stop string is in it (the output ends
    there, which only the whole decode's text settles)."""
    if find_text(text, strings) is not None:
        return None
    return len(text) - _holdback(text, strings)
