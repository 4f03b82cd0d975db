"""`EngineClient`: what a server needs of the engine, behind one object (check, submit,
abort, metrics), and the decoder thread that serves its requests on one `Scheduler`.

The server decodes with one schedule, width and cache capacity (`--max-model-len`), and
every request on the schedule's sampled program (a greedy request is one at temperature
0, decoded as data), so requests differ only in their prompt bucket and in data: one
decode state of `slots` slots, every running slot advancing in the same launch. (SetDLM's
native decoder and its confidence order decode greedily only: they serve on their
greedy program and refuse sampled requests.) `warm` compiles, or reads from disk, every
program a request can need, so no request compiles: before the server listens, or (a
client `start`ed cold) first thing on the decoder thread, while requests queue up.

The decoder thread loops: admit waiting requests into free slots (a prefill each);
launch `steps` iterations; hand each slot's newly final ids to its request's `Chunker`
and client; take out the slots that stopped in the loop, reached a stop text or lost
their client. Every response has the tokens `decode` gives that request alone.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

import numpy as np

from . import api, memory, planner as planner_lib, programs, scoring, validate
from .chunks import Chunker, StreamChunk
from .engine import Engine
from .options import DecodeOptions, Program, Request, bucket_for, on_sampled_program
from .planner import AUTO
from .results import DecodeResult
from .scheduler import Ended, Scheduler, Update
from .serving_auto import ServingAuto
from .serving_metrics import Metrics
from .validate import InputError

DEFAULT_SLOTS = 8     # --max-num-seqs
DEFAULT_STEPS = 4     # --steps-per-launch: loop iterations between the host's looks
# One program per prompt bucket, plus these five.
_PER_STATE = ("empty", "insert", "generate", "halt", "outcome")


log = logging.getLogger(__name__)


def _options(defaults: dict, **sampling) -> DecodeOptions:
    """A one-token request's options on a server whose requests all get `defaults`."""
    return DecodeOptions(**defaults, max_new_tokens=1, **sampling)


class Draining(Exception):
    """The client takes no more requests: its server is shutting down."""


class Job:
    """One request (its `n` choices, each a checked request with its own seed) on its way
    through the decoder thread. Items come back through an asyncio queue on the event
    loop: (choice, StreamChunk, Scores or None) triples, an exception (re-raised there),
    None at the end. `score` (a format's Score): what to score, once a choice has ended,
    or with every chunk when `streamed` (each chunk's scores then cover the prompt and
    the output up to the chunk's end)."""

    def __init__(self, choices: list[Request], loop: asyncio.AbstractEventLoop, score=None,
                 streamed: bool = False):
        self.choices, self.loop, self.score, self.streamed = choices, loop, score, streamed
        self.out: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.finished = False   # the decoder's last item is in `out`
        self.open = len(choices)   # choices not finished yet
        self.submitted = time.perf_counter()
        self.first_token_s: float | None = None

    @property
    def prompt_tokens(self) -> int:
        """The prompts' tokens, each prompt counted once (not once per choice)."""
        seen = {id(c.prompt): len(c.prompt) for c in self.choices}
        return sum(seen.values())

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)

    def abort(self, error: Exception) -> None:
        """Ends the request now with `error` (on the event loop's thread); the decoder
        frees its slots at its next launch."""
        if not self.finished and not self.cancelled.is_set():
            self.cancelled.set()
            self.out.put_nowait(error)
            self.out.put_nowait(None)


@dataclasses.dataclass
class Choice:
    """A seat's tag: which choice of which job, and its chunker."""

    job: Job
    index: int
    chunker: Chunker


