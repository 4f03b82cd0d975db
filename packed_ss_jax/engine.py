"""The decode driver, one for every family: request checks, programs, the compile cache,
the timed run and the result type.

A request is checked once (`prepare`) and becomes a `Program` (everything a compiled
decode is specialised on: family, schedule, width, order, prompt bucket, cache size,
sampler) plus its traced arguments (the padded prompt, its length, the family's
limits, the seed). The family's `build(model, program)` gives a pure function
`run(params, prompt, n, limits, key) -> outcome`: the first call, then
`lax.while_loop` over one schedule step, with nothing returning to the host until the
loop has stopped. Each program is lowered and compiled ahead of time once per model
config (`aot`); a new prompt in the same bucket, a new length limit, stop markers or
seed reuse it.

`Chunked` runs the same loop a few iterations per launch (the family's `Loop.start` and
`Loop.resume`, see loop.py), the state donated from launch to launch so the KV cache
stays in place, and hands out the tokens that became final after each launch: the
tokens of `run`, as they are produced (streaming).

Stops given as text are also searched for in the decoded text (stops.cut_text): the
output ends at the earliest stop, whether the loop saw it as tokens or not.

A loop that read NaN or Inf logits stops there and reports where (see
schedules/state.py, setdlm/state.py); `check_finite` turns that into a
`NonFiniteError` on the host, for every family and schedule.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

from . import batched, compile_cache, memory, requests, sharding, stops
from .requests import InputError
from .sampling import Sampler

MIN_BUCKET = 16
DEFAULT_CHUNK = 16   # loop iterations per launch when streaming
MIN_CAPACITY = 128
DEFAULT_CACHE_SIZE = 4096


@dataclasses.dataclass(frozen=True)
class Program:
    """What one compiled decode program is specialised on; all else is traced."""

    family: str
    schedule: str
    width: int        # the family's width: block size B (Nemotron), window W (SetDLM)
    bucket: int       # padded prompt length
    capacity: int     # KV slots for prompt + output
    sampler: Sampler = Sampler()
    order: str = "ltr"


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked request: its program and traced arguments."""

    program: Program
    prompt: np.ndarray        # int32 ids, unpadded
    limits: dict[str, Any]    # the family's traced limits (length limit, EOS / stop markers)
    seed: int
    max_new: int
    stop_texts: tuple[str, ...] = ()   # stops given as text, searched for on the host

    def args(self, seed=None):
        """The program's arguments after params: padded prompt, its length, limits, seed."""
        padded = np.zeros(self.program.bucket, np.int32)
        padded[: len(self.prompt)] = self.prompt
        seed = self.seed if seed is None else seed
        return (jnp.asarray(padded), jnp.int32(len(self.prompt)),
                jax.tree.map(jnp.asarray, self.limits), jnp.asarray(seed, jnp.uint32))


@dataclasses.dataclass(frozen=True)
class Batch:
    """Checked requests decoded together by one batched program: one program (the bucket
    of the longest prompt, the capacity of the longest request) and, per prompt, its
    request (its own ids, limits and seed, on that program)."""

    program: Program
    requests: tuple[Request, ...]

    def args(self):
        """The batched program's arguments after params: padded prompts [N, bucket], their
        lengths [N], the limits stacked on a leading N axis, the seeds [N]."""
        return jax.tree.map(jnp.asarray, self.host_args())

    def host_args(self):
        """`args` as numpy arrays (rows of them are the arguments of a sub-batch)."""
        rs = self.requests
        padded = np.zeros((len(rs), self.program.bucket), np.int32)
        for i, r in enumerate(rs):
            padded[i, : len(r.prompt)] = r.prompt
        limits = jax.tree.map(lambda *x: np.stack([np.asarray(a) for a in x]),
                              *[r.limits for r in rs])
        return (padded, np.asarray([len(r.prompt) for r in rs], np.int32), limits,
                np.asarray([r.seed for r in rs], np.uint32))


