"""`Engine`: one loaded model, its family, its mesh and its compiled decode programs.

Every decode path runs through an engine: a request checked once (options.py) becomes
a compiled program of the family's loop (loop.py) and its traced arguments. Two ways to
run it:

- `decode(request)`: the first call and the whole `lax.while_loop` in one program,
  nothing returning to the host until the loop has stopped (batches: `decode_batch`);
- the serving contract of JAX engines (prefill, insert, generate): `prefill(request)`
  runs the first call of one request, `insert(prefix, state, slot)` writes it into a
  slot of a batched decode state, `generate(state, k)` runs at most k loop iterations
  of every slot and hands back, per slot, the tokens that became final and whether
  (and why) it stopped, as decided in the loop. `stream` is that contract on one slot.

Programs are lowered and compiled ahead of time, once per engine and shape; the state
passed from program to program is donated, so the KV cache is updated in place. On a
mesh (a model loaded with `mesh=`) every program's arguments are placed on it: a batch
split over "data", each call tensor-parallel over "model".
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
import weakref
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from . import (batched, compile_cache, families, options as options_lib, sharding, stops,
               validate)
from .options import Batch, DecodeOptions, Program, Request
from .results import DecodeResult, check_finite, of_outcome

DEFAULT_CHUNK = 16   # loop iterations per launch when streaming
DEFAULT_MAX_PROGRAMS = 32


@dataclasses.dataclass
class Prefix:
    """One request after its first call: the single-sequence decode state (`prefill`)."""

    request: Request
    state: Any


@dataclasses.dataclass
class Progress:
    """What `generate` hands back, per slot (host arrays, leading axis the slots)."""

    tokens: np.ndarray     # [N, capacity] output buffers
    final: np.ndarray      # [N] leading tokens no later iteration changes or drops
    done: np.ndarray       # [N] the slot has stopped
    stopped: np.ndarray    # [N] a stop marker (EOS among them) ended it ("stop", else "length")


def seeded(run: Callable) -> Callable:
    """`run(params, prompt, n, limits, key)` taking a seed instead of a key: the seed stays
    a traced argument, and the key is made inside the program."""
    return lambda params, prompt, n, limits, seed: run(params, prompt, n, limits,
                                                       jax.random.PRNGKey(seed))


def to_host(out):
    """A program's outcome as host arrays. With several processes (jax.distributed), an
    outcome split over devices of other processes is gathered, so every process reads
    the whole outcome."""
    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(out)):
        return jax.device_get(out)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(out, tiled=True)


def max_programs() -> int:
    """How many compiled programs all engines of this process hold together
    (`PACKED_SS_MAX_PROGRAMS`, default DEFAULT_MAX_PROGRAMS, and at least what
    `keep_at_least` asked for): each compiled CPU program maps hundreds of memory regions
    and a process may map 65530, so a process that meets many shapes (a test run, a
    notebook) must let old programs go. One used again is compiled again, or read back
    from the persistent compilation cache."""
    value = os.environ.get("PACKED_SS_MAX_PROGRAMS", "")
    try:
        bound = max(int(value), 1) if value else DEFAULT_MAX_PROGRAMS
    except ValueError:
        raise ValueError(f"PACKED_SS_MAX_PROGRAMS must be a positive integer, "
                         f"got {value!r}") from None
    return max(bound, _floor)


_floor = 0


def keep_at_least(n: int) -> None:
    """Raises the bound on held programs to at least `n`, for a process that compiles a
    known set up front and must never compile again (the server)."""
    global _floor
    _floor = max(_floor, n)


class Programs(dict):
    """Compiled programs by name (a dict that can be held weakly). Every store of the
    process counts toward `max_programs()`; past it, the least recently used program of
    any store is dropped."""

    def used(self, name):
        """The program of `name` (None if not held), now the most recently used."""
        exe = self.get(name)
        if exe is not None:
            _recent[(id(self), name)] = weakref.ref(self)
            _recent.move_to_end((id(self), name))
        return exe

    def hold(self, name, exe) -> None:
        self[name] = exe
        _recent[(id(self), name)] = weakref.ref(self)
        for k, store in list(_recent.items()):  # entries of stores gone
            if store() is None:
                del _recent[k]
        while len(_recent) > max_programs():
            (_, old), store = _recent.popitem(last=False)
            if (held := store()) is not None:
                held.pop(old, None)


# Every held program, least recently used first: (id of its store, name) -> its store.
_recent: collections.OrderedDict = collections.OrderedDict()


def clear_programs() -> None:
    """Lets go of every compiled program the engines of this process hold (to free their
    memory between jobs); a program asked for again is compiled again, or read back from
    the persistent compilation cache."""
    for key, store in list(_recent.items()):
        if (held := store()) is not None:
            held.pop(key[1], None)
    _recent.clear()


# Program stores by (model config, weights' placement), held weakly: alive while an engine
# uses one.
_shared: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _placement(params) -> tuple:
    """Where the weights lie, as far as a compiled program depends on it: nothing on one
    device, else every weight's sharding."""
    if sharding.mesh_of(params) is None:
        return ()
    return tuple(x.sharding for x in jax.tree.leaves(params))


