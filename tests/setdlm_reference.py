"""Plain Python references for SetDLM decoding: no cache, no jit, one query at a time.

A `Ledger` holds the clean entries fed so far in feeding order, each with the entries
it saw when it was fed; every model call is one whole forward over
`[prompt (causal) ; entries ; query rows]` (`ps.logits`), where an entry sees the
prompt, the entries live when it was fed and itself, and a MASK query sees the prompt,
the live entries and itself. When the output end E shrinks, entries past it stop
being live (App. C, Alg. 3 line 12).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import packed_ss_jax as ps

PAD = 96  # one compiled forward for every reference call
MASK_LOGIT = -1e12


def predict(logits, mask_id):
    z = np.array(logits, np.float64)
    z[..., mask_id] = MASK_LOGIT
    tok = z.argmax(-1)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return tok, np.take_along_axis(p, tok[..., None], -1)[..., 0]


class Ledger:
    def __init__(self, model, prompt):
        self.m, self.prompt = model, list(prompt)
        self.entries: list[tuple[int, int, frozenset]] = []  # (output index, token, seen)
        self.live: set[int] = set()
        self.calls = 0

    def feed(self, items):
        """Clean rows, causal in the given order, on top of the live entries."""
        for o, tok in items:
            self.entries.append((o, int(tok), frozenset(self.live)))
            self.live.add(len(self.entries) - 1)

    def drop(self, E):
        self.live = {k for k in self.live if self.entries[k][0] < E}

    def query(self, outs, extra=()):
        """Greedy predictions and probabilities of MASK queries at `outs`; `extra` clean
        rows are fed first for this call only."""
        saved = (list(self.entries), set(self.live))
        self.feed(extra)
        n, e = len(self.prompt), len(self.entries)
        T = n + e + len(outs)
        assert T <= PAD
        mask = np.eye(PAD, dtype=bool)
        mask[:n, :n] = np.tril(np.ones((n, n), bool))
        tokens = np.zeros(PAD, np.int32)
        pos = np.zeros(PAD, np.int32)
        tokens[:n], pos[:n] = self.prompt, np.arange(n)
        for k, (o, tok, seen) in enumerate(self.entries):
            row = n + k
            tokens[row], pos[row] = tok, n + o
            mask[row, :n] = True
            mask[row, [n + j for j in seen]] = True
        for q, o in enumerate(outs):
            row = n + e + q
            tokens[row], pos[row] = self.m.mask_id, n + o
            mask[row, :n] = True
            mask[row, [n + j for j in self.live]] = True
        logits = ps.logits(self.m, tokens, pos, mask)[n + e: T]
        self.entries, self.live = saved
        return predict(logits, self.m.mask_id)


def stop_end(res: dict, E: int, markers) -> int:
    """The earliest end of a marker whose tokens are all accepted (App. E.2)."""
    for mk in markers:
        for end in range(len(mk), E + 1):
            if all(res.get(end - len(mk) + i) == t for i, t in enumerate(mk)):
                E = min(E, end)
                break
    return E


def window(res: dict, E: int, W: int) -> list[int]:
    first = min(o for o in range(E) if o not in res)
    return [o for o in range(first, min(E, first + W)) if o not in res]


def serial_ltr(model, prompt, L, markers):
    """One token per call, left to right: the greedy output every LTR schedule returns."""
    led, out, pending = Ledger(model, prompt), [], []
    for o in range(L):
        led.feed(pending)
        y = int(led.query([o])[0][0])
        out.append(y)
        pending = [(o, y)]
        if stop_end(dict(enumerate(out)), len(out), markers) < len(out) or any(
                out[-len(mk):] == list(mk) for mk in markers if len(out) >= len(mk)):
            break
    return out


def confidence_order(U, score):
    return sorted(U, key=lambda o: (0, -score[o], o) if o in score else (1, 0.0, o))


def serial_any_order(model, prompt, L, markers, W, run, policy: str | None = None, tol=1e-5):
    """Proposition C.1's serial reference for a run's orders pi_t and counts A_t.

    Iteration t generates A_t tokens one at a time at pi_t(1..A_t), each conditioned on
    P_{t-1} and the tokens generated before it in the group, then applies the stop rule.
    The last token of a group is fed as a clean row in the next call when the run left
    it to be fed (a correction), else with its group (the run's caching schedule).

    policy ("packed", "quadratic", "linear"): also recompute the confidence scores of
    App. E.6 from the reference's own predictions and check that every pi_t sorts U_t by
    them (ties within `tol` may go either way), the first iteration in textual order.
    """
    led, res, E, pending, score = Ledger(model, prompt), {}, L, [], {}
    for t, (pi, A, fed) in enumerate(zip(run.orders, run.accepted, run.fed)):
        assert any(o not in res for o in range(E)), "the run went on after the output was full"
        U = window(res, E, W)
        assert sorted(pi) == U, (t, pi, U)
        if policy:
            _check_order(pi, score, tol)
        led.feed(pending)
        pending, ys, new_score = [], [], {}
        if policy in ("packed", "linear"):
            z, zp = led.query(U)  # drafts from P_{t-1}
            if policy == "packed":
                new_score = dict(zip(U, zp))
            else:  # the verifier's max probability given the earlier-ranked drafts
                d = dict(zip(U, z))
                for r, o in enumerate(pi):
                    new_score[o] = led.query([o], extra=[(q, d[q]) for q in pi[:r]])[1][0]
        for r in range(A):
            if r:
                led.feed([(pi[r - 1], ys[-1])])
            if policy == "quadratic" and r == A - 1:
                # The branch for A-1 accepted drafts proposes the remaining ranks.
                new_score = dict(zip(pi, led.query(pi)[1]))
            y = int(led.query([pi[r]])[0][0])
            ys.append(y)
            res[pi[r]] = y
        last = [(pi[A - 1], ys[-1])]
        if fed:
            pending = last
        else:
            led.feed(last)
        E = stop_end(res, E, markers)
        res = {o: v for o, v in res.items() if o < E}
        led.drop(E)
        pending = [p for p in pending if p[0] < E]
        score = {o: new_score[o] for o in pi[A:] if o < E and o in new_score}
    assert all(o in res for o in range(E)), "the run stopped before the output was full"
    return [res[o] for o in range(E)]


def _check_order(pi, score, tol):
    scored = [o for o in pi if o in score]
    assert pi[: len(scored)] == scored, f"positions without a score must come last: {pi}"
    assert pi[len(scored):] == sorted(pi[len(scored):]), f"unscored in textual order: {pi}"
    for a, b in zip(scored, scored[1:]):
        sa, sb = score[a], score[b]
        assert sa > sb - tol and (sa > sb + tol or a < b or abs(sa - sb) <= tol), \
            f"order {pi} is not by decreasing confidence: {a}:{sa} before {b}:{sb}"


def native(model, prompt, L, markers, W, threshold=0.9):
    """The release's threshold decoder, one step per call (tokens and NFE)."""
    led, res, E, pending, nfe = Ledger(model, prompt), {}, L, [], 1
    while any(o not in res for o in range(E)):
        U = window(res, E, W)
        led.feed(pending)
        x, conf = led.query(U)
        nfe += 1
        best = int(np.argmax(conf))
        take = [i for i in range(len(U)) if conf[i] >= threshold or i == best]
        for i in take:
            res[U[i]] = int(x[i])
        pending = [(U[i], int(x[i])) for i in take]
        E = stop_end(res, E, markers)
        res = {o: v for o, v in res.items() if o < E}
        led.drop(E)
        pending = [p for p in pending if p[0] < E]
    return [res[o] for o in range(E)], nfe

def two_stream(x0, sigma, mask_id: int):
    """The release's training construction: input `[x0[sigma] ; MASK^L]` at positions
    `[sigma ; sigma]`. A clean row sees clean rows of earlier-or-equal rank; a query row
    sees clean rows of strictly earlier rank and itself; so query row k gives
    p(x_sigma(k) | x_sigma(<k)), every any-order conditional in one pass."""
    x0, sigma = jnp.asarray(x0, jnp.int32), jnp.asarray(sigma, jnp.int32)
    L = x0.shape[0]
    k = jnp.arange(L)
    earlier = k[None, :] < k[:, None]
    I, Z = jnp.eye(L, dtype=bool), jnp.zeros((L, L), bool)
    mask = jnp.concatenate([jnp.concatenate([earlier | I, Z], axis=1),
                            jnp.concatenate([earlier, I], axis=1)])
    tokens = jnp.concatenate([x0[sigma], jnp.full(L, mask_id, jnp.int32)])
    return tokens, jnp.concatenate([sigma, sigma]), mask