@dataclasses.dataclass
class DecodeResult:
    tokens: list[int]        # generated ids, prompt excluded, EOS / stop marker included
    nfe: int                 # forward passes, prompt processing included
    iterations: int          # decoder iterations, the first call included
    accept_hist: np.ndarray  # accept_hist[k]: iterations that appended (kept) k tokens
    wall_s: float            # decoder wall time (synchronised; compile excluded)
    compile_s: float         # compile time paid by this call (0 when already compiled)
    schedule: str
    block_size: int          # B = W + 1
    prompt_len: int
    text: str | None = None
    family: str = "nemotron"
    window: int = 0          # W, the speculative width (drafts per iteration)
    order: str = "ltr"
    # SetDLM accounting (Table 2): uncached rows evaluated after the prompt call, the most
    # rows in one call; and per iteration the verification order pi_t, A_t, and the
    # accepted tokens left to feed as clean rows next call. None / empty for Nemotron.
    rows: int | None = None
    max_rows: int | None = None
    orders: list = dataclasses.field(default_factory=list)
    accepted: list = dataclasses.field(default_factory=list)
    fed: list = dataclasses.field(default_factory=list)
    # "stop" (EOS, a stop marker or stop string), or "length" (max_new_tokens reached).
    finish_reason: str = "length"
    # Where the stop string that ended the output begins in `text` (None: no text stop);
    # text[:stop_at] is the output without it.
    stop_at: int | None = None

    @property
    def tokens_per_nfe(self) -> float:
        return len(self.tokens) / self.nfe

    @property
    def time_per_nfe_ms(self) -> float:
        return 1e3 * self.wall_s / self.nfe

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else float("inf")


class NonFiniteError(FloatingPointError, ValueError):
    """The decode loop read NaN or Inf logits and stopped: the model's weights or the
    prompt's embeddings hold non-finite numbers. `tokens` holds the tokens generated
    before that point (each chosen from finite logits)."""

    def __init__(self, iteration: int, position: int, tokens: list[int]):
        self.iteration, self.position, self.tokens = iteration, position, tokens
        super().__init__(
            f"non-finite logits (NaN or Inf) in decoder iteration {iteration}, at generated "
            f"position {position}: the model's weights or the prompt's embeddings hold NaN "
            f"or Inf, so decoding stopped there ({position} tokens generated before it)")

    def __reduce__(self):
        return type(self), (self.iteration, self.position, self.tokens)


def check_finite(nonfinite_at, iterations, tokens) -> None:
    """Raises NonFiniteError if the loop stopped on non-finite logits (`nonfinite_at`:
    the generated position, -1 when every logits row it read was finite). With a leading
    sample axis (vmapped decodes), for the first sample that stopped."""
    at = np.asarray(nonfinite_at)
    if at.ndim:
        bad = np.flatnonzero(at >= 0)
        if bad.size:
            i = bad[0]
            check_finite(at[i], np.asarray(iterations)[i], np.asarray(tokens)[i])
        return
    if at >= 0:
        raise NonFiniteError(int(iterations), int(at), [int(t) for t in np.asarray(tokens)[:at]])


def bucket_for(n: int, capacity: int) -> int:
    """Prompt length rounded up to a power of two (at least MIN_BUCKET, at most capacity)."""
    b = MIN_BUCKET
    while b < n:
        b *= 2
    return min(b, capacity)


def capacity_for(need: int) -> int:
    """KV slots for a request of `need` tokens: a power of two, at least MIN_CAPACITY."""
    c = MIN_CAPACITY
    while c < need:
        c *= 2
    return c


# --- requests -------------------------------------------------------------------------------


def _choice(value, name: str, choices, where: str = "") -> str:
    if not isinstance(value, str) or value not in choices:
        raise InputError(f"unknown {name} {value!r}{where}; expected one of {sorted(choices)}")
    return value


def check_options(family, schedule, order, sampler: Sampler) -> None:
    """The schedule, order and sampling combination is one the family decodes."""
    _choice(schedule, "schedule", family.schedules, f" for {family.title} models")
    if order != family.orders[0]:
        if len(family.orders) == 1:
            raise InputError(f"order {order!r}: {family.title} models verify in one order "
                             f"only, order={family.orders[0]!r}")
        _choice(order, "order", family.orders)
        if schedule in family.orderless:
            raise InputError(f"schedule {schedule!r} has no verification order; use "
                             f"order={family.orders[0]!r}")
    if not sampler.greedy:
        if schedule not in family.sampled:
            raise InputError(f"schedule {schedule!r} is greedy only: temperature must be 0; "
                             f"sampling is supported by {sorted(family.sampled)}")
        if order != family.orders[0]:
            raise InputError("any-order sampling is not supported: temperature > 0 needs "
                             f"order={family.orders[0]!r}")


