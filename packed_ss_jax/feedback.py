"""What `schedule="auto"` learns from its own decodes: how far the cost model's seconds
per iteration are from what decodes then take (planner.py).

Each decode through `auto` reports the seconds per loop iteration it measured beside the
cost model's prediction for it (its "base"). Their ratio, clamped to [1/BOUND, BOUND] so
that one wild timing cannot swing the planner, is kept as a running mean of its logarithm
that weighs the newest observation `DECAY` (older ones fade geometrically): one per
candidate and number of sequences decoded together, and one of every candidate at that
number (the machine's state: a process beside it, another clock). A candidate's
correction is its own mean, blended into the shared one as it goes stale (it counts half
after `HALF_LIFE` observations of other candidates): a candidate not run for a while, or
never, is predicted as the machine now runs, not as it ran at calibration.

Exploration: one choice in `EXPLORE_EVERY` of a kind decodes with another candidate
predicted within `EXPLORE_WITHIN` of the best, the one observed least recently, unless
it was observed within the last `EXPLORE_EVERY` observations. That bounds what exploring
costs (at most 1 - EXPLORE_WITHIN on one decode in EXPLORE_EVERY) and keeps every close
candidate's correction fresh, so that a change in the machine's state that favours
another schedule is found.
"""

from __future__ import annotations

import dataclasses
import math
import threading

from .acceptance import Candidate

DECAY = 0.25          # the newest observation's weight in a running mean
BOUND = 16.0          # an observed/predicted ratio is clamped to [1/BOUND, BOUND]
HALF_LIFE = 32        # observations after which a candidate's own correction counts half
EXPLORE_EVERY = 16    # one choice in this many explores
EXPLORE_WITHIN = 0.8  # only candidates predicted at least this fraction of the best


@dataclasses.dataclass
class Running:
    """A running mean of log(observed / predicted): its value, the observations in it and
    the observation count (of every candidate) at the last one."""

    log_ratio: float = 0.0
    count: int = 0
    last: int = -1

    def add(self, x: float, tick: int) -> None:
        self.log_ratio = x if self.count == 0 else (1 - DECAY) * self.log_ratio + DECAY * x
        self.count += 1
        self.last = tick


class Feedback:
    """Corrections of the cost model's seconds per iteration (see the module doc).
    Thread-safe: decodes on several threads may report."""

    def __init__(self):
        self.own: dict[tuple[Candidate, int], Running] = {}
        self.shared: dict[int, Running] = {}
        self.ticks = 0   # observations so far
        self._lock = threading.Lock()

    def observe(self, candidate: Candidate, sequences: int, base_s: float,
                observed_s: float) -> None:
        """A decode of `sequences` sequences with `candidate` took `observed_s` seconds per
        iteration where the cost model predicted `base_s`. Nonsense (a zero, a NaN) is
        dropped: no timing may break the planner."""
        if not (base_s > 0 and observed_s > 0 and math.isfinite(base_s)
                and math.isfinite(observed_s)):
            return
        x = min(max(math.log(observed_s / base_s), -math.log(BOUND)), math.log(BOUND))
        with self._lock:
            self.ticks += 1
            self.own.setdefault((candidate, sequences), Running()).add(x, self.ticks)
            self.shared.setdefault(sequences, Running()).add(x, self.ticks)

    def factor(self, candidate: Candidate, sequences: int) -> float:
        """What to multiply the cost model's seconds per iteration by (1: nothing seen)."""
        with self._lock:
            shared = self.shared.get(sequences)
            base = 0.0 if shared is None else shared.log_ratio
            own = self.own.get((candidate, sequences))
            if own is None:
                return math.exp(base)
            weight = 0.5 ** ((self.ticks - own.last) / HALF_LIFE)
            return math.exp(weight * own.log_ratio + (1 - weight) * base)

    def stalest(self, candidates, sequences: int) -> Candidate | None:
        """Of `candidates`, the one observed least recently at `sequences` (never: first),
        unless even that one was observed within the last EXPLORE_EVERY observations."""
        with self._lock:
            def last(c):
                own = self.own.get((c, sequences))
                return -1 if own is None else own.last
            if not candidates:
                return None
            pick = min(candidates, key=last)
            fresh = last(pick) >= 0 and self.ticks - last(pick) < EXPLORE_EVERY
            return None if fresh else pick

    def table(self) -> list[dict]:
        """Per candidate and number of sequences: the correction now, the observations."""
        with self._lock:
            rows = list(self.own.items())
        return [{"candidate": c, "sequences": n, "observations": r.count,
                 "factor": self.factor(c, n)} for (c, n), r in sorted(rows)]
