"""`Engine`: one loaded model, its family, its mesh and the device side of every decode.

Two ways to run a checked request (options.py):

- `decode(request)`: the fast path of one request, the first call and the whole
  `lax.while_loop` in one program (`Loop.run`), nothing returning to the host until the
  loop has stopped;
- the slot contract (batched.slot_functions) over a decode state of N slots: `slots`
  (an empty state), `prefill` (the first calls of M requests), `insert` (them into
  slots), `generate` (k iterations, or until a slot stops), `outcome`, `halt`. The host
  `Scheduler` (scheduler.py) drives it for a batch, a queue, a stream and the server.

Programs are lowered and compiled ahead of time once per shape (programs.py); a state
passed between programs is donated, so the KV cache is updated in place. On a mesh (a
model loaded with `mesh=`) arguments are placed on it: slots split over "data", each call
tensor-parallel over "model".
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import (batched, executables, families, options as options_lib, programs, sharding,
               stops, validate)
from .options import Batch, DecodeOptions, Program, Request
from .programs import Key
from .results import DecodeResult, of_outcome
from .validate import INT32_MAX


class Prefix(NamedTuple):
    """The first calls of M requests (`prefill`): their states, leading axis M (padding
    rows repeat the first request), ready to `insert`."""

    requests: tuple[Request, ...]
    state: Any


class Launch(NamedTuple):
    """What `generate` hands back (device arrays; read with `to_host`): the state after
    it, each slot's progress (output tokens, final count, done, stopped by a stop marker),
    the iterations it ran and the batched forward calls they made."""

    state: Any
    progress: batched.Progress
    ran: Any
    made: Any


def seeded(run: Callable) -> Callable:
    """`run(params, prompt, prompt_len, limits, key)` taking a seed instead of a key: the
    seed stays a traced argument, and the key is made inside the program."""
    return lambda params, prompt, prompt_len, limits, seed: run(
        params, prompt, prompt_len, limits, jax.random.PRNGKey(seed))


def arguments(request: Request, bucket: int | None = None) -> tuple:
    """A one-request program's arguments after params (see `seeded`), as numpy arrays: the
    prompt padded to `bucket` (default the program's), its length, the limits, the seed."""
    padded = np.zeros(request.program.bucket if bucket is None else bucket, np.int32)
    padded[: len(request.prompt)] = request.prompt
    return (padded, np.int32(len(request.prompt)), request.limits, np.uint32(request.seed))


def batch_arguments(requests, bucket: int) -> tuple:
    """The arguments of `requests` decoded together: each of `arguments`, stacked on a
    leading axis (rows of them are the arguments of a sub-batch)."""
    return jax.tree.map(lambda *x: np.stack([np.asarray(a) for a in x]),
                        *[arguments(r, bucket) for r in requests])


def to_host(out):
    """Device arrays as host arrays. With several processes (jax.distributed), an array
    split over devices of other processes is gathered, so every process reads all of it."""
    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(out)):
        return jax.device_get(out)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(out, tiled=True)


def _slots_in(where, slots: int) -> list[int]:
    """Slot indices of a decode state of `slots` slots: the scheduler's own, so one
    outside is a bug (a ValueError, not the caller's InputError)."""
    bad = [w for w in where if not 0 <= w < slots]
    if bad:
        raise ValueError(f"slots {bad} outside the state's {slots}")
    return list(where)


def _slot(program: Program) -> Program:
    """The program a decode state belongs to: its shape does not depend on the prompt
    bucket, so first calls of every bucket go into one state."""
    return dataclasses.replace(program, bucket=0)