def program_for(family, config, *, schedule="packed", width=None, order="ltr",
                temperature=0.0, top_k=None, top_p=None, cache_size=None, max_new_tokens=128,
                eos_id=-1, stop_sequences=(), tokenizer=None, prompt_len=None):
    """The program and the traced limits of a request, every argument checked.

    Without a `cache_size`, the capacity is sized to the request: prompt + max_new_tokens
    rounded up to a power of two (at least MIN_CAPACITY), so attention reads a buffer the
    size of the sequence, not of the model's longest context, and requests of similar
    length share one program. With no prompt length (`decoder`, before the prompt's shape
    is known) it is min(DEFAULT_CACHE_SIZE, max_position_embeddings). `bucket`, the
    padded prompt length, is filled in by `prepare`."""
    sampler = requests.sampler(temperature, top_k, top_p)
    check_options(family, schedule, order, sampler)
    if width is None:
        width = config.block_size
    width = family.width(schedule, requests.integer(
        width, family.width_name, family.min_width, requests.MAX_CACHE,
        "a block must fit the cache, whose positions are int32"))
    max_new = requests.integer(max_new_tokens, "max_new_tokens", 1, requests.MAX_CACHE,
                               "prompt + max_new_tokens must fit the cache, whose positions "
                               "are int32")
    eos = requests.eos_id(eos_id, config, config.vocab_size)
    stop_sequences = stops.markers(stop_sequences)
    if stop_sequences and not family.stop_sequences:
        raise InputError(f"stop_sequences are not supported for {family.title} models yet; "
                         "use eos_id")
    limits = family.limits(tokenizer, config.vocab_size, max_new, eos, stop_sequences)
    need = None if prompt_len is None else max(prompt_len + max_new, width)
    capacity = requests.cache_size(cache_size, config, block=width, block_name=family.width_name,
                                   default=DEFAULT_CACHE_SIZE if need is None else
                                   capacity_for(need))
    program = Program(family.name, schedule, width, 0, capacity, sampler, order)
    return program, limits, max_new


def prepare(model, family, prompt, *, seed=0, **options) -> Request:
    """A checked request for `decode` (see `program_for` for the options)."""
    seed = requests.seed(seed)
    ids = requests.prompt_ids(model, prompt)
    options = _read_once(options)
    program, limits, max_new = program_for(family, model.config, prompt_len=len(ids),
                                           tokenizer=getattr(model, "tokenizer", None), **options)
    requests.fits(len(ids), max_new, program.capacity)
    program = dataclasses.replace(program, bucket=bucket_for(len(ids), program.capacity))
    memory.check(model, program, max_new)
    return Request(program, ids, limits, seed, max_new, stops.texts(options["stop_sequences"]))


def _read_once(options: dict) -> dict:
    """`options` with its stop markers read into a tuple: they are read twice (the marker
    table, then the text stops), and a generator gives nothing the second time."""
    return {**options, "stop_sequences": stops.markers(options.get("stop_sequences", ()))}


def _seeds(seed, n: int) -> list[int]:
    """One seed per prompt: `seed` for all, or the list of one per prompt."""
    if requests.is_int(seed):
        return [requests.seed(seed)] * n
    if isinstance(seed, (str, bytes)) or not hasattr(seed, "__iter__"):
        raise InputError(f"seed must be an integer in [0, 2**32) or a list of one per prompt, "
                         f"got {seed!r:.80}")
    seeds = [int(x) for x in requests.seeds(seed, "seed")]
    if len(seeds) != n:
        raise InputError(f"seed: {len(seeds)} seeds for {n} prompts; give one seed or one "
                         "per prompt")
    return seeds


def prepare_batch(model, family, prompts, *, seed=0, sequences: int | None = None,
                  **options) -> Batch:
    """Checked requests for a batched decode: `prompts` a non-empty list of prompts,
    `seed` one seed for every prompt or one per prompt (see `program_for` for the rest).
    The batch shares one program: prompts are padded to the bucket of the longest, the
    cache sized for the longest request. `sequences`: how many are decoded at once (a
    queue's slots; default all), for the memory check."""
    prompts = requests.prompt_list(prompts)
    ids = [requests.prompt_ids(model, p, f"prompts[{i}]: ") for i, p in enumerate(prompts)]
    seeds = _seeds(seed, len(ids))
    options = _read_once(options)
    longest = max(len(x) for x in ids)
    program, limits, max_new = program_for(family, model.config, prompt_len=longest,
                                           tokenizer=getattr(model, "tokenizer", None), **options)
    requests.fits(longest, max_new, program.capacity)
    program = dataclasses.replace(program, bucket=bucket_for(longest, program.capacity))
    at_once = len(ids) if sequences is None else min(sequences, len(ids))
    memory.check(model, program, max_new, at_once, "a smaller cache_size or fewer " + (
        "prompts per call" if sequences is None else "slots"))
    texts = stops.texts(options["stop_sequences"])
    return Batch(program, tuple(Request(program, x, limits, s, max_new, texts)
                                for x, s in zip(ids, seeds)))


