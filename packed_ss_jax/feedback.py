"""What `schedule="auto"` learns from its own decodes: how far the predicted seconds per
iteration are from what decodes then take (planner.py).

Each decode through `auto` reports the seconds per loop iteration it measured beside the
prediction before corrections (its "base"). Their log-ratio, clamped to
[-log BOUND, log BOUND] so that one wild timing cannot swing the planner, is read as

    log(observed / base) = drift + offset of the candidate

per size of what decodes together (the planner's: the number of sequences, and whether
slots are refilled as they end): `drift`, the machine's state (a process beside it,
another clock) shared by every candidate; a candidate's `offset`, how it runs against
that (what the base misses of this schedule and width). The first decode at a size sets
the drift. A candidate's offset is the mean of what its first decode and its explored
ones showed against the drift at the time, with the calibration counted as `PRIOR`
decodes that showed no offset: the calibration timed every candidate on several
prompts, and one noisy decode must not banish a candidate. A decode of the kept choice
moves the drift by `DECAY` of its error from the prediction: every candidate follows the
machine as the kept one sees it, each in its place against it, until it runs again.
Decodes of one candidate cannot tell a slow schedule from a slow machine; only decodes
of another can, which is what exploring is for.

Exploration: one choice in `EXPLORE_EVERY` of a kind, and its `EARLY` ones (a kind's
first choices rest on the calibration alone, which may rank candidates wrongly at that
size), decodes with another candidate predicted within `EXPLORE_WITHIN` of the best: the
fastest predicted of those not run within the last `FRESH` timed decodes (of any size).
That bounds what exploring costs (at most 1 - EXPLORE_WITHIN on one decode in
EXPLORE_EVERY, past the first ones) and tries first the candidate most likely to be
faster, so that a machine whose state favours another schedule is found.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Hashable

from .acceptance import Candidate

DECAY = 0.25          # how far a decode of the kept choice moves the drift
PRIOR = 1             # the calibration's weight in an offset, in decodes
BOUND = 16.0          # an observed/predicted ratio is clamped to [1/BOUND, BOUND]
EXPLORE_EVERY = 16    # one choice in this many explores
EXPLORE_WITHIN = 0.8  # only candidates predicted at least this fraction of the best
FRESH = EXPLORE_EVERY   # a candidate run within this many decodes is not explored
EARLY = (2, 4, 8)     # the choices of a kind that explore besides


def explores(n: int) -> bool:
    """Whether the n-th choice of a kind (1, 2, ...) explores."""
    return n % EXPLORE_EVERY == 0 or n in EARLY


@dataclasses.dataclass
class Offset:
    """A candidate's log-ratio against the drift, its decodes, those of them it was
    measured by (its first and its explored ones), and the decode count (of every
    candidate) at the last one."""

    value: float = 0.0
    count: int = 0
    measured: int = 0
    last: int = -1


class Feedback:
    """Corrections of the predicted seconds per iteration (see the module doc).
    Thread-safe: decodes on several threads may report."""

    def __init__(self):
        self.offsets: dict[tuple[Candidate, Hashable], Offset] = {}
        self.drift: dict[Hashable, float] = {}
        self.ticks = 0   # observations so far
        self._lock = threading.Lock()

    def observe(self, candidate: Candidate, size: Hashable, base_s: float,
                observed_s: float, explored: bool = False) -> None:
        """A decode of `size` with `candidate` took `observed_s` seconds per iteration
        where `base_s` was predicted before corrections; `explored`: it was tried in
        place of the best (it moves the candidate's offset). Nonsense (a zero, a NaN) is
        dropped: no timing may break the planner."""
        if not (base_s > 0 and observed_s > 0 and math.isfinite(base_s)
                and math.isfinite(observed_s)):
            return
        x = min(max(math.log(observed_s / base_s), -math.log(BOUND)), math.log(BOUND))
        with self._lock:
            self.ticks += 1
            own = self.offsets.setdefault((candidate, size), Offset())
            if size not in self.drift:   # the first decode at this size: the machine
                self.drift[size] = x
            elif own.count == 0 or explored:
                own.measured += 1
                own.value += (x - self.drift[size] - own.value) / (own.measured + PRIOR)
            else:
                self.drift[size] += DECAY * (x - self.drift[size] - own.value)
            own.count += 1
            own.last = self.ticks

    def factor(self, candidate: Candidate, size: Hashable) -> float:
        """What to multiply the predicted seconds per iteration by (1: nothing seen)."""
        with self._lock:
            own = self.offsets.get((candidate, size))
            return math.exp(self.drift.get(size, 0.0) + (0.0 if own is None else own.value))

    def to_explore(self, candidates, size: Hashable) -> Candidate | None:
        """The first of `candidates` (fastest predicted first) not run at `size` within
        the last FRESH timed decodes; None if every one was."""
        with self._lock:
            for c in candidates:
                own = self.offsets.get((c, size))
                if own is None or own.count == 0 or self.ticks - own.last >= FRESH:
                    return c
            return None

    def table(self) -> list[dict]:
        """Per candidate and size: the correction now, the observations."""
        with self._lock:
            rows = [(key, o.count) for key, o in self.offsets.items()]
        return [{"candidate": c, "size": n, "observations": count,
                 "factor": self.factor(c, n)}
                for (c, n), count in sorted(rows, key=lambda r: (r[0][0], repr(r[0][1])))]
