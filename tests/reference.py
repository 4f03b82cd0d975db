"""Plain Python-loop references of the schedules, with no cache and no jit.

Every call is run as one whole forward over `[verified prefix minus its last token
(causal) ; the call's rows]`, built from the layouts of SPEC.md with NumPy, and all
bookkeeping (matching, stopping, the next draft) is done in Python following
Algorithm 1 line by line. The engine must agree on tokens, NFE, iterations and the
per-iteration emitted counts.
"""

from __future__ import annotations

import numpy as np

import packed_ss_jax as ps
from packed_ss_jax.nemotron import layouts

PAD_TO = 128


def _call(model, prefix, tokens, positions, mask, draft_rows):
    """Logits of the call rows, the prefix acting as the cache (every row sees all of it)."""
    P, T = len(prefix), len(tokens)
    full = np.zeros((P + T, P + T), bool)
    full[:P, :P] = np.tril(np.ones((P, P), bool))
    full[P:, :P] = True
    full[P:, P:] = mask
    # Pad to a fixed row count so one compiled forward serves every call; padding
    # rows see only themselves and nobody sees them.
    N = max(PAD_TO, P + T)
    padded = np.eye(N, dtype=bool)
    padded[: P + T, : P + T] = full
    all_tokens = np.zeros(N, np.int32)
    all_tokens[: P + T] = np.concatenate([prefix, tokens])
    all_pos = np.zeros(N, np.int32)
    all_pos[: P + T] = np.concatenate([np.arange(P), positions])
    rows = np.zeros(N, bool)
    rows[P: P + T] = draft_rows
    return ps.logits(model, all_tokens, all_pos, padded, draft_rows=rows)[P: P + T]


def _draft_argmax(logits, mask_id):
    logits = np.array(logits)
    logits[..., mask_id] = -np.inf
    return logits.argmax(-1)


def _matches(draft, v) -> int:
    """Leading draft tokens equal to the verifier's predictions (Eq. 2)."""
    h = 0
    while h < len(draft) and draft[h] == v[h]:
        h += 1
    return h


class Trace:
    def __init__(self, max_new, eos):
        self.out, self.nfe, self.emitted, self.max_new, self.eos = [], 0, [], max_new, eos

    def accept(self, tokens) -> bool:
        """Algorithm 1 lines 7-8: prune at EOS or the length limit; True when stopped."""
        a = min(len(tokens), self.max_new - len(self.out))
        for i, t in enumerate(tokens[:a]):
            if t == self.eos:
                a = i + 1
                break
        self.out += list(tokens[:a])
        self.emitted.append(a)
        return (self.eos is not None and self.eos in tokens[:a]) or len(self.out) >= self.max_new


def _first_call(model, prompt, B, trace):
    """[prompt (causal) | MASK^B]: first token and a full draft of B-1 (App. E.2)."""
    n, m = len(prompt), model.mask_id
    mask = np.zeros((n + B, n + B), bool)
    mask[:n, :n] = np.tril(np.ones((n, n), bool))
    mask[n:, :n] = True
    mask[n:, n:] = True
    tokens = np.concatenate([prompt, np.full(B, m)])
    pos = np.concatenate([np.arange(n), n + np.arange(B)])
    logits = _call(model, np.zeros(0, np.int32), tokens, pos, mask, np.arange(n + B) >= n)
    trace.nfe += 1
    first = int(logits[n - 1].argmax())
    return first, list(_draft_argmax(logits[n + 1:], m)), trace.accept([first])


def _prefill(model, prompt, trace):
    n = len(prompt)
    logits = _call(model, np.zeros(0, np.int32), prompt, np.arange(n), np.tril(np.ones((n, n), bool)),
                   np.zeros(n, bool))
    trace.nfe += 1
    first = int(logits[n - 1].argmax())
    return first, trace.accept([first])