# --- compiled programs ----------------------------------------------------------------------

_compiled: dict[Hashable, Any] = {}


def clear_cache() -> None:
    _compiled.clear()


def executables(model_key: Hashable) -> dict[Program, Any]:
    """The compiled decode programs of one model config (for profiling: `.as_text()`)."""
    return {k[1]: exe for k, exe in _compiled.items()
            if len(k) == 2 and k[0] == model_key and isinstance(k[1], Program)}


def aot(key: Hashable, fn: Callable, *args, donate: tuple[int, ...] = ()) -> tuple[Any, float]:
    """`fn` lowered and compiled for `args` once per hashable `key` (every decode program
    goes through here); returns it and the seconds spent compiling now. `donate`: the
    arguments whose buffers the program may reuse for its outputs (a state updated in
    place)."""
    if key in _compiled:
        return _compiled[key], 0.0
    compile_cache.ensure()
    t0 = time.perf_counter()
    exe = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    _compiled[key] = exe
    return exe, time.perf_counter() - t0


def seeded(run: Callable) -> Callable:
    """`run` taking a seed instead of a key: the seed stays a traced argument, and the key
    is made inside the program (`decoder`'s functions take the key itself)."""
    return lambda params, prompt, n, limits, seed: run(params, prompt, n, limits,
                                                       jax.random.PRNGKey(seed))


def seeded_batch(run: Callable) -> Callable:
    """A batched `run` taking seeds [N]: one key per sequence, made inside the program."""
    return lambda params, prompts, n, limits, seeds: run(
        params, prompts, n, limits, jax.vmap(jax.random.PRNGKey)(seeds))


def loop_of(model, family, request: Request):
    """The family's decode loop (loop.Loop) of a request's program."""
    return family.build(model, request.program)


def lower(model, family, request: Request):
    """The decode program of a request, lowered for the model's params: arrays, or
    `jax.ShapeDtypeStruct`s to read a real-size program's HLO, cost and memory without
    allocating any weight."""
    return jax.jit(seeded(loop_of(model, family, request).run)).lower(model.params,
                                                                      *request.args())


def placement(model) -> tuple:
    """What compiled programs depend on besides the config: () on one device, else the
    shardings of the weights (a program is compiled for where its inputs lie)."""
    if sharding.mesh_of(model.params) is None:
        return ()
    return (tuple(x.sharding for x in jax.tree.leaves(model.params)),)


def on_mesh(model, args, batch: int | None = None):
    """`args` on the model's mesh when it has one (so that a program whose weights span
    several processes gets global arrays): replicated, or with `batch` given, every
    leaf's leading axis of `batch` entries split over "data" (see sharding.batch_spec).
    On one device, `args` as they are."""
    mesh = sharding.mesh_of(model.params)
    if mesh is None:
        return args
    spec = jax.sharding.PartitionSpec() if batch is None else sharding.batch_spec(mesh, batch)
    return jax.device_put(args, jax.sharding.NamedSharding(mesh, spec))


def request_args(model, request: Request) -> tuple:
    """A request's arguments, replicated over the model's mesh when it has one."""
    return on_mesh(model, request.args())


def compiled(model, family, request: Request) -> tuple[Any, float]:
    """The compiled program of a request and the seconds spent compiling it now."""
    run = seeded(loop_of(model, family, request).run)
    return aot((model.key, request.program) + placement(model), run, model.params,
               *request_args(model, request))


def to_host(out):
    """A program's outcome as host arrays. With several processes (jax.distributed), an
    outcome split over devices of other processes is gathered, so every process reads
    the whole outcome."""
    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(out)):
        return jax.device_get(out)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(out, tiled=True)