class Engine:
    """A loaded model's decoding: checks, compiled programs, runs.

        engine = Engine.of(model)
        request = engine.request(prompt, DecodeOptions(schedule="packed", temperature=0.7))
        result = engine.decode(request)              # DecodeResult
    """

    def __init__(self, model, shared: bool = False):
        validate.check_model(model)   # once: an engine is made once per model object
        self.model = model
        self.family = families.of(model.config)
        self.mesh = sharding.mesh_of(model.params)
        # This engine's own programs, or (`Engine.of`) those of every engine of a model
        # with this config on these devices.
        self._programs = (programs.shared(model) if shared
                          else programs.Programs(programs.identity(model)))
        self._slot_fns: dict = {}   # batched.SlotFunctions by (slot program, slots)
        self.compile_s = 0.0   # seconds this engine spent compiling, all programs together
        self._placed: dict = {}   # generate's (k, eager) arguments, placed on the devices

    @classmethod
    def of(cls, model) -> Engine:
        """The engine of a model object, made on first use and kept with the model; it
        shares its compiled programs with the engines of models of the same shape on the
        same devices (programs.shared). `Engine(model)` has programs of its own."""
        engine = getattr(model, "_engine", None)
        if engine is None or engine.model is not model:
            engine = cls(model, shared=True)
            object.__setattr__(model, "_engine", engine)
        return engine

    # --- requests -------------------------------------------------------------------------

    def request(self, prompt, options: DecodeOptions = DecodeOptions(), seed=None) -> Request:
        """A checked request for one prompt (text or token ids); `seed` (if given) in place
        of the options' seed."""
        return options_lib.request(self.model, self.family, prompt, options, seed)

    def batch(self, prompts, options: DecodeOptions = DecodeOptions(), seed=None,
              sequences: int | None = None) -> Batch:
        """Checked requests for a batched decode (see options.batch); `seed` (if given) in
        place of the options' seed."""
        return options_lib.batch(self.model, self.family, prompts, options, seed, sequences)

    # --- compiling and placing -------------------------------------------------------------

    def compile(self, key, fn: Callable, *args, donate: tuple[int, ...] = ()):
        """`fn` compiled for `args` once per `key` (programs.Programs.compiled): the
        executable and the seconds spent compiling now."""
        exe, seconds = self._programs.compiled(key, fn, *args, donate=donate)
        self.compile_s += seconds
        return exe, seconds

    def preload(self, names=None) -> int:
        """Reads the programs of this model kept on disk by earlier processes (the entries
        `names`, default all; on several threads), so that those asked for later are
        neither compiled nor read one by one; returns how many (Programs.preload)."""
        t0 = time.perf_counter()
        n = self._programs.preload(names)
        self.compile_s += time.perf_counter() - t0
        return n

    def warm(self, label: str, tasks: Sequence[Callable[[], None]],
             total: int | None = None) -> tuple[int, bool]:
        """Readies the programs `tasks` ask for. When an earlier warm-up of this `label`
        (what decides which programs they ask for) noted them, those it kept on disk are
        read first (`preload`), and if that leaves none missing no task runs: nothing is
        left to compile. Else the tasks run side by side (programs.Warming.run; each
        compiled program is logged, of `total` expected), and what they asked for is
        noted under `label` for the next process. Returns (the programs read from disk
        here, whether the tasks ran)."""
        store = self._programs
        wanted = executables.recall(store.identity, label)
        loaded = self.preload([n for n in wanted.values() if n]) if wanted else 0
        if wanted is not None and set(wanted) <= {repr(k) for k in list(store)}:
            return loaded, False
        warming = store.recording = programs.Warming(total, loaded)
        try:
            warming.run(tasks)
        finally:
            store.recording = None
        executables.remember(store.identity, label,
                             {repr(k): store.entries.get(k) for k in warming.asked})
        return loaded, True

    def forget(self, keep: Callable) -> None:
        """Lets go of the compiled programs whose `programs.Key` `keep` refuses."""
        self._programs.drop(keep)

    def executables(self) -> dict:
        """The compiled programs held, by `programs.Key` (for profiling: `.as_text()`)."""
        return dict(self._programs)

    def place(self, args, batch: int | None = None):
        """`args` on the model's mesh when it has one (so that a program whose weights span
        several processes gets global arrays): replicated, or with `batch` given, every
        leaf's leading axis of `batch` entries split over "data". On one device, as they
        are."""
        if self.mesh is None:
            return jax.device_put(args)
        spec = (jax.sharding.PartitionSpec() if batch is None
                else sharding.batch_spec(self.mesh, batch))
        return jax.device_put(args, jax.sharding.NamedSharding(self.mesh, spec))

    def pinned(self, slots: int) -> Callable:
        """`pin(state)` for a state of `slots` sequences: on a mesh, every leaf constrained
        to where it lives (the cache as sharding.cache_spec, the rest split over "data" by
        slot), so the programs passing it to each other agree on it; else the identity."""
        if self.mesh is None:
            return lambda s: s
        NamedSharding = jax.sharding.NamedSharding
        rows = NamedSharding(self.mesh, sharding.batch_spec(self.mesh, slots))
        cache = NamedSharding(self.mesh, sharding.cache_spec(self.model.config, self.mesh, slots))

        def pin(s):
            rest = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, rows),
                                s.replace(cache=None))
            return batched.pin_cache(rest.replace(cache=s.cache), cache)

        return pin

    def loop(self, program: Program):
        """The family's decode loop (loop.Loop) of a program."""
        return self.family.build(self.model, program)

    # --- one request -----------------------------------------------------------------------

    def compiled(self, request: Request, args=None):
        """The one-request decode program of a request (compiled once; its loop is built
        only then) and the seconds spent compiling it now."""
        key = Key("decode", request.program)
        exe = self._programs.used(key)
        if exe is not None:
            return exe, 0.0
        args = self.place(arguments(request)) if args is None else args
        return self.compile(key, seeded(self.loop(request.program).run), self.model.params,
                            *args)

    def decode(self, request: Request) -> DecodeResult:
        """Decodes one checked request: compile (once), run, synchronise, read the outcome
        (NonFiniteError if the loop met NaN/Inf logits)."""
        args = self.place(arguments(request))
        exe, compile_s = self.compiled(request, args)
        t0 = time.perf_counter()
        out = jax.block_until_ready(exe(self.model.params, *args))
        wall = time.perf_counter() - t0
        return of_outcome(self.model, self.family, request, to_host(out), wall, compile_s)

    # --- the slot contract -----------------------------------------------------------------

    def _functions(self, program: Program, slots: int) -> batched.SlotFunctions:
        shape = (_slot(program), slots)
        if shape not in self._slot_fns:
            loop = self.loop(program)
            program = dataclasses.replace(program, bucket=max(program.bucket, 1))
            args = arguments(Request(program, np.zeros(1, np.int32), self._any_limits(), 0, 1))

            def one():
                return jax.eval_shape(seeded(loop.init), self.model.params,
                                      *jax.tree.map(jnp.asarray, args))

            self._slot_fns[shape] = batched.slot_functions(loop, one, slots,
                                                           self.pinned(slots))
        return self._slot_fns[shape]

    def _any_limits(self) -> dict:
        """Limits of every request's shapes (for a decode state's shape; never run)."""
        return {**stops.limits(None, self.model.config.vocab_size, 1, None, ()),
                "temperature": np.float32(1), "top_p": np.float32(1)}

    def slots(self, program: Program, slots: int):
        """A decode state of `slots` empty slots for `program`'s requests (each one
        stopped, so `generate` leaves it as it is until `insert` fills it)."""
        exe, _ = self.compile(Key("empty", _slot(program), slots),
                              self._functions(program, slots).empty)
        return exe()

    def prefill(self, requests, rows: int | None = None, bucket: int | None = None) -> Prefix:
        """The first calls of `requests` (one program, every request on it), in one call
        of `rows` rows (default their number; padding repeats the first) with prompts
        padded to `bucket` (default the program's)."""
        requests = tuple(requests)
        program = requests[0].program
        rows = len(requests) if rows is None else rows
        bucket = program.bucket if bucket is None else bucket
        args = self.place(batch_arguments(requests + requests[:1] * (rows - len(requests)),
                                          bucket), rows)
        exe, _ = self.compile(Key("prefill", dataclasses.replace(program, bucket=bucket),
                                  rows=rows),
                              self._functions(program, rows).prefill, self.model.params, *args)
        return Prefix(requests, exe(self.model.params, *args))

    def adopt(self, prefix: Prefix) -> Any | None:
        """A decode state whose slots are the prefix's rows, in order, when that needs no
        program (no padding rows; a prefill's rows are placed as a state of as many slots
        is): what `insert` into empty slots gives."""
        if len(prefix.requests) != int(prefix.state.done.shape[0]):
            return None
        return prefix.state

    def insert(self, state, prefix: Prefix, where) -> Any:
        """`state` (donated) with the first calls of `prefix` written into the slots
        `where` (one per request of the prefix)."""
        program, slots = prefix.requests[0].program, int(state.done.shape[0])
        rows = int(prefix.state.done.shape[0])
        at = np.full(rows, slots, np.int32)   # padding rows name no slot: dropped
        at[: len(where)] = _slots_in(where, slots)
        at = self.place(at, rows)
        exe, _ = self.compile(Key("insert", _slot(program), slots, rows),
                              self._functions(program, slots).insert, state, prefix.state, at,
                              donate=(0,))
        return exe(state, prefix.state, at)

    def generate(self, state, k: int, program: Program, eager: bool = False) -> Launch:
        """At most `k` more loop iterations of every slot of `state` (donated), stopping
        early once every slot has stopped or, with `eager`, once a slot running now has
        stopped. Returned as soon as the launch is dispatched (device arrays)."""
        slots = int(state.done.shape[0])
        if not 0 <= k <= INT32_MAX:   # a bug of the caller, which checks its k
            raise ValueError(f"k = {k}: the loop counts iterations in int32")
        placed = self._placed.get((k, eager))   # placing two scalars was most of a dispatch
        if placed is None:
            if len(self._placed) >= 16:   # a stream's k is its caller's: only a few are kept
                self._placed = {}   # replaced, not cleared: another thread may be reading it
            placed = self._placed[(k, eager)] = self.place((np.int32(k), np.bool_(eager)))
        k, eager = placed
        exe, _ = self.compile(Key("generate", _slot(program), slots),
                              self._functions(program, slots).generate, self.model.params,
                              state, k, eager, donate=(1,))
        return Launch(*exe(self.model.params, state, k, eager))

    def halt(self, state, slot: int, program: Program):
        """`state` (donated) with slot `slot` stopped: `generate` leaves it as it is, and
        its outcome is its output so far (a request ended on the host: a stop text, a
        client gone)."""
        slots = int(state.done.shape[0])
        slot = self.place(np.int32(_slots_in([slot], slots)[0]))
        exe, _ = self.compile(Key("halt", _slot(program), slots),
                              self._functions(program, slots).halt, state, slot, donate=(0,))
        return exe(state, slot)

    def outcome(self, state, program: Program) -> dict:
        """Every slot's outcome (host arrays, leading axis the slots)."""
        slots = int(state.done.shape[0])
        exe, _ = self.compile(Key("outcome", _slot(program), slots),
                              self._functions(program, slots).outcome, state)
        return to_host(exe(state))