class EngineClient:
    """The engine as a server sees it: `check` a prompt and its options into a Request,
    `submit` a Job, `abort_all`, the gauges (`queued`, `busy_slots`), and an `observer`
    told of first tokens and ended requests (the server's metrics)."""

    def __init__(self, model, defaults: dict, slots: int = DEFAULT_SLOTS,
                 steps: int = DEFAULT_STEPS):
        self.engine = Engine.of(model)
        self.model = model
        self.slots = validate.integer(slots, "slots", 1)
        self.steps = validate.integer(steps, "steps", 1, validate.INT32_MAX,
                                      "the loop counts iterations in int32")
        self.capacity = defaults["cache_size"]
        self.auto: ServingAuto | None = None   # schedule "auto" (serving_auto.py)
        if defaults["schedule"] == AUTO:
            shape = {k: v for k, v in defaults.items() if k not in ("schedule", "cache_size")}
            self.auto = ServingAuto(model, self.capacity, shape or None, slots)
            defaults = self._defaults_for(self.auto.choice)
        self.defaults = defaults
        self.program, self.sampled = self._slot_program(defaults)
        self.scheduler: Scheduler | None = None   # made by `warm`
        # auto's next choice: readied on a thread of its own (`_ready_move`), then moved
        # to once the slots are empty (`_move`)
        self._moving: threading.Thread | None = None
        self._moved: tuple[planner_lib.Choice, dict, Program, Scheduler] | None = None
        self._refused: set = set()   # candidates that could not be readied
        self.jobs: queue.Queue = queue.Queue()
        self.waiting: collections.deque = collections.deque()   # (job, choice) to admit
        self.live: set[Job] = set()   # submitted and not yet ended
        self.thread = threading.Thread(target=self._work, name="packed-ss-decoder", daemon=True)
        self.draining = False
        self.cancelled = 0   # requests whose client left before the decode finished
        self.warm_s = 0.0
        self.programs = 0
        self.loaded = 0   # programs read from disk by `warm`
        self.ready = threading.Event()   # set once `warm` has ended well
        self.settled = threading.Event()   # set once `warm` has ended, well or not
        self.failed: BaseException | None = None   # why `warm` failed on the decoder thread
        # Told on the decoder thread when a warm-up there ends (None: ready; else its error).
        self.on_ready: Callable[[BaseException | None], None] = lambda error: None
        self._plan: tuple[list[int], list[int]] | None = None
        self.metrics = Metrics(lambda: self.queued, lambda: self.busy_slots, self.slots)
        self.metrics.schedule_in_use(self.label, None if self.auto is None else
                                     self.auto.summary["predicted_tokens_per_s"])

    @property
    def label(self) -> str:
        """The schedule served, with its width and branches (as `auto` labels them)."""
        return self.program.shape.label(self.engine.family)

    # --- startup -----------------------------------------------------------------------

    def _defaults_for(self, choice: planner_lib.Choice) -> dict:
        """The options every request gets on this server, with `choice`'s schedule."""
        return {**choice.candidate.options(self.engine.family), "cache_size": self.capacity}

    def _slot_program(self, defaults: dict) -> tuple[Program, bool]:
        """The slots' program (bucket 0), and whether it samples: the schedule's sampled
        program, or its greedy one where it decodes greedily only."""
        try:
            request = self.engine.request([1], _options(defaults, temperature=1.0))
        except InputError:   # SetDLM's native decoder, or its confidence order
            request = self.engine.request([1], _options(defaults))
            return dataclasses.replace(request.program, bucket=0), False
        return dataclasses.replace(on_sampled_program(request).program, bucket=0), True

    def seated(self, request: Request, program: Program | None = None) -> Request:
        """`request` on the slots' program (or `program`): its schedule, width and k
        those of the slots, so that a request checked before `auto` moved is decoded by
        the new choice (greedy, the same tokens; sampled, its seed's with that schedule,
        which its result reports)."""
        program = program or self.program
        if request.program.shape != program.shape:
            request = dataclasses.replace(request, program=dataclasses.replace(
                request.program, shape=program.shape))
        return on_sampled_program(request) if self.sampled else request

    def buckets(self) -> list[int]:
        """Every prompt bucket a request that fits the capacity can have."""
        lengths, n = [1], 16
        while n < self.capacity:
            lengths.append(n)
            n *= 2
        lengths.append(self.capacity - 1)
        return sorted({bucket_for(x, self.capacity) for x in lengths if x >= 1})

    def plan(self) -> None:
        """What `warm` readies, counted (`programs`), and refused, before anything is
        allocated or compiled, when a state of it cannot fit in memory."""
        buckets, e = self.buckets(), self.engine
        scored = sorted({min(b, self.capacity) for b in buckets} | {self.capacity})
        self.programs = len(buckets) + len(_PER_STATE) + len(scored)
        # auto holds a second choice's programs while it moves to it
        programs.keep_at_least(self.programs * (1 if self.auto is None else 2) + 8)
        memory.check(e.model, dataclasses.replace(self.program, bucket=buckets[-1]),
                     self.capacity, self.slots, "a smaller --max-model-len or --max-num-seqs")
        self._plan = buckets, scored

    def warm(self) -> None:
        """Readies every program a request can need (Engine.warm): those kept on disk are
        read, on several threads; the rest are compiled by running each once (the first
        call at every bucket into a slot, taken out, a launch, and the scoring forward at
        every length bucket)."""
        if self._plan is None:
            self.plan()
        t0 = time.perf_counter()
        self.scheduler, self.loaded = self._readied(self.defaults, self.program)
        self.warm_s = time.perf_counter() - t0
        self.ready.set()
        self.settled.set()

    def _readied(self, defaults: dict, program: Program) -> tuple[Scheduler, int]:
        """A scheduler of `program` for the slots, every program a request can need on
        it compiled or read from disk (Engine.warm); and how many were read."""
        buckets, scored = self._plan
        s = Scheduler(self.engine, program, self.slots)
        label = repr(("server", program, self.slots, self.steps, buckets, scored))
        loaded, _ = self.engine.warm(label, self._tasks(s, defaults, program, buckets, scored),
                                     self.programs)
        return s, loaded

    def _tasks(self, s: Scheduler, defaults: dict, program: Program, buckets: list[int],
               scored: list[int]) -> list[Callable[[], None]]:
        """The warm-up, as tasks that may run side by side: the slots' programs in one
        (each admit takes the state the one before it left), each bucket's first call
        and each scoring length (logprobs, echo: scoring.py) on their own."""
        e = self.engine

        def request(b: int) -> Request:
            return self.seated(e.request([1] * min(b, self.capacity - 1), _options(defaults)),
                               program)

        def slots() -> None:
            # The first admit into an empty state may adopt the prefill's state: the first
            # bucket comes twice, so that an insert is compiled however many buckets there
            # are.
            for b in buckets[:1] + buckets:
                s.admit([request(b)], [None])
                s.release([(0, False)])
            s.updates(s.launch(self.steps))

        # the largest buckets first: the slots' task reaches them last
        first_calls = [lambda b=b: e.prefill([request(b)]) for b in reversed(buckets[1:])]
        scores = [lambda n=n: scoring.score(e, [1] * n) for n in reversed(scored)]
        return [slots, *first_calls, *scores]

    # --- the event loop's side ---------------------------------------------------------

    def check(self, prompt, options: DecodeOptions) -> Request:
        """The checked request of one prompt's ids and options on this server's schedule,
        width and capacity (api.check; no JAX work)."""
        return api.check(self.model, prompt, dataclasses.replace(options, **self.defaults))

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=timeout)

    def submit(self, choices: list[Request], score=None, streamed: bool = False) -> Job:
        """A request's checked choices, queued for the decoder thread (on the event loop:
        its items come back there): its `Job`."""
        if self.draining:
            raise Draining()
        job = Job(choices, asyncio.get_running_loop(), score, streamed)
        self.live.add(job)
        # A warm-up that failed since the check above may have aborted every live job
        # before this one was added: no decoder will ever take it.
        if self.failed is not None:
            self.live.discard(job)
            raise Draining()
        self.jobs.put(job)
        return job

    def ended(self, job: Job) -> None:
        self.live.discard(job)

    def abort_all(self, error: Exception) -> None:
        """Every request still running or waiting ends with `error` (a drain's deadline)."""
        for job in list(self.live):
            job.abort(error)

    @property
    def busy_slots(self) -> int:
        return 0 if self.scheduler is None else self.scheduler.busy

    @property
    def queued(self) -> int:
        return self.jobs.qsize() + len(self.waiting)

    # --- the decoder thread ------------------------------------------------------------

    def _work(self) -> None:
        if not self.ready.is_set() and not self._warm_here():
            return
        while self._take(block=not self.busy_slots and not self.waiting):
            try:
                self._admit()
                if self.busy_slots:
                    self._launch()
            except Exception as e:  # a bug: every request in a slot hears of it
                self._fail_all(e)

    def _warm_here(self) -> bool:
        """`warm` on the decoder thread (a client started cold); False if it failed: then
        every request submitted so far ends with the error `on_ready` is told of."""
        try:
            self.warm()
        except Exception as e:
            self.failed = e
            self.settled.set()
        self.on_ready(self.failed)
        return self.failed is None

    def abort_all_soon(self, error: Exception) -> None:
        """`abort_all` from another thread than the event loop's."""
        for job in list(self.live):
            job.loop.call_soon_threadsafe(job.abort, error)

    def _take(self, block: bool) -> bool:
        """Moves submitted jobs to the waiting line (waiting for one when idle); False
        once the server stops."""
        try:
            job = self.jobs.get(block=block)
        except queue.Empty:
            return True
        while True:
            if job is None:
                return False
            self.waiting.extend((job, i) for i in range(len(job.choices)))
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return True

    def _admit(self) -> None:
        """Waiting choices start in free slots, in order of arrival."""
        if self._moved is not None and not self.busy_slots:
            self._move()
        still = collections.deque()
        for job, i in self.waiting:
            if job.cancelled.is_set():
                self._drop(job)
            elif job.finished:   # another of its choices failed
                continue
            elif job.score is not None and job.score.only:
                self._score_only(job, i)
            elif self._moved is not None or not self.scheduler.free:
                still.append((job, i))   # (auto moves once the slots are empty)
            else:
                request = self.seated(job.choices[i])
                choice = Choice(job, i, Chunker(getattr(self.model, "tokenizer", None),
                                                request.stop_texts))
                try:
                    self.scheduler.admit([request], [choice])
                except Exception as error:  # reported to that request; the others go on
                    self._close(choice, error)
        self.waiting = still

    def _score_only(self, job: Job, index: int) -> None:
        """A choice that generates nothing (`max_tokens: 0`): its prompt scored, no slot."""
        request, t0 = job.choices[index], time.perf_counter()
        choice = Choice(job, index, Chunker(None))
        try:
            scores = scoring.score(self.engine, request.prompt, job.score.top)
        except Exception as error:  # reported to that request; the others go on
            self._close(choice, error)
            return
        p = request.program
        result = DecodeResult(tokens=[], nfe=1, iterations=0, accept_hist=np.zeros(1, int),
                              wall_s=time.perf_counter() - t0, compile_s=0.0,
                              schedule=p.schedule, prompt_len=len(request.prompt), drafts=0,
                              text="", family=p.family, order=p.order)
        job.put((index, StreamChunk([], "", result), scores))
        self._close(choice, None)

    def _drop(self, job: Job) -> None:
        """A waiting job whose client went away: counted once, never started."""
        if not job.finished:
            self._end_early(job, "cancelled")

    def _launch(self) -> None:
        """`steps` iterations of every slot, and what they made final handed out."""
        t0, compiled = time.perf_counter(), self.engine.compile_s
        launch = self.scheduler.launch(self.steps)
        updates = self.scheduler.updates(launch)
        if self.auto is not None:
            # A launch that shared the device with a move's compile and warm-up is not
            # what the current choice costs.
            beside = self._moving is not None or self.engine.compile_s != compiled
            self._learn(time.perf_counter() - t0, None if beside else int(launch.ran))
        self._hand_out(updates)

    # --- auto: learning between launches, moving to another choice (serving_auto.py) ----

    def _learn(self, seconds: float, ran: int | None) -> None:
        """A launch of `ran` iterations (None: not to be learnt from) took `seconds`;
        a new choice that differs from the slots' is readied, one that no longer
        differs drops a move readied meanwhile."""
        try:
            choice = self.auto.launched(seconds, ran)
        except Exception as e:  # the choice is a speed's, never the requests': stay
            log.warning("packed_ss_jax: schedule auto could not choose again (%s: %s); "
                        "staying on %s", type(e).__name__, e, self.label)
            return
        if choice is None:
            return
        pending = self._moved
        if pending is not None and pending[0].candidate != choice.candidate:
            self._moved = None   # readied for a choice made since: not moved to
        if choice.candidate != self.auto.choice.candidate and self._moving is None \
                and self._moved is None and choice.candidate not in self._refused:
            self._moving = threading.Thread(target=self._ready_move, args=(choice,),
                                            name="packed-ss-auto-move", daemon=True)
            self._moving.start()

    def _ready_move(self, choice: planner_lib.Choice) -> None:
        """On a thread of its own, while the slots go on decoding: the programs of
        `choice` compiled or read (a failure: one warning; the server stays, and does
        not try that candidate again until it has moved)."""
        try:
            defaults = self._defaults_for(choice)
            program, sampled = self._slot_program(defaults)
            if sampled != self.sampled:
                raise InputError("it does not sample as the server does", "schedule")
            memory.check(self.engine.model,
                         dataclasses.replace(program, bucket=self._plan[0][-1]),
                         self.capacity, self.slots)
            scheduler, _ = self._readied(defaults, program)
            self._moved = (choice, defaults, program, scheduler)
        except Exception as e:  # the server goes on with its choice
            self._refused.add(choice.candidate)
            log.warning("packed_ss_jax: schedule auto stays on %s: %s cannot be readied "
                        "(%s: %s)", self.label, choice.candidate.label(self.engine.family),
                        type(e).__name__, e)
        finally:
            self._moving = None

    def _move(self) -> None:
        """The slots are empty: from now on they decode with the readied choice, and the
        previous choice's programs are let go (the bound on held programs keeps two
        choices' worth, not more)."""
        old = self.program.shape
        choice, self.defaults, self.program, self.scheduler = self._moved
        self._moved = None
        self._refused.clear()
        self.engine.forget(lambda key: getattr(key.program, "shape", None) != old)
        self.auto.moved(choice)
        self.metrics.schedule_in_use(self.label, choice.predicted_tokens_per_s)

    @property
    def running(self) -> bool:
        """Whether a thread of this client is still at work (the decoder's, or one
        readying auto's next choice)."""
        moving = self._moving
        return self.thread.is_alive() or (moving is not None and moving.is_alive())

    def _hand_out(self, updates: list[Update]) -> None:
        """Each seat's newly final ids to its client; seats that are done are taken out."""
        ending = []
        for u in updates:
            choice = u.seat.tag
            chunk = choice.chunker.add(u.new, u.done)
            job = choice.job
            if job.cancelled.is_set() or job.finished or choice.chunker.ended or u.done:
                ending.append((u.slot, u.done))
            elif chunk is not None:
                try:
                    scores = self._streamed_scores(u, chunk)
                except Exception as error:  # reported to that request; the others go on
                    self._close(choice, error)
                    ending.append((u.slot, False))
                    continue
                self._put(choice, chunk, scores)
        for ended in self.scheduler.release(ending):
            try:
                self._finish(ended)
            except Exception as error:  # that request hears of it; the others still end
                self._close(ended.seat.tag, error)

    def _finish(self, ended: Ended) -> None:
        choice = ended.seat.tag
        job = choice.job
        if job.cancelled.is_set():
            self._close(choice, None)
            return
        if job.finished:   # another of its choices failed: nothing more to send
            return
        try:
            result = self.scheduler.result(ended, time.perf_counter() - ended.seat.started)
            scores = None if job.score is None else scoring.score(
                self.engine, list(ended.seat.request.prompt) + result.tokens, job.score.top)
        except Exception as error:  # reported to that request; the others go on
            self._close(choice, error)
            return
        self._put(choice, choice.chunker.last(result), scores)
        self.metrics.finished(result, job.first_token_s, time.perf_counter() - job.submitted)
        if self.auto is not None:
            self.auto.finished(result)
        self._close(choice, None)

    def _streamed_scores(self, u: Update, chunk):
        """A streamed chunk's scores, when its request asked for them and the chunk has
        tokens: the prompt and the output so far, scored (one forward per chunk)."""
        job = u.seat.tag.job
        if job.score is None or not job.streamed or not chunk.tokens:
            return None
        output = list(u.output[: u.seat.count])
        return scoring.score(self.engine, list(u.seat.request.prompt) + output, job.score.top)

    def _put(self, choice: Choice, chunk, scores=None) -> None:
        job = choice.job
        if job.first_token_s is None and chunk.tokens:
            job.first_token_s = time.perf_counter() - job.submitted
            self.metrics.first_token(job.first_token_s)
        job.put((choice.index, chunk, scores))

    def _close(self, choice: Choice, error: Exception | None) -> None:
        """One choice has ended; the job ends with its last choice (or its first error)."""
        job = choice.job
        if job.finished:
            return
        if job.cancelled.is_set():
            self._end_early(job, "cancelled")
            return
        if error is not None:
            job.put(error)
            self._end_early(job, "error")
        else:
            job.open -= 1
        if job.open == 0:
            job.finished = True
            job.put(None)

    def _end_early(self, job: Job, outcome: str) -> None:
        """A job ended early ("cancelled": its client left; "error"): each of its choices
        still open ends so (the metrics count choices), the job once."""
        for _ in range(job.open):
            self.metrics.ended(outcome)
        if outcome == "cancelled":   # after the metrics: /health's count lags theirs
            self.cancelled += 1
        job.open, job.finished = 0, True

    def _fail_all(self, error: Exception) -> None:
        """An error no single request caused: every seated request ends with it and its
        slot is freed (the state is rebuilt, since a failed launch may have consumed it)."""
        for seat in self.scheduler.seats:
            if seat is not None:
                self._close(seat.tag, error)
        self.scheduler.reset()