def _slot(program: Program) -> Program:
    """The program a decode state belongs to: its shape does not depend on the prompt
    bucket, so prefixes of every bucket go into one state."""
    return dataclasses.replace(program, bucket=0)


class Engine:
    """A loaded model's decoding: checks, compiled programs, runs.

        engine = Engine(model)
        request = engine.request(prompt, DecodeOptions(schedule="packed", temperature=0.7))
        result = engine.decode(request)              # DecodeResult
        for new_ids in engine.stream(request): ...   # the same tokens, as they are final
    """

    def __init__(self, model, programs: Programs | None = None):
        validate.check_model(model)
        self.model = model
        self.family = families.of(model.config)
        self.mesh = sharding.mesh_of(model.params)
        # The compiled programs: this engine's own, or (`Engine.of`) those of every engine
        # of a model with this config on these devices.
        self._programs = Programs() if programs is None else programs
        self._slot_fns: dict = {}   # the traced functions of each slot-state shape
        self.compile_s = 0.0   # seconds spent compiling, all programs together
        self._planner = None   # schedule "auto"'s choices (planner.py), made on first use

    @classmethod
    def of(cls, model) -> Engine:
        """The engine of a model object, made on first use and kept with the model. A
        program takes the weights as an argument, so the engines of models with one config
        on the same devices (another checkpoint of the same shape, new weights in a
        training loop) share their compiled programs; they are freed with the last such
        engine. `Engine(model)` has programs of its own."""
        engine = getattr(model, "_engine", None)
        if engine is None or engine.model is not model:
            where = (model.key, _placement(model.params))
            programs = _shared.get(where)
            if programs is None:
                programs = _shared[where] = Programs()
            engine = cls(model, programs)
            object.__setattr__(model, "_engine", engine)
        return engine

    # --- requests -------------------------------------------------------------------------

    def request(self, prompt, options: DecodeOptions = DecodeOptions(), seed=0) -> Request:
        """A checked request for one prompt (text or token ids)."""
        return options_lib.request(self.model, self.family, prompt, options, seed)

    def batch(self, prompts, options: DecodeOptions = DecodeOptions(), seed=0,
              sequences: int | None = None) -> Batch:
        """Checked requests for a batched decode (see options.batch)."""
        return options_lib.batch(self.model, self.family, prompts, options, seed, sequences)

    # --- compiling and placing -------------------------------------------------------------

    def compile(self, name, fn: Callable, *args, donate: tuple[int, ...] = ()):
        """`fn` lowered and compiled for `args` once per hashable `name`; the executable and
        the seconds spent compiling now. `donate`: the arguments whose buffers the program
        may reuse for its outputs (a state updated in place)."""
        exe = self._programs.used(name)
        if exe is not None:
            return exe, 0.0
        compile_cache.ensure()
        t0 = time.perf_counter()
        exe = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        self._programs.hold(name, exe)
        seconds = time.perf_counter() - t0
        self.compile_s += seconds
        return exe, seconds

    def executables(self) -> dict:
        """The compiled programs held, by name (for profiling: `.as_text()`)."""
        return dict(self._programs)

    def place(self, args, batch: int | None = None):
        """`args` on the model's mesh when it has one (so that a program whose weights span
        several processes gets global arrays): replicated, or with `batch` given, every
        leaf's leading axis of `batch` entries split over "data". On one device, as they
        are."""
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, args)
        spec = (jax.sharding.PartitionSpec() if batch is None
                else sharding.batch_spec(self.mesh, batch))
        return jax.device_put(args, jax.sharding.NamedSharding(self.mesh, spec))

    def pinned(self, slots: int) -> Callable:
        """`pin(state)` for a batched state of `slots` sequences: on a mesh, every leaf
        constrained to where it lives (the cache as sharding.cache_spec, the rest split over
        "data" by slot), so the programs passing it to each other agree on it; else the
        identity."""
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

    def lower(self, request: Request):
        """The decode program of a request, lowered for the model's params: arrays, or
        `jax.ShapeDtypeStruct`s to read a real-size program's HLO, cost and memory without
        allocating any weight."""
        return jax.jit(seeded(self.loop(request.program).run)).lower(self.model.params,
                                                                     *request.args())

    def forward(self, tokens, positions, mask, draft_rows):
        """One full forward with no cache: (logits [T, V], kv) (the parity hook `logits`)."""
        m = self.model

        def forward(params, tokens, positions, mask, draft_rows):
            return m.forward(params, tokens, positions, mask, m.empty_cache(0), 0, draft_rows)

        args = (tokens, positions, mask, draft_rows)
        exe, _ = self.compile(("forward", tokens.shape[0]), forward, m.params, *args)
        return exe(m.params, *args)

    def _execute(self, exe, args) -> tuple[dict, float]:
        t0 = time.perf_counter()
        out = jax.block_until_ready(exe(self.model.params, *args))
        wall = time.perf_counter() - t0
        out = to_host(out)
        check_finite(out["nonfinite_at"], out["iterations"], out["tokens"])
        return out, wall

    # --- one-shot decodes ------------------------------------------------------------------

    def compiled(self, request: Request):
        """The one-shot decode program of a request (compiled once) and the seconds spent
        compiling it now."""
        return self.compile(("decode", request.program), seeded(self.loop(request.program).run),
                            self.model.params, *self.place(request.host_args()))

    def decode(self, request: Request) -> DecodeResult:
        """Decodes one checked request: compile (once), run, synchronise, read the outcome
        (NonFiniteError if the loop met NaN/Inf logits)."""
        exe, compile_s = self.compiled(request)
        out, wall = self._execute(exe, self.place(request.host_args()))
        return of_outcome(self.model, self.family, request, out, wall, compile_s)

    def decode_batch(self, batch: Batch) -> list[DecodeResult]:
        """Decodes a batch in one program: one DecodeResult per prompt, each what that
        prompt decoded alone gives with its seed (`wall_s` is the batch's). On a mesh the
        batch is split over "data"."""
        n = len(batch.members)
        cache = None if self.mesh is None else jax.sharding.NamedSharding(
            self.mesh, sharding.cache_spec(self.model.config, self.mesh, n))
        run = batched.build(self.loop(batch.program), cache_sharding=cache)
        args = self.place(batch.host_args(), n)
        exe, compile_s = self.compile(("batch", batch.program, n), _seeded_batch(run),
                                      self.model.params, *args)
        out, wall = self._execute(exe, args)
        return [of_outcome(self.model, self.family, r, jax.tree.map(lambda x: x[i], out), wall,
                           compile_s) for i, r in enumerate(batch.members)]

    # --- prefill, insert, generate ---------------------------------------------------------

    def _slot_programs(self, program: Program, slots: int):
        """(pin, insert, generate, outcome): the functions over a batched state of `slots`
        sequences of `program`, compiled by the methods below."""
        shape = (_slot(program), slots)
        if shape in self._slot_fns:
            return self._slot_fns[shape]
        loop, pin = self.loop(program), self.pinned(slots)
        step_all = batched.step_batch(loop.step, loop.batch_step)

        def generate(params, s, k):
            def go(c):
                return jnp.any(~c[0].done) & (c[1] < k)

            s, _ = jax.lax.while_loop(go, lambda c: (pin(step_all(params, c[0])), c[1] + 1),
                                      (s, jnp.int32(0)))
            tokens, final, done = jax.vmap(loop.progress)(s)
            return s, (tokens, final, done, s.stopped)

        def insert(s, prefix, slot):
            put = jax.tree.map(lambda b, x: b.at[slot].set(x.astype(b.dtype)), s, prefix)
            return pin(put)

        def halt(s, slot):
            return pin(s.replace(done=s.done.at[slot].set(True)))

        fns = (pin, insert, generate, jax.vmap(loop.outcome), halt)
        self._slot_fns[shape] = fns
        return fns

    def prefill(self, request: Request) -> Prefix:
        """The first call of one request (it fills the prompt's cache and chooses the
        first token, and for the drafting schedules the first draft)."""
        loop = self.loop(request.program)
        args = self.place(request.host_args())

        def start(params, prompt, n, limits, seed):
            return loop.init(params, prompt, n, limits, jax.random.PRNGKey(seed))

        exe, _ = self.compile(("prefill", request.program), start, self.model.params, *args)
        return Prefix(request, exe(self.model.params, *args))

    def slots(self, program: Program, n: int):
        """A batched decode state of `n` empty slots for `program`'s requests (each one
        stopped, so `generate` leaves it as it is until `insert` fills it)."""
        loop = self.loop(program)
        program = dataclasses.replace(program, bucket=max(program.bucket, 1))
        args = options_lib.Request(program, np.zeros(1, np.int32), self._any_limits(), 0,
                                   1).host_args()
        shape = jax.eval_shape(seeded(loop.init), self.model.params,
                               *jax.tree.map(jnp.asarray, args))
        pin = self._slot_programs(program, n)[0]

        def empty():
            s = jax.tree.map(lambda x: jnp.zeros((n,) + x.shape, x.dtype), shape)
            return pin(s.replace(done=jnp.ones(n, bool)))

        exe, _ = self.compile(("empty", _slot(program), n), empty)
        return exe()

    def insert(self, prefix: Prefix, state, slot: int):
        """`state` with `prefix` written into slot `slot` (the state is donated: its
        buffers are reused)."""
        program = prefix.request.program
        n = int(state.done.shape[0])
        insert = self._slot_programs(program, n)[1]
        slot = self.place(np.int32(validate.integer(slot, "slot", 0, n - 1)))
        exe, _ = self.compile(("insert", _slot(program), n), insert, state, prefix.state, slot,
                              donate=(0,))
        return exe(state, prefix.state, slot)

    def halt(self, state, slot: int, program: Program):
        """`state` (donated) with slot `slot` stopped: `generate` leaves it as it is, and
        its outcome is its output so far (a request ended early: a stop text seen on the
        host, a client gone)."""
        n = int(state.done.shape[0])
        halt = self._slot_programs(program, n)[4]
        slot = self.place(np.int32(validate.integer(slot, "slot", 0, n - 1)))
        exe, _ = self.compile(("halt", _slot(program), n), halt, state, slot, donate=(0,))
        return exe(state, slot)

    def generate(self, state, k: int, program: Program) -> tuple[Any, Progress]:
        """At most `k` more loop iterations of every slot of `state` (donated); the state
        after them and, per slot, its `Progress` (host arrays)."""
        s, progress = self.dispatch(state, k, program)
        return s, Progress(*to_host(progress))

    def dispatch(self, state, k: int, program: Program):
        """`generate` without reading the progress back: (the state, the progress on the
        device), returned as soon as the launch is dispatched."""
        n = int(state.done.shape[0])
        generate = self._slot_programs(program, n)[2]
        k = self.place(np.int32(validate.integer(k, "k", 0, validate.INT32_MAX,
                                                 "the loop counts iterations in int32")))
        exe, _ = self.compile(("generate", _slot(program), n), generate, self.model.params,
                              state, k, donate=(1,))
        return exe(self.model.params, state, k)

    def outcome(self, state, program: Program) -> dict:
        """Every slot's outcome (host arrays, leading axis the slots)."""
        n = int(state.done.shape[0])
        outcome = self._slot_programs(program, n)[3]
        exe, _ = self.compile(("outcome", _slot(program), n), outcome, state)
        return to_host(exe(state))

    def _any_limits(self) -> dict:
        """Limits of every request's shapes (for a decode state's shape; never run)."""
        return {**stops.limits(None, self.model.config.vocab_size, 1, None, ()),
                "temperature": np.float32(1), "top_p": np.float32(1)}

    def stream(self, request: Request, chunk: int = DEFAULT_CHUNK) -> Streaming:
        """The request decoded `chunk` loop iterations per launch (see `Streaming`)."""
        return Streaming(self, request, chunk)


