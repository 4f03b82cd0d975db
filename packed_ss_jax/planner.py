"""`schedule="auto"`: the exact schedule, width and branches expected to make the most
tokens per second for this model on this device, for a request of this size.

A candidate's expected speed is

    sequences x tokens per iteration x busy / seconds per iteration

with tokens per iteration from the acceptance model (acceptance.py: calibration decodes,
then the decodes run since) and seconds per iteration the sum over the iteration's calls
of the cost model's seconds per call (cost.py: the forward timed at a few row counts and
cache sizes). A batch of N sequences is costed as calls of N times the rows; on a device
that is compute-bound at that size speculation stops paying and AR wins, which is how
`auto` decides whether to speculate at all. Seconds per iteration are scaled by what
the candidate's calibration decodes measured against the cost model (a whole iteration:
its calls and the schedule's own work), alone and as one batch. `busy`: the share of a batch's
row-iterations that decode, since a batch started together lasts as long as its longest
decode (Tally.busy, from the calibration decodes' lengths); 1 for one sequence, and for
slots refilled as they end (decode_continuous, a server). What decodes then take
corrects the prediction (feedback.py).

Every candidate is exact (greedy output equals the reference's, sampled output follows
its law), so the choice changes speed, never the tokens. A choice is kept until another
candidate is predicted faster by more than `MARGIN`, so that near-ties do not flip
between programs (each flip compiles one).

Calibration, on first use of each candidate (kept on disk beside the cost calibration,
one file per candidate, keyed by the device, the model's shape and a fingerprint of its
weights, the prompts and the candidate): the cost model's forwards once, then the
candidate decoding the calibration prompts as one batch and each alone, timed (by
default `DEFAULT_PROMPTS`; `Planner.calibrate(prompts)` for a workload's own),
`CALIBRATION_TOKENS` tokens each. A request that names a width calibrates only the
candidates of that width.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np

from . import cost as cost_lib
from . import feedback as feedback_lib, memory, options as options_lib, scheduler, validate
from .acceptance import AcceptanceModel, Candidate, Tally
from .engine import Engine
from .feedback import BOUND, EXPLORE_WITHIN, Feedback
from .options import DecodeOptions
from .validate import InputError

AUTO = "auto"
MARGIN = 0.05            # a kept choice yields to one predicted this much faster
CALIBRATION_TOKENS = 64
VERSION = 2              # of the acceptance file's layout
# Short prompts of the kinds the paper measures (a word problem, code, prose), for a
# model with a tokenizer; a model without one is calibrated on seeded random ids.
DEFAULT_PROMPTS = (
    "Question: Mia has 14 pencils. Mia gets 9 more pencils. How many pencils does Mia have "
    "now?\nAnswer:",
    "Question: Each of the books costs 6 dollars. Leo buys 4 of them and pays with 30 dollars. "
    "How much change does Leo get?\nAnswer:",
    "Question: Noah has 25 stickers, buys 12 more at the market and then uses 8 of them. How "
    "many stickers does Noah have left?\nAnswer:",
    "def flatten(items):\n    \"\"\"Return a flat list of the items of nested lists.\"\"\"\n",
    "def count_words(text):\n    \"\"\"Count how often each word occurs in text.\"\"\"\n",
    "The module provides functions for working with paths, files and directories, so that",
    "This section describes how the interpreter reads a program and in which order it",
    "Question: Zoe has 3 boxes with 7 shells in each box. How many shells does Zoe have?\n"
    "Answer:",
)
# The widths tried: wide enough for a GPU's sweet spot (the paper runs B = 32), narrow
# enough for a compute-bound device; Quadratic-SS's rows grow with the width's square.
WIDTHS = {"nemotron": (4, 8, 16, 32), "setdlm": (4, 8, 16)}
SQUARE_WIDTHS = (4, 8)
BRANCHED = ((8, 2), (16, 2))   # (B, k)

log = logging.getLogger(__name__)
_planners = threading.RLock()   # making and attaching models' planners
# The attribute of a Model object that keeps its planner (beside its engine, `Engine.of`).
_ATTRIBUTE = "_auto_planner"


def allows(family, c: Candidate, width: int | None = None, branches: int | None = None,
           sampled: bool = False) -> bool:
    """Whether `auto` may decode a request with `c`: the reference always; a speculative
    schedule if it is exact, samples when the request does, and has the request's width
    (or k, then it is Branched-SS) where the request gives one."""
    if c.schedule == family.reference:
        return True
    return (c.schedule not in family.inexact and (not sampled or c.schedule in family.sampled)
            and width in (None, c.width)
            and (branches is None or (c.schedule == "branched" and c.branches == branches)))


def default_candidates(family, width: int | None = None, branches: int | None = None,
                       sampled: bool = False) -> tuple[Candidate, ...]:
    """The candidates of a family: its reference and each speculative schedule at
    `WIDTHS` (Quadratic-SS at `SQUARE_WIDTHS`, Branched-SS at `BRANCHED`), or at the
    given `width` (and `branches`), those `allows` for such a request."""
    out = [Candidate(family.reference, 1)]
    for s in family.schedules:
        if s == family.reference:
            continue
        pairs = (BRANCHED if s == "branched" else
                 [(w, 1) for w in (SQUARE_WIDTHS if s == "quadratic" else WIDTHS[family.name])])
        if width is not None:
            pairs = [(width, k) for _, k in pairs]
        if branches is not None and s == "branched":
            pairs = [(w, branches) for w, _ in pairs if branches <= w]
        out += [Candidate(s, w, k) for w, k in dict.fromkeys(pairs)]
    return tuple(c for c in out if allows(family, c, width, branches, sampled))


@dataclasses.dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    tokens_per_iteration: float
    iteration_s: float        # base_iteration_s, corrected (feedback.py)
    tokens_per_s: float
    base_iteration_s: float   # the cost model's, scaled by the calibration decodes' timing
    busy: float = 1.0         # the expected share of the batch's row-iterations that decode


@dataclasses.dataclass(frozen=True)
class Choice:
    """What `auto` picked for a request, and why: every feasible candidate's prediction,
    fastest first."""

    candidate: Candidate
    predicted_tokens_per_s: float
    sequences: int
    sampled: bool
    predictions: tuple[Prediction, ...]
    explored: bool = False   # not the best predicted: tried to keep its correction fresh
    refilled: bool = False   # the sequences are slots refilled as they end

    @property
    def size(self) -> tuple[int, bool]:
        """What the feedback keys its corrections by (feedback.py)."""
        return self.sequences, self.refilled

    @property
    def prediction(self) -> Prediction:
        return next(p for p in self.predictions if p.candidate == self.candidate)

    def summary(self, family) -> dict:
        """The result's and the server's record of it."""
        p = self.prediction
        return {"schedule": self.candidate.schedule, "label": self.candidate.label(family),
                "predicted_tokens_per_s": self.predicted_tokens_per_s,
                "predicted_iteration_s": p.iteration_s,
                "base_iteration_s": p.base_iteration_s, "busy": p.busy,
                "explored": self.explored, "refilled": self.refilled,
                "sequences": self.sequences, "sampled": self.sampled,
                "candidates": len(self.predictions)}


def fingerprint(params) -> str:
    """A digest of the weights that tells checkpoints of one shape apart (each array's
    first elements), without reading them whole; an array split over other processes'
    devices counts by its shape alone."""
    h = hashlib.sha256()
    for path, x in sorted(jax.tree_util.tree_leaves_with_path(params),
                          key=lambda p: jax.tree_util.keystr(p[0])):
        h.update(f"{jax.tree_util.keystr(path)}:{x.shape}:{x.dtype}".encode())
        if x.size and getattr(x, "is_fully_addressable", True):   # else: its shape alone
            head = x[(0,) * (x.ndim - 1)][:64] if x.ndim else x   # no flattened copy
            h.update(np.asarray(jax.device_get(head), np.float32).tobytes())
    return h.hexdigest()[:24]


class Planner:
    """`auto`'s choices for one loaded model: its cost model, acceptance model and the
    choices kept so far. `Planner.of(model)` is the one kept with the Model object."""

    def __init__(self, engine: Engine, *, cost: cost_lib.CostModel | None = None,
                 acceptance: AcceptanceModel | None = None,
                 candidates: Sequence[Candidate] | None = None,
                 directory: str | os.PathLike | None = "default"):
        self.engine = engine
        self.family = engine.family
        self.directory = directory
        # Default candidates follow a request's width or k (`default_candidates`); a
        # planner given its own keeps to them.
        self.own_candidates = candidates is not None
        self.candidates = tuple(candidates or default_candidates(self.family))
        self.cost = cost
        self.acceptance = AcceptanceModel() if acceptance is None else acceptance
        self.prompts, self.max_new = self._prompts(None), CALIBRATION_TOKENS
        self.calibration_s = 0.0   # seconds spent calibrating (or reading calibrations)
        # told (i, n, label) before each candidate a calibration decodes (a command line
        # prints it)
        self.progress: Callable[[int, int, str], None] | None = None
        self._kept: dict[tuple, Candidate] = {}
        self._chosen: dict[tuple, int] = {}   # choices made per kind (exploration's clock)
        self.feedback = Feedback()
        self._weights: str | None = None
        self._lock = threading.RLock()

    @classmethod
    def of(cls, model) -> Planner:
        """The planner `schedule="auto"` uses for a Model (or an engine's model): made on
        first use with the defaults, or the one `attach` gave it."""
        model = model.model if isinstance(model, Engine) else model
        with _planners:   # two threads' first auto decodes make one planner
            planner = getattr(model, _ATTRIBUTE, None)
            return cls(Engine.of(model)).attach() if planner is None else planner

    def attach(self) -> Planner:
        """Makes this the planner `schedule="auto"` uses for its model (on the model's
        own engine, `Engine.of`: its candidates, calibration folder or models instead of
        the defaults)."""
        with _planners:
            self.engine = Engine.of(self.engine.model)
            object.__setattr__(self.engine.model, _ATTRIBUTE, self)   # a frozen Model too
        return self

    def detach(self) -> None:
        """The model's next `auto` decode makes a planner with the defaults again."""
        with _planners:
            if getattr(self.engine.model, _ATTRIBUTE, None) is self:
                object.__delattr__(self.engine.model, _ATTRIBUTE)

    # --- calibration ----------------------------------------------------------------------

    def _prompts(self, prompts) -> list:
        if prompts is not None:
            return list(prompts)
        if getattr(self.engine.model, "tokenizer", None) is not None:
            return list(DEFAULT_PROMPTS)
        rng = np.random.default_rng(0)
        V = self.engine.model.config.vocab_size
        return [rng.integers(0, V, 24).tolist() for _ in DEFAULT_PROMPTS]

    def calibrate(self, prompts: Sequence | None = None, max_new_tokens: int = CALIBRATION_TOKENS,
                  candidates: Sequence[Candidate] | None = None,
                  progress: Callable[[int, int, str], None] | None = None) -> None:
        """Measures (or reads back) the cost model and the acceptance prior of
        `candidates` (default: every candidate; a request calibrates the candidates it
        may use, on first use): each one's greedy decodes of `prompts` (texts or id
        lists; default `DEFAULT_PROMPTS`), as one batch and one at a time,
        `max_new_tokens` each, timed. New prompts replace the prior and what was learnt
        since. `progress(i, n, label)` is told before each
        candidate decodes."""
        with self._lock:
            prompts = self._prompts(prompts)
            if (prompts, max_new_tokens) != (self.prompts, self.max_new):
                self.prompts, self.max_new = prompts, max_new_tokens
                self.acceptance = AcceptanceModel()
                self.feedback = Feedback()   # learnt against the previous calibration
                self._kept.clear()
            self._ensure(self.candidates if candidates is None else candidates, progress)

    def _ensure(self, wanted, progress=None) -> None:
        """The cost model and the prior of every candidate of `wanted`: read from their
        files, else measured and kept."""
        t0 = time.perf_counter()
        if self.cost is None:
            self.cost = cost_lib.load_or_calibrate(self.engine.model, self.directory)
        missing = [c for c in wanted if not self.acceptance.knows(c)]
        for i, c in enumerate(missing):
            path = self._path(c)
            tally = _read(path, c)
            if tally is None:
                if (progress or self.progress) is not None:
                    (progress or self.progress)(i, len(missing), c.label(self.family))
                log.info("auto: calibrating %s (%d of %d)", c.label(self.family), i + 1,
                         len(missing))
                tally = self._decode(c)
                _write(path, c, tally)
            self.acceptance.add_prior(c, tally)
        self.calibration_s += time.perf_counter() - t0

    def _path(self, c: Candidate) -> Path | None:
        directory = cost_lib.folder(self.directory)
        if directory is None:
            return None
        if self._weights is None:
            self._weights = fingerprint(self.engine.model.params)
        text = json.dumps({"key": cost_lib.calibration_id(self.engine.model),
                           "weights": self._weights,
                           "prompts": [p if isinstance(p, str) else list(map(int, p))
                                       for p in self.prompts], "max_new": self.max_new,
                           "candidate": c.to_json()}, sort_keys=True)
        return Path(directory) / f"acceptance-{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"

    def _decode(self, c: Candidate) -> Tally:
        """The candidate's calibration: the prompts decoded as one batch, timed; then each
        alone, as `decode` of one prompt runs it, timed, on the batch's program size.
        A program's first run is slower than the rest (its setup): run again."""
        options = DecodeOptions(**c.options(self.family), max_new_tokens=self.max_new)
        batch = self.engine.batch(self.prompts, options)
        results = scheduler.decode_batch(self.engine, batch)
        if results[0].compile_s > 0:
            results = scheduler.decode_batch(self.engine, batch)
        t = Tally(positions=batch.program.capacity + batch.program.width,
                  batch_s=results[0].wall_s)
        lengths = []
        for request in batch.members:
            r = self.engine.decode(request)
            if r.compile_s > 0:
                r = self.engine.decode(request)
            t.add(len(r.tokens), r.iterations, r.accept_hist)
            t.seconds += r.wall_s
            lengths.append(r.iterations)
        t.lengths = tuple(lengths)
        return t

    # --- choosing ---------------------------------------------------------------------------

    def predict(self, c: Candidate, sequences: int, positions: int, sampled: bool,
                refilled: bool = False) -> Prediction:
        """`c`'s expected speed for `sequences` sequences whose calls read `positions` KV
        positions (see the module doc); `refilled`: slots refilled as they end."""
        per_iteration = self.acceptance.tokens_per_iteration(c, sampled)
        base = self._iteration_s(c, sequences, positions) * self._measured(c, sequences)
        busy = 1.0 if refilled else self.acceptance.busy(c, sequences)
        seconds = base * self.feedback.factor(c, (sequences, refilled))
        return Prediction(c, per_iteration, seconds,
                          sequences * per_iteration * busy / seconds, base, busy)

    def _iteration_s(self, c: Candidate, sequences: int, positions: int) -> float:
        rows = self.family.iteration_rows(c.schedule, c.width, c.branches)
        return sum(self.cost.call_s(sequences * r, positions) for r in rows)

    def _measured(self, c: Candidate, sequences: int) -> float:
        """How much longer the candidate's calibration decodes took per iteration than
        the cost model's calls (the schedule's own work, the calls' real sizes): at one
        sequence, at the calibration's batch, between the two log-linearly in the
        number of sequences and past the batch as at it; within the feedback's BOUND; 1
        for a calibration not timed (as a batch, for several sequences)."""
        p = self.acceptance.prior.get(c)
        if p is None:
            return 1.0
        one = _log_ratio(p.iteration_s, self._iteration_s(c, 1, p.positions))
        batch = len(p.lengths)
        if one is None:
            return 1.0
        if sequences == 1:
            at = one
        else:
            full = None if batch < 2 else _log_ratio(
                p.batch_iteration_s, self._iteration_s(c, batch, p.positions))
            if full is None:
                return 1.0
            at = one + (full - one) * min(1.0, math.log(sequences) / math.log(batch))
        return math.exp(min(max(at, -math.log(BOUND)), math.log(BOUND)))

    def choose(self, options: DecodeOptions, prompt_len: int, sequences: int = 1,
               explore: bool = True, fits_now: bool = True, refilled: bool = False) -> Choice:
        """The fastest feasible candidate for `sequences` prompts of at most `prompt_len`
        tokens decoded with `options` (schedule "auto"; a width or branches given keep
        the candidates of that width or k); with `explore`, a few choices of a kind may
        be another close candidate (feedback.explores). `fits_now`: a candidate
        whose decode state does not fit the memory free now is left out (a server's
        choice made again leaves this to its move, its own state holding that memory,
        and keeps to the candidates calibrated already). `refilled`: the sequences are
        slots refilled as they end (decode_continuous, a server), not a batch started
        together."""
        family, config = self.family, self.engine.model.config
        width = self._check(options)
        # Every other option is checked once, on the reference: its errors are the
        # request's, not a candidate's.
        tokenizer = getattr(self.engine.model, "tokenizer", None)
        reference = self.options_for(options, Candidate(family.reference)).check(
            family, config, tokenizer=tokenizer, prompt_len=prompt_len).program
        sampled = not reference.sampling.greedy
        pool = self.candidates
        if not self.own_candidates and (width is not None or options.branches is not None):
            pool = default_candidates(family, width, options.branches)
        pool = [c for c in pool if allows(family, c, width, options.branches, sampled)]
        asked = [f"{name} {v}" for name, v in ((family.width_name, width),
                                               ("branches", options.branches)) if v is not None]
        if asked and len(pool) == 1:   # only the reference: the width or k asked is not there
            raise InputError(f"schedule 'auto': no speculative candidate has {' and '.join(asked)}"
                             f" (the candidates: "
                             f"{', '.join(c.label(family) for c in self.candidates)})",
                             family.width_name if width is not None else "branches")
        feasible = self._feasible(options, pool, prompt_len, sequences, fits_now)
        if not feasible:
            raise InputError(f"schedule 'auto': no candidate schedule fits this request "
                             f"(tried {', '.join(c.label(family) for c in pool)})")
        with self._lock:   # one acceptance model for all predictions (calibrate swaps it)
            self._ensure([c for c, _ in feasible])
            feasible = [self.predict(c, sequences, positions, sampled, refilled)
                        for c, positions in feasible]
        feasible.sort(key=lambda p: -p.tokens_per_s)
        best = feasible[0]
        key = (sequences, refilled, sampled, width, options.branches)
        with self._lock:
            kept = next((p for p in feasible if p.candidate == self._kept.get(key)), None)
            if kept is not None and best.tokens_per_s <= (1 + MARGIN) * kept.tokens_per_s:
                best = kept
            self._kept[key] = best.candidate
            self._chosen[key] = n = self._chosen.get(key, 0) + 1
            tried = self._explore(feasible, best, (sequences, refilled)) if explore and \
                feedback_lib.explores(n) else None
        if tried is not None:
            return Choice(tried.candidate, tried.tokens_per_s, sequences, sampled,
                          tuple(feasible), explored=True, refilled=refilled)
        return Choice(best.candidate, best.tokens_per_s, sequences, sampled, tuple(feasible),
                      refilled=refilled)

    def _feasible(self, options: DecodeOptions, pool, prompt_len: int, sequences: int,
                  fits_now: bool) -> list[tuple[Candidate, int]]:
        """The candidates of `pool` that can decode the request (see `choose`), each with
        the KV positions a call of it reads."""
        family, model = self.family, self.engine.model
        tokenizer = getattr(model, "tokenizer", None)
        feasible = []
        for c in pool:
            try:
                checked = self.options_for(options, c).check(
                    family, model.config, tokenizer=tokenizer, prompt_len=prompt_len)
                program = checked.program
                if fits_now:
                    memory.check(model, program, checked.max_new, sequences)
                elif not self.acceptance.knows(c):
                    continue   # not calibrated: never calibrated here, beside a server
            except InputError:   # its block or its state does not fit: not a candidate
                continue
            # What a call reads: the cache and one block of headroom (memory.state_bytes).
            feasible.append((c, program.capacity + program.width))
        return feasible

    def _explore(self, feasible: list[Prediction], best: Prediction,
                 size: tuple[int, bool]) -> Prediction | None:
        """The candidate to try instead of `best` this time (feedback.py), or None."""
        close = [p.candidate for p in feasible if p.candidate != best.candidate
                 and p.tokens_per_s >= EXPLORE_WITHIN * best.tokens_per_s]
        pick = self.feedback.to_explore(close, size)
        return next((p for p in feasible if p.candidate == pick), None)

    def _check(self, options: DecodeOptions) -> int | None:
        """The order, and the width and branches where given (as a schedule that takes
        them would check them); the width given."""
        family = self.family
        if options.order != family.orders[0]:
            raise InputError(
                f"schedule 'auto' verifies in order {family.orders[0]!r} only: in another "
                "order each schedule's output follows its own verification orders, so the "
                "choice would change the tokens; name the schedule to decode in order "
                f"{options.order!r}", "order")
        width = options.width
        if width is not None:
            width = validate.integer(width, family.width_name, family.min_width,
                                     validate.MAX_CACHE, "a block must fit the cache")
        if options.branches is not None:
            if "branched" not in family.schedules:
                raise InputError(f"branches applies to schedule 'branched', which "
                                 f"{family.title} models do not have", "branches")
            options_lib.branches(options.branches, "branched", width or validate.MAX_CACHE,
                                 family.width_name)
        return width

    def options_for(self, options: DecodeOptions, c: Candidate) -> DecodeOptions:
        """`options` with the candidate's schedule, width and branches."""
        return dataclasses.replace(options, **{"width": None, "branches": None,
                                               **c.options(self.family)})

    def observe(self, results, iteration_s: float | None = None) -> None:
        """Adds decodes of one "auto" choice (DecodeResults, their `auto` set, decoded
        together) to the acceptance model's running tally, and their seconds per
        iteration to the cost feedback: `iteration_s` (slots refilled as they end), or
        by default their wall time over their mean iterations (one decode, or a batch
        whose rows idle once done), beside the prediction's over its `busy`. A decode
        that compiled or read its program is not timed: a program's first run is
        slower than the rest by its setup."""
        r = results[0]
        c = Candidate(r.schedule, r.width, r.branches)
        self.acceptance.observe(c, r.auto["sampled"], results)
        if any(x.compile_s > 0 for x in results):
            return
        if iteration_s is None:
            iterations = sum(x.iterations for x in results) / len(results)
            if iterations <= 0:   # the first call alone: no iteration to time
                return
            iteration_s = max(x.wall_s for x in results) / iterations
        self.feedback.observe(c, (r.auto["sequences"], r.auto["refilled"]),
                              r.auto["base_iteration_s"] / r.auto["busy"], iteration_s,
                              explored=r.auto["explored"])


def _log_ratio(measured: float | None, predicted: float) -> float | None:
    """log(measured / predicted), or None where there is no finite one."""
    if measured is None or not (measured > 0 and predicted > 0):
        return None
    x = math.log(measured / predicted)
    return x if math.isfinite(x) else None


def _read(path: Path | None, c: Candidate) -> Tally | None:
    """The prior of `c` kept in `path`; None (and a warning for a file that is there)
    when there is none to trust: such a file is measured anew and replaced."""
    try:
        data = None if path is None else cost_lib.read_json(path)
        if data is None:
            return None
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError("not an acceptance calibration of this version")
        prior = AcceptanceModel.from_prior_json(data["prior"]).prior
        if list(prior) != [c]:
            raise ValueError(f"not a calibration of {c} alone")
        return prior[c]
    except (ValueError, KeyError, OverflowError, RecursionError) as e:
        log.warning("%s is not a readable acceptance calibration (%s); measuring anew", path,
                    type(e).__name__ if isinstance(e, RecursionError) else e)
        return None


def _write(path: Path | None, c: Candidate, tally: Tally) -> None:
    if path is None:
        return
    try:
        cost_lib.write_json(path, {"version": VERSION,
                                   "prior": AcceptanceModel({c: tally}).prior_json()})
    except OSError as e:   # the measurement still serves this process
        log.warning("could not keep the acceptance calibration in %s: %s", path.parent, e)