def run(model, family, request: Request) -> DecodeResult:
    """Decodes one checked request: compile (once), run, synchronise, read the outcome."""
    exe, compile_s = compiled(model, family, request)
    out, wall = execute(model, exe, request_args(model, request))
    return result(model, family, request, out, wall, compile_s)


def execute(model, exe, args) -> tuple[dict, float]:
    """Runs a compiled decode program; its outcome on the host (NonFiniteError if it met
    NaN/Inf logits) and the wall seconds it ran."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(exe(model.params, *args))
    wall = time.perf_counter() - t0
    out = to_host(out)
    check_finite(out["nonfinite_at"], out["iterations"], out["tokens"])
    return out, wall


class Chunked:
    """One request decoded `k` loop iterations per launch, for streaming:

        decode = Chunked(model, family, request, k)
        for new_ids in decode: ...      # the ids that became final in each launch
        decode.result()                 # the DecodeResult, `run`'s (stats included)

    The launches run the family's `Loop.start` (the first call) and then `Loop.resume`
    (at most k iterations of the same loop body), the state donated from one launch to
    the next, so the cache is updated in place and the tokens are those of `run`
    (greedy, and sampled with the same seed). After each launch only the output tokens,
    their final count and the done flag come back to the host. Stopping early (a client
    gone, a stop string seen on the host) is just not iterating further; `result()` then
    describes the output so far."""

    def __init__(self, model, family, request: Request, k: int = DEFAULT_CHUNK):
        self.model, self.family, self.request = model, family, request
        self.k = requests.integer(k, "chunk", 1, requests.INT32_MAX,
                                  "the loop counts iterations in int32")
        (self._start, self._resume, self._outcome), self.compile_s = chunk_programs(
            model, family, request)
        self.state, self.tokens, self.count, self.done = None, None, 0, False
        self._progress = None
        self.wall_s = 0.0

    def launch(self) -> list[int]:
        """The ids that became final in the next launch (the first call, or up to k
        iterations).

        One launch is kept in flight: the next one is dispatched (asynchronously, on the
        donated state) before this one's tokens are read back, so the host's wait and the
        read overlap decoding. After the loop is done that launch runs no iteration."""
        if self.done:
            return []
        t0 = time.perf_counter()
        if self.state is None:
            self.state, self._progress = self._start(self.model.params, *self.request.args())
        progress = self._progress
        self.state, self._progress = self._resume(self.model.params, self.state,
                                                  np.int32(self.k))
        tokens, count, done = jax.device_get(progress)
        new = np.asarray(tokens)[self.count: int(count)].tolist()
        self.tokens, self.count, self.done = tokens, int(count), bool(done)
        if self.done:  # the launch in flight runs no iteration; its end is the decode's
            jax.block_until_ready(self.state)
        self.wall_s += time.perf_counter() - t0
        return new

    def __iter__(self):
        while not self.done:
            yield self.launch()

    def result(self) -> DecodeResult:
        """The DecodeResult of the launches so far (NonFiniteError as `run` raises it)."""
        if self.state is None:
            self.launch()
        out = jax.device_get(self._outcome(self.state))
        if not self.done:  # stopped early: only the final tokens so far
            out["n_tokens"] = self.count
        check_finite(out["nonfinite_at"], out["iterations"], out["tokens"])
        return result(self.model, self.family, self.request, out, self.wall_s, self.compile_s)


def chunk_programs(model, family, request: Request):
    """The compiled (start, resume, outcome) programs of a request (see `Chunked`), and
    the seconds spent compiling them now.

    start(params, prompt, n, limits, seed) -> (state, progress);
    resume(params, state, k) -> (state, progress), the state donated;
    outcome(state) -> the outcome dict of `run`. progress: (tokens, final count, done)."""
    key = (model.key, request.program)
    names = (key + ("start",), key + ("resume",), key + ("outcome",))
    if all(k in _compiled for k in names):  # without tracing anything again
        return tuple(_compiled[k] for k in names), 0.0
    loop = loop_of(model, family, request)

    def start(params, prompt, n, limits, seed):
        s = loop.start(params, prompt, n, limits, jax.random.PRNGKey(seed))
        return s, loop.progress(s)

    def resume(params, s, k):
        s = loop.resume(params, s, k)
        return s, loop.progress(s)

    args = request.args()
    state = jax.eval_shape(start, model.params, *args)[0]
    exe_start, c0 = aot(names[0], start, model.params, *args)
    exe_resume, c1 = aot(names[1], resume, model.params, state,
                         jax.ShapeDtypeStruct((), jnp.int32), donate=(1,))
    exe_outcome, c2 = aot(names[2], loop.outcome, state)
    return (exe_start, exe_resume, exe_outcome), c0 + c1 + c2


def result(model, family, request: Request, out: dict, wall_s: float,
           compile_s: float) -> DecodeResult:
    """The DecodeResult of one decode's outcome (host arrays)."""
    p = request.program
    iters = int(out["iterations"])
    tokens = np.asarray(out["tokens"])[: int(out["n_tokens"])].tolist()
    tokenizer = getattr(model, "tokenizer", None)
    text = tokenizer.decode(tokens) if tokenizer is not None else None
    finish = "stop" if (len(tokens) < request.max_new or stops.ends_with_marker(
        tokens, request.limits["stop_tok"], request.limits["stop_len"])) else "length"
    stop_at = None
    cut = stops.cut_text(tokenizer.decode, tokens, request.stop_texts) if text else None
    if cut is not None:
        tokens, text, stop_at = cut
        finish = "stop"
    W = family.window(p.width)
    extra = {}
    if "rows" in out:
        extra = dict(rows=int(out["rows"]), max_rows=int(out["max_rows"]),
                     orders=[[int(o) for o in row if o >= 0] for row in out["trace_order"][:iters]],
                     accepted=[int(a) for a in out["trace_accepted"][:iters]],
                     fed=[int(f) for f in out["trace_fed"][:iters]])
    return DecodeResult(
        tokens=tokens, nfe=int(out["nfe"]), iterations=iters,
        accept_hist=np.asarray(out["accept_hist"]), wall_s=wall_s, compile_s=compile_s,
        schedule=p.schedule, block_size=W + 1, prompt_len=len(request.prompt),
        text=text, family=family.name, window=W, order=p.order, finish_reason=finish,
        stop_at=stop_at, **extra)