def _seeded_batch(run: Callable) -> Callable:
    """A batched `run` taking seeds [N]: one key per sequence, made inside the program."""
    return lambda params, prompts, n, limits, seeds: run(
        params, prompts, n, limits, jax.vmap(jax.random.PRNGKey)(seeds))


class Streaming:
    """One request decoded `k` loop iterations per launch, through prefill, insert and
    generate on one slot:

        decoding = engine.stream(request, k)
        for new_ids in decoding: ...     # the ids that became final in each launch
        decoding.result()                # the DecodeResult, `decode`'s (stats included)

    The tokens are `decode`'s (greedy, and sampled with the same seed): the same first
    call and the same steps on the same state. One launch is kept in flight: the next is
    dispatched (on the donated state) before this one's tokens are read back, so the
    host's wait overlaps decoding. Stopping early (a client gone, a stop string seen on
    the host) is just not iterating further; `result()` then describes the output so far."""

    def __init__(self, engine: Engine, request: Request, k: int = DEFAULT_CHUNK):
        self.engine, self.request = engine, request
        self.k = validate.integer(k, "chunk", 1, validate.INT32_MAX,
                                  "the loop counts iterations in int32")
        self.state, self.tokens, self.count, self.done = None, None, 0, False
        self.stopped = False
        self._progress = None
        self.wall_s = self.compile_s = 0.0

    def _first(self) -> None:
        """The first call, into a one-slot state, and its progress (no iteration yet)."""
        e, p = self.engine, self.request.program
        state = e.insert(e.prefill(self.request), e.slots(p, 1), 0)
        self.state, self._progress = e.dispatch(state, 0, p)

    def launch(self) -> list[int]:
        """The ids that became final in the next launch (at most k iterations)."""
        if self.done:
            return []
        t0, compiled = time.perf_counter(), self.engine.compile_s
        if self.state is None:
            self._first()
        progress = self._progress
        self.state, self._progress = self.engine.dispatch(self.state, self.k,
                                                           self.request.program)
        tokens, final, done, stopped = to_host(progress)
        count = int(final[0])
        new = np.asarray(tokens[0])[self.count: count].tolist()
        self.count, self.done, self.stopped = count, bool(done[0]), bool(stopped[0])
        if self.done:  # the launch in flight runs no iteration; its end is the decode's
            jax.block_until_ready(self.state)
        compiling = self.engine.compile_s - compiled
        self.compile_s += compiling
        self.wall_s += time.perf_counter() - t0 - compiling
        return new

    def __iter__(self) -> Iterator[list[int]]:
        while not self.done:
            yield self.launch()

    def result(self) -> DecodeResult:
        """The DecodeResult of the launches so far (NonFiniteError as `decode` raises it)."""
        if self.state is None:
            self.launch()
        out = jax.tree.map(lambda x: x[0], self.engine.outcome(self.state, self.request.program))
        if not self.done:  # stopped early: only the final tokens so far
            out["n_tokens"] = self.count
        check_finite(out["nonfinite_at"], out["iterations"], out["tokens"])
        return of_outcome(self.engine.model, self.engine.family, self.request, out,
                          self.wall_s, self.compile_s)