def packed(model, prompt, B, max_new, eos=None):
    """Algorithm 1 with the first call of App. E.2."""
    prompt = np.asarray(prompt)
    m, W = model.mask_id, B - 1
    trace = Trace(max_new, eos)
    x, draft, stop = _first_call(model, prompt, B, trace)
    seq = list(prompt) + [x]
    while not stop:
        n = len(seq)
        d_bar = draft + [m] * (W - len(draft))
        tokens = np.array([x] + d_bar + [x] + [m] * W)
        pos = np.concatenate([np.arange(n - 1, n - 1 + B)] * 2)
        logits = _call(model, np.array(seq[:-1]), tokens, pos, layouts.packed_mask(B),
                       np.arange(2 * B) >= B)
        trace.nfe += 1
        v = logits[:B].argmax(-1)                    # v^(i+1) = v[i]
        z = list(_draft_argmax(logits[B + 1:], m))   # z^(j) = z[j-1], position n+j-1
        h = _matches(draft, v)
        C = list(draft[:h]) + [int(v[h])]
        stop = trace.accept(C)
        seq += C
        x, draft = C[-1], z[len(C):]
    return trace


def linear(model, prompt, B, max_new, eos=None):
    prompt = np.asarray(prompt)
    m = model.mask_id
    trace = Trace(max_new, eos)
    x, stop = _prefill(model, prompt, trace)
    seq = list(prompt) + [x]
    while not stop:
        n = len(seq)
        pos = np.arange(n - 1, n - 1 + B)
        logits = _call(model, np.array(seq[:-1]), np.array([x] + [m] * (B - 1)), pos,
                       np.ones((B, B), bool), np.ones(B, bool))
        draft = list(_draft_argmax(logits[1:], m))
        logits = _call(model, np.array(seq[:-1]), np.array([x] + draft), pos,
                       np.tril(np.ones((B, B), bool)), np.zeros(B, bool))
        trace.nfe += 2
        v = logits.argmax(-1)
        h = _matches(draft, v)
        C = draft[:h] + [int(v[h])]
        stop = trace.accept(C)
        seq += C
        x = C[-1]
    return trace


def quadratic(model, prompt, B, max_new, eos=None):
    prompt = np.asarray(prompt)
    m, G = model.mask_id, B + 1
    trace = Trace(max_new, eos)
    x, draft, stop = _first_call(model, prompt, B, trace)
    seq = list(prompt) + [x]
    while not stop:
        n = len(seq)
        d = [x] + draft
        tokens, pos, rows = [], [], []
        for i in range(B):
            tokens += [d[i]] + [m] * B
            pos += list(range(n - 1 + i, n + i + B))
            rows += [False] + [True] * B
        logits = _call(model, np.array(seq[:-1]), np.array(tokens), np.array(pos),
                       layouts.quadratic_mask(B), np.array(rows)).reshape(B, G, -1)
        trace.nfe += 1
        v = logits[:, 0].argmax(-1)
        h = _matches(draft, v)
        C = draft[:h] + [int(v[h])]
        stop = trace.accept(C)
        seq += C
        x, draft = C[-1], list(_draft_argmax(logits[h, 2:], m))
    return trace


def ar(model, prompt, max_new, eos=None):
    prompt = np.asarray(prompt)
    trace = Trace(max_new, eos)
    x, stop = _prefill(model, prompt, trace)
    seq = list(prompt) + [x]
    while not stop:
        logits = _call(model, np.array(seq[:-1]), np.array([x]), np.array([len(seq) - 1]),
                       np.ones((1, 1), bool), np.zeros(1, bool))
        trace.nfe += 1
        x = int(logits[0].argmax())
        stop = trace.accept([x])
        seq.append(x)
    return trace


REFERENCES = {"packed": packed, "linear": linear, "quadratic": quadratic,
              "ar": lambda model, prompt, B, max_new, eos=None: ar(model, prompt, max_new, eos)}