def batch_args(model, batch: Batch) -> tuple:
    """The batched program's arguments, on the model's mesh (when it has one): every
    argument's leading batch axis split over "data"."""
    return on_mesh(model, batch.args(), len(batch.requests))


def compiled_batch(model, family, batch: Batch) -> tuple[Any, float]:
    """The compiled batched program of a batch (one per program and batch size)."""
    mesh = sharding.mesh_of(model.params)
    cache = None if mesh is None else jax.sharding.NamedSharding(
        mesh, sharding.cache_spec(model.config, mesh, len(batch.requests)))
    run = seeded_batch(batched.build(family.build(model, batch.program), cache_sharding=cache))
    key = (model.key, batch.program, "batch", len(batch.requests)) + placement(model)
    return aot(key, run, model.params, *batch_args(model, batch))


def run_batch(model, family, batch: Batch) -> list[DecodeResult]:
    """Decodes a batch in one program; returns one DecodeResult per prompt, each equal to
    that prompt decoded alone (`run`) with its seed. `wall_s` is the batch's wall time
    (every sequence took part in all of it). Raises NonFiniteError for the first prompt
    whose decode met NaN/Inf logits. On a mesh (a model loaded with `mesh=`) the batch is
    split over its "data" axis and every call is tensor-parallel over "model"."""
    exe, compile_s = compiled_batch(model, family, batch)
    out, wall = execute(model, exe, batch_args(model, batch))
    return [result(model, family, r, jax.tree.map(lambda x: x[i], out), wall, compile_s)
            for i, r in enumerate(batch.requests)]


def run_many(model, family, request: Request, seeds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Many independent samples of one request in one call: the decode vmapped over seeds.

    Returns tokens [N, C], lengths [N] and NFE [N]; row i equals the request decoded with
    seed seeds[i]. Raises NonFiniteError as `run` does if any sample met NaN/Inf logits.
    """
    seeds = requests.seeds(seeds)
    many = jax.vmap(seeded(loop_of(model, family, request).run),
                    in_axes=(None, None, None, None, 0))
    args = request.args()[:-1] + (jnp.asarray(seeds, jnp.uint32),)
    exe, _ = aot((model.key, request.program, "many", len(seeds)), many, model.params, *args)
    out = jax.device_get(exe(model.params, *args))
    check_finite(out["nonfinite_at"], out["iterations"], out["tokens"])
    return np.asarray(out["tokens"]), np.asarray(out["n_tokens"]), np.asarray(out["nfe"])
