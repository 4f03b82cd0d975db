"""Continuous batching: every request decoded in a slot of a batched decode state, beside
the requests already running, by the one thread that makes JAX calls.

The server decodes with one schedule, width and cache capacity (`--max-model-len`), and
every request on the schedule's sampled program (`options.on_sampled_program`: a greedy
request is one at temperature 0, decoded as data), so requests differ only in their
prompt bucket and in data. There is one decode state of `slots` sequences
(`Engine.slots`); everything a request asks for (temperature, top-p, seed, stops, max
tokens) is data of its slot, and every running slot advances in the same call. (A
schedule or order that decodes greedily only, SetDLM's native decoder or its confidence
order, serves on its greedy program; sampled requests are refused there.) Every program
the server can run (the first call at every prompt bucket, and insert, generate, halt
and outcome, and the scoring forward of logprobs and echo at every length bucket) is
compiled, or read from the persistent compilation cache, by `warm` before the server
takes requests: no request compiles.

The loop, on the decoder thread:

- admit: each waiting request, while a slot is free, gets its first call
  (`Engine.prefill`) written into that slot (`Engine.insert`);
- launch: the state runs at most `steps` loop iterations (`Engine.dispatch`), and the
  ids each slot made final go to its request's `Chunker` and on to the client;
- a slot whose sequence stopped in the loop (EOS, a stop marker, its length), whose
  output reached a stop text, or whose client went away is stopped (`Engine.halt`), read
  out (`Engine.outcome`) and freed for the next admit.

Each slot evolves as its request decoded alone would (the same first call, then the same
step: the batched step is the step applied to every slot), so every response has the
tokens `decode` gives that request alone, greedy or sampled with its seed. `steps` sets
how often the host hears from the device: fewer iterations per launch reach a client
sooner and start a waiting request sooner, at one host round trip per launch.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import queue
import threading
import time

import numpy as np

from .. import memory, scoring
from ..chunks import Chunker, StreamChunk
from ..engine import Engine, keep_at_least, to_host
from ..validate import InputError
from ..options import DecodeOptions, Program, Request, bucket_for, on_sampled_program
from ..results import DecodeResult, check_finite, of_outcome
from .errors import draining
from .metrics import Metrics

DEFAULT_SLOTS = 8     # --max-num-seqs
DEFAULT_STEPS = 4     # --steps-per-launch: loop iterations between the host's looks
# One program per prompt bucket, plus these five.
_PER_STATE = ("empty", "insert", "generate", "halt", "outcome")


class Job:
    """One request (its `n` choices, each a checked request with its own seed) on its way
    through the decoder thread. Items come back through an asyncio queue on the event
    loop: (choice, StreamChunk, Scores or None) triples, an exception (re-raised there),
    None at the end. `score` (formats.Score): what to score, once a choice has ended, or
    with every chunk when `streamed` (then each chunk's Scores cover the prompt and the
    output up to the chunk's end)."""

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
class _Seat:
    """One choice of a job, in a slot: what has been handed out of it so far."""

    job: Job
    index: int          # the choice
    request: Request
    chunker: Chunker
    started: float
    count: int = 0      # leading output ids handed to the chunker


class _Pool:
    """The slots: their decode state and which seat each slot holds."""

    def __init__(self, engine: Engine, program: Program, slots: int):
        self.program = program
        self.state = engine.slots(program, slots)
        self.seats: list[_Seat | None] = [None] * slots

    def free(self) -> int | None:
        return next((i for i, s in enumerate(self.seats) if s is None), None)

    @property
    def busy(self) -> int:
        return sum(s is not None for s in self.seats)


class Batcher:
    """The decoder thread: admits requests into slots, launches, streams, frees."""

    def __init__(self, model, defaults: dict, slots: int = DEFAULT_SLOTS,
                 steps: int = DEFAULT_STEPS):
        self.engine = Engine.of(model)
        self.defaults, self.slots, self.steps = defaults, slots, steps
        self.capacity = defaults["cache_size"]
        self.program, self.sampled = self._slot_program()
        self.pool: _Pool | None = None   # made by `warm`
        self.jobs: queue.Queue = queue.Queue()
        self.waiting: collections.deque = collections.deque()   # (job, choice) to admit
        self.live: set[Job] = set()   # submitted and not yet ended
        self.thread = threading.Thread(target=self._work, name="packed-ss-decoder", daemon=True)
        self.draining = False
        self.expired = asyncio.Event()   # set at the drain's deadline (on the event loop)
        self.cancelled = 0   # requests whose client left before the decode finished
        self.warm_s = 0.0
        self.programs = 0
        self.metrics = Metrics(lambda: self.queued, lambda: self.busy_slots, slots)

    # --- startup -----------------------------------------------------------------------

    def _slot_program(self) -> tuple[Program, bool]:
        """The slots' program (bucket 0), and whether it samples: the schedule's sampled
        program, or its greedy one where it decodes greedily only."""
        try:
            request = self.engine.request([1], self._options(temperature=1.0))
        except InputError:   # SetDLM's native decoder, or its confidence order
            request = self.engine.request([1], self._options())
            return dataclasses.replace(request.program, bucket=0), False
        return dataclasses.replace(on_sampled_program(request).program, bucket=0), True

    def _options(self, **sampling) -> DecodeOptions:
        return DecodeOptions(**self.defaults, max_new_tokens=1, **sampling)

    def seated(self, request: Request) -> Request:
        """`request` on the slots' program."""
        return on_sampled_program(request) if self.sampled else request

    def buckets(self) -> list[int]:
        """Every prompt bucket a request that fits the capacity can have."""
        lengths, n = [1], 16
        while n < self.capacity:
            lengths.append(n)
            n *= 2
        lengths.append(self.capacity - 1)
        return sorted({bucket_for(x, self.capacity) for x in lengths if x >= 1})

    def warm(self) -> None:
        """Compiles (or reads from the persistent cache) every program a request can need,
        by running each once: the first call at every bucket, inserted into the state,
        launched, halted and read out, and the scoring forward at every length bucket.
        Refuses, before allocating, a state that cannot fit in memory."""
        buckets, program = self.buckets(), self.program
        scored = sorted({min(b, self.capacity) for b in buckets} | {self.capacity})
        self.programs = len(buckets) + len(_PER_STATE) + len(scored)
        keep_at_least(self.programs + 8)
        e = self.engine
        memory.check(e.model, dataclasses.replace(program, bucket=buckets[-1]), self.capacity,
                     self.slots, "a smaller --max-model-len or --max-num-seqs")
        t0 = time.perf_counter()
        for n in scored:   # logprobs and echo: prompt and output scored (scoring.py)
            scoring.score(e, [1] * n)
        pool = self.pool = _Pool(e, program, self.slots)
        for b in buckets:
            request = e.request([1] * min(b, self.capacity - 1), self._options())
            pool.state = e.insert(e.prefill(self.seated(request)), pool.state, 0)
        pool.state, _ = e.generate(pool.state, self.steps, program)
        pool.state = e.halt(pool.state, 0, program)
        e.outcome(pool.state, program)
        self.warm_s = time.perf_counter() - t0

    # --- the event loop's side ---------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=timeout)

    def submit(self, job: Job) -> None:
        if self.draining:
            raise draining()
        self.live.add(job)
        self.jobs.put(job)

    def ended(self, job: Job) -> None:
        self.live.discard(job)

    def abort_all(self) -> None:
        """The drain's deadline: every request still running or waiting ends with a 503."""
        self.expired.set()
        for job in list(self.live):
            job.abort(draining())

    @property
    def busy_slots(self) -> int:
        return 0 if self.pool is None else self.pool.busy

    @property
    def queued(self) -> int:
        return self.jobs.qsize() + len(self.waiting)

    # --- the decoder thread ------------------------------------------------------------

    def _work(self) -> None:
        while self._take(block=not self.busy_slots and not self.waiting):
            try:
                self._admit()
                if self.busy_slots:
                    self._launch()
            except Exception as e:  # a bug: every request in a slot hears of it
                self._fail_all(e)

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
        still = collections.deque()
        for job, i in self.waiting:
            if job.cancelled.is_set():
                self._drop(job)
                continue
            if job.score is not None and job.score.only:
                self._score_only(job, i)
                continue
            pool, request = self.pool, self.seated(job.choices[i])
            slot = pool.free()
            if slot is None:
                still.append((job, i))
                continue
            e = self.engine
            pool.state = e.insert(e.prefill(request), pool.state, slot)
            tokenizer = getattr(e.model, "tokenizer", None)
            pool.seats[slot] = _Seat(job, i, request, Chunker(tokenizer, request.stop_texts),
                                     time.perf_counter())
        self.waiting = still

    def _score_only(self, job: Job, index: int) -> None:
        """A choice that generates nothing (`max_tokens: 0`): its prompt scored, no slot."""
        request, t0 = job.choices[index], time.perf_counter()
        seat = _Seat(job, index, request, Chunker(None), t0)
        try:
            scores = scoring.score(self.engine, request.prompt, job.score.top)
        except Exception as error:  # reported to that request; the others go on
            self._close(seat, error)
            return
        p = request.program
        result = DecodeResult(tokens=[], nfe=1, iterations=0, accept_hist=np.zeros(1, int),
                              wall_s=time.perf_counter() - t0, compile_s=0.0,
                              schedule=p.schedule, prompt_len=len(request.prompt), drafts=0,
                              text="", family=p.family, order=p.order)
        job.put((index, StreamChunk([], "", result), scores))
        self._close(seat, None)

    def _drop(self, job: Job) -> None:
        """A waiting job whose client went away: counted once, never started."""
        if not job.finished:
            job.finished = True
            self.cancelled += 1
            self.metrics.ended("cancelled")

    def _launch(self) -> None:
        pool = self.pool
        pool.state, progress = self.engine.dispatch(pool.state, self.steps, pool.program)
        tokens, final, done, _ = to_host(progress)  # why it stopped: in the outcome
        self._hand_out(pool, tokens, final, done)

    def _hand_out(self, pool: _Pool, tokens, final, done) -> None:
        """Each seat's newly final ids to its client; seats that are done are freed."""
        ending = []
        for slot, seat in enumerate(pool.seats):
            if seat is None:
                continue
            count = int(final[slot])
            new = np.asarray(tokens[slot][seat.count:count]).tolist()
            seat.count = count
            chunk = seat.chunker.add(new, bool(done[slot]))
            if (seat.job.cancelled.is_set() or seat.job.finished or seat.chunker.ended
                    or done[slot]):
                ending.append((slot, bool(done[slot])))
            elif chunk is not None:
                try:
                    scores = self._streamed_scores(seat, chunk, tokens[slot][:count])
                except Exception as error:  # reported to that request; the others go on
                    self._close(seat, error)
                    ending.append((slot, False))
                    continue
                self._put(seat, chunk, scores)
        if ending:
            self._finish(pool, ending)

    def _finish(self, pool: _Pool, ending: list[tuple[int, bool]]) -> None:
        e, program = self.engine, pool.program
        for slot, done in ending:
            if not done:  # ended on the host: stop it in the loop too
                pool.state = e.halt(pool.state, slot, program)
        outcome = e.outcome(pool.state, program)
        for slot, done in ending:
            seat = pool.seats[slot]
            pool.seats[slot] = None
            if seat.job.cancelled.is_set():
                self._close(seat, None)
                continue
            if seat.job.finished:   # another of its choices failed: nothing more to send
                continue
            out = {name: x[slot] for name, x in outcome.items()}
            if not done:  # the output so far: only its final ids
                out["n_tokens"] = seat.count
            try:
                check_finite(out["nonfinite_at"], out["iterations"], out["tokens"])
                result = of_outcome(e.model, e.family, seat.request, out,
                                    time.perf_counter() - seat.started, 0.0)
                scores = None if seat.job.score is None else scoring.score(
                    e, list(seat.request.prompt) + result.tokens, seat.job.score.top)
            except Exception as error:  # reported to that request; the others go on
                self._close(seat, error)
                continue
            self._put(seat, seat.chunker.last(result), scores)
            self.metrics.finished(result, seat.job.first_token_s,
                                  time.perf_counter() - seat.job.submitted)
            self._close(seat, None)

    def _streamed_scores(self, seat: _Seat, chunk, output):
        """A streamed chunk's scores, when its request asked for them and the chunk has
        tokens: the prompt and the output so far, scored (one forward per chunk)."""
        job = seat.job
        if job.score is None or not job.streamed or not chunk.tokens:
            return None
        return scoring.score(self.engine, list(seat.request.prompt) + list(output),
                             job.score.top)

    def _put(self, seat: _Seat, chunk, scores=None) -> None:
        job = seat.job
        if job.first_token_s is None and chunk.tokens:
            job.first_token_s = time.perf_counter() - job.submitted
            self.metrics.first_token(job.first_token_s)
        job.put((seat.index, chunk, scores))

    def _close(self, seat: _Seat, error: Exception | None) -> None:
        """One choice has ended; the job ends with its last choice (or its first error)."""
        job = seat.job
        if job.finished:
            return
        if job.cancelled.is_set():
            self.cancelled += 1
            self.metrics.ended("cancelled")
            job.finished = True
            return
        if error is not None:
            self.metrics.ended("error")
            job.open = 0
            job.put(error)
        else:
            job.open -= 1
        if job.open == 0:
            job.finished = True
            job.put(None)

    def _fail_all(self, error: Exception) -> None:
        """An error no single request caused: every seated request ends with it and its
        slot is freed (the state is rebuilt, since a failed launch may have consumed it)."""
        for seat in self.pool.seats:
            if seat is not None:
                self._close(seat, error)
        self.pool = _Pool(self.engine, self.program, self.slots)
