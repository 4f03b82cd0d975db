"""How many tokens a schedule makes per loop iteration on the loaded model: the
acceptance side of `schedule="auto"` (planner.py), beside the cost side (cost.py).

A schedule at a width (and, for Branched-SS, a number of branches) is a `Candidate`, a
`shape.Shape`. `AcceptanceModel` keeps, per candidate and per kind of decoding (greedy or sampled:
sampling accepts fewer drafts), the tokens and loop iterations of the decodes it was
shown together with their accepted-length histograms: a prior from calibration decodes
(weighted as `PRIOR_ITERATIONS` iterations, so that the decodes that follow soon
outweigh it), then every decode run with the candidate (running). The expected tokens
per iteration is their ratio. How far apart the rows of a batch finish (`busy`) comes
from the iterations of each decode: the calibration's, then the last `LENGTHS_KEPT` run
with the candidate, since how long its decodes run varies with the prompts it is given.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading

import numpy as np

from .shape import Shape

PRIOR_ITERATIONS = 256   # what a calibration weighs against the running decodes
LENGTHS_KEPT = 256       # the decodes' iterations a candidate's `busy` is drawn from
_COUNT_MAX = 2 ** 31 - 1  # positions and iterations are int32 on the device

Candidate = Shape   # what `auto` chooses among: a schedule at a width with k branches


def busy(lengths, sequences: int) -> float:
    """The mean of `lengths` (each decode's iterations) over the expected largest of
    `sequences` draws from them: the share of the row-iterations of that many decodes
    started together that decode."""
    if sequences <= 1 or not len(lengths):
        return 1.0
    x = np.sort(np.asarray(lengths, np.float64))
    at = np.arange(len(x) + 1) / len(x)
    largest = float(np.sum(x * np.diff(at ** sequences)))
    return float(x.mean()) / largest if largest > 0 else 1.0


@dataclasses.dataclass
class Tally:
    """Decodes seen of one candidate: their tokens, loop iterations (the first call
    included) and summed accepted-length histogram; a calibration's also their decoder
    seconds (each decoded alone), the KV positions their calls read, each one's iterations
    (how far apart the rows of a batch finish), and the seconds of all decoded as one
    batch."""

    tokens: float = 0.0
    iterations: float = 0.0
    accept_hist: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    seconds: float = 0.0
    positions: int = 0
    lengths: tuple[int, ...] = ()
    batch_s: float = 0.0

    @property
    def iteration_s(self) -> float | None:
        """Measured seconds per iteration of one sequence (None: not timed)."""
        return self.seconds / self.iterations if self.seconds > 0 and self.positions else None

    @property
    def batch_iteration_s(self) -> float | None:
        """Measured seconds per iteration of the batch of all `lengths` decoded together
        (it runs the longest's iterations; None: not timed)."""
        timed = self.batch_s > 0 and self.positions and self.lengths and max(self.lengths) > 0
        return self.batch_s / max(self.lengths) if timed else None

    def busy(self, sequences: int) -> float:
        """The expected share of a batch's row-iterations that decode, for `sequences`
        sequences started together (a batch runs until its longest decode ends): `busy`
        of `lengths`."""
        return busy(self.lengths, sequences)

    def add(self, tokens: float, iterations: float, accept_hist) -> None:
        self.tokens += tokens
        self.iterations += iterations
        h = np.asarray(accept_hist, np.int64)
        if h.size > self.accept_hist.size:
            h, self.accept_hist = self.accept_hist, h.copy()
        self.accept_hist[: h.size] += h


class AcceptanceModel:
    """Expected tokens per iteration per candidate (see the module doc). Thread-safe:
    decodes on several threads may report to one model."""

    def __init__(self, prior: dict[Candidate, Tally] | None = None,
                 prior_iterations: float = PRIOR_ITERATIONS):
        self.prior = dict(prior or {})
        self.prior_iterations = prior_iterations
        self.running: dict[tuple[Candidate, bool], Tally] = {}
        self.lengths: dict[Candidate, collections.deque] = {}   # its decodes' iterations
        self._lock = threading.Lock()

    def knows(self, candidate: Candidate) -> bool:
        return candidate in self.prior

    def add_prior(self, candidate: Candidate, tally: Tally) -> None:
        with self._lock:
            self.prior[candidate] = tally

    def busy(self, candidate: Candidate, sequences: int) -> float:
        """`busy` of the iterations of the candidate's calibration decodes and of its
        last LENGTHS_KEPT decodes since (1 for a candidate without either)."""
        p = self.prior.get(candidate)
        with self._lock:
            seen = tuple(self.lengths.get(candidate, ()))
        return busy((() if p is None else p.lengths) + seen, sequences)

    def tokens_per_iteration(self, candidate: Candidate, sampled: bool = False) -> float:
        """The prior's rate weighted as `prior_iterations` iterations, pooled with the
        running decodes of this kind; KeyError for a candidate never calibrated."""
        p = self.prior[candidate]
        rate = p.tokens / p.iterations
        with self._lock:
            r = self.running.get((candidate, sampled), Tally())
            return (rate * self.prior_iterations + r.tokens) / (self.prior_iterations + r.iterations)

    def observe(self, candidate: Candidate, sampled: bool, results) -> None:
        """Adds decodes (DecodeResults) run with `candidate` to the running tally."""
        with self._lock:
            t = self.running.setdefault((candidate, sampled), Tally())
            lengths = self.lengths.setdefault(
                candidate, collections.deque(maxlen=LENGTHS_KEPT))
            for r in results:
                t.add(len(r.tokens), r.iterations, r.accept_hist)
                lengths.append(r.iterations)

    def table(self) -> list[dict]:
        """Per candidate and kind: the prior's and the running decodes' tokens per
        iteration, iterations seen and accepted-length histogram."""
        out = []
        with self._lock:
            running, prior = dict(self.running), dict(self.prior)
        for c, p in sorted(prior.items()):
            for sampled in (False, True):
                r = running.get((c, sampled))
                if r is None and sampled:
                    continue
                out.append({"candidate": c, "sampled": sampled,
                            "prior_tokens_per_iteration": p.tokens / p.iterations,
                            "iterations": 0 if r is None else r.iterations,
                            "tokens_per_iteration": self.tokens_per_iteration(c, sampled),
                            "accept_hist": (p.accept_hist if r is None else r.accept_hist).tolist()})
        return out

    def prior_json(self) -> list:
        return [[c.to_json(), t.tokens, t.iterations, t.accept_hist.tolist(),
                 {"seconds": t.seconds, "positions": t.positions, "lengths": list(t.lengths),
                  "batch_s": t.batch_s}]
                for c, t in sorted(self.prior.items())]

    @classmethod
    def from_prior_json(cls, data) -> AcceptanceModel:
        """An AcceptanceModel from `prior_json`'s list; ValueError for anything else."""
        try:
            prior = {}
            for c, tokens, iterations, hist, *timing in data:
                tokens, iterations = float(tokens), float(iterations)
                if not (math.isfinite(tokens) and math.isfinite(iterations)
                        and tokens >= 0 and iterations > 0):
                    raise ValueError(f"a tally of {tokens} tokens in {iterations} iterations")
                hist = np.asarray(hist, np.int64).reshape(-1)
                if (hist < 0).any():
                    raise ValueError("a negative count in an accepted-length histogram")
                prior[Candidate.from_json(c)] = Tally(tokens, iterations, hist,
                                                      **_timing(*timing))
        except (TypeError, ValueError, KeyError, OverflowError) as e:
            raise ValueError(f"a malformed acceptance calibration: {e}") from None
        return cls(prior)


def _timing(timing: dict | None = None, *rest) -> dict:
    """A prior's timing fields from its file (none: untimed); ValueError for nonsense."""
    if rest:
        raise ValueError("a tally with more than one timing record")
    if timing is None:
        return {}
    if not isinstance(timing, dict) or not isinstance(timing["lengths"], list):
        raise ValueError("a timing record that is not {seconds, positions, lengths, batch_s}")
    # "slots" in files written before the KV positions had their own name
    positions = timing["positions"] if "positions" in timing else timing["slots"]
    seconds, positions = float(timing["seconds"]), int(positions)
    batch_s = float(timing["batch_s"])
    lengths = tuple(int(n) for n in timing["lengths"])
    if not (math.isfinite(seconds) and seconds >= 0 and math.isfinite(batch_s)
            and batch_s >= 0 and 0 <= positions <= _COUNT_MAX
            and all(0 <= n <= _COUNT_MAX for n in lengths)):
        raise ValueError(f"a timing of {seconds} s (a batch {batch_s} s) over {positions} "
                         "positions")
    return {"seconds": seconds, "positions": positions, "lengths": lengths, "batch_s": batch_s}
