"""The request layer: a decode's options as one frozen value, checked once into a request.

`DecodeOptions` holds what a decode is asked to do (schedule, width, order, sampling,
length, stops, cache); `request` / `batch` check a prompt and its options against a
model once and give a `Request` / `Batch`: the `Program` (everything a compiled decode
is specialised on) and the traced arguments (the padded prompt, its length, the
family's limits with the sampling values, the seed). Nothing is compiled or run here.

One sizing rule serves every path (`capacity_for`, `bucket_for`): the cache is the
request's tokens rounded up to a power of two, the prompt padded to a power of two, so
requests of similar length share one program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import memory, sampling, stops, validate
from .sampling import Sampling

MIN_BUCKET = 16
MIN_CAPACITY = 128
DEFAULT_CACHE_SIZE = 4096


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """What one decode is asked to do (the keyword arguments of `decode`)."""

    schedule: str = "packed"
    block_size: int | None = None     # Nemotron's width B (default: the config's)
    window: int | None = None         # SetDLM's width W (default: the checkpoint's)
    order: str = "ltr"
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int = 128
    eos_id: int | None = -1
    stop_sequences: Sequence = ()
    cache_size: int | None = None
    branches: int | None = None       # Branched-SS's k (default 2)


@dataclasses.dataclass(frozen=True)
class Program:
    """What one compiled decode program is specialised on; all else is traced."""

    family: str
    schedule: str
    width: int        # the family's width: block size B (Nemotron), window W (SetDLM)
    bucket: int       # padded prompt length
    capacity: int     # KV slots for prompt + output
    sampling: Sampling = Sampling()
    order: str = "ltr"
    branches: int = 1  # Branched-SS's k (1 for every other schedule)


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked request: its program and traced arguments."""

    program: Program
    prompt: np.ndarray        # int32 ids, unpadded
    limits: dict[str, Any]    # traced: length limit, stop markers (EOS among them), sampling values
    seed: int
    max_new: int
    stop_texts: tuple[str, ...] = ()   # stops given as text, searched for on the host
    auto: dict | None = None   # schedule "auto": its choice (planner.Choice.summary)

    def host_args(self, seed=None) -> tuple:
        """The program's arguments after params, as numpy arrays: padded prompt, its
        length, limits, seed."""
        padded = np.zeros(self.program.bucket, np.int32)
        padded[: len(self.prompt)] = self.prompt
        return (padded, np.int32(len(self.prompt)), self.limits,
                np.uint32(self.seed if seed is None else seed))

    def args(self, seed=None) -> tuple:
        return jax.tree.map(jnp.asarray, self.host_args(seed))


@dataclasses.dataclass(frozen=True)
class Batch:
    """Checked requests decoded together by one batched program: one program (the bucket
    of the longest prompt, the capacity of the longest request) and, per prompt, its
    request (its own ids, limits and seed, on that program)."""

    program: Program
    members: tuple[Request, ...]

    def host_args(self) -> tuple:
        """The batched program's arguments after params, as numpy arrays: padded prompts
        [N, bucket], their lengths [N], the limits stacked on a leading N axis, seeds [N]
        (rows of them are the arguments of a sub-batch)."""
        rs = self.members
        padded = np.zeros((len(rs), self.program.bucket), np.int32)
        for i, r in enumerate(rs):
            padded[i, : len(r.prompt)] = r.prompt
        limits = jax.tree.map(lambda *x: np.stack([np.asarray(a) for a in x]),
                              *[r.limits for r in rs])
        return (padded, np.asarray([len(r.prompt) for r in rs], np.int32), limits,
                np.asarray([r.seed for r in rs], np.uint32))

    def args(self) -> tuple:
        return jax.tree.map(jnp.asarray, self.host_args())


def on_sampled_program(request: Request) -> Request:
    """`request` on the sampled program of its schedule, width and sizes (without top-k):
    a greedy request's temperature 0 is then data (`Sampler.argmax`), so greedy and
    sampled requests, whatever their temperature and top-p, share one decode state. Its
    tokens are those of `request`: the argmax where it is greedy, the same draws where
    it samples."""
    if request.program.sampling.top_k is not None:
        raise ValueError("a top-k request keeps its own program (top-k fixes the stored "
                         "proposals' shape)")
    program = dataclasses.replace(request.program, sampling=Sampling(greedy=False))
    return dataclasses.replace(request, program=program)


def _power_of_two(n: int, least: int) -> int:
    b = least
    while b < n:
        b *= 2
    return b


def bucket_for(n: int, capacity: int) -> int:
    """Prompt length rounded up to a power of two (at least MIN_BUCKET, at most capacity)."""
    return min(_power_of_two(n, MIN_BUCKET), capacity)


def capacity_for(need: int) -> int:
    """KV slots for a request of `need` tokens: a power of two, at least MIN_CAPACITY."""
    return _power_of_two(need, MIN_CAPACITY)


def plan(family, config, options: DecodeOptions, *, tokenizer=None, prompt_len=None):
    """The program (bucket 0: set once the prompt is known), the traced limits and the
    length limit of `options`, every option checked (and with `prompt_len`, that the
    request fits the cache).

    Without a `cache_size`, the capacity is sized to the request: prompt + max_new_tokens
    rounded up to a power of two (at least MIN_CAPACITY), so attention reads a buffer the
    size of the sequence, not of the model's longest context. With no prompt length
    (`decoder`, before the prompt's shape is known) it is min(DEFAULT_CACHE_SIZE,
    max_position_embeddings)."""
    o = options
    c = validate.decode_options(family, config, o)
    limits = {**stops.limits(tokenizer, config.vocab_size, c.max_new, c.eos, o.stop_sequences),
              **sampling.traced_values(c.sampler)}
    need = None if prompt_len is None else max(prompt_len + c.max_new, c.width)
    capacity = validate.cache_size(o.cache_size, config, block=c.width,
                                   block_name=family.width_name,
                                   default=DEFAULT_CACHE_SIZE if need is None else
                                   capacity_for(need))
    if prompt_len is not None:
        validate.fits(prompt_len, c.max_new, capacity)
    program = Program(family.name, o.schedule, c.width, 0, capacity, c.sampler.sampling, o.order,
                      c.branches)
    return program, limits, c.max_new


def read_once(options: DecodeOptions) -> DecodeOptions:
    """`options` with its stop markers read into a checked tuple: they are read twice (the
    marker table, then the text stops), and a generator gives nothing the second time."""
    return dataclasses.replace(options, stop_sequences=stops.markers(options.stop_sequences))


def _sized(model, program: Program, prompt_len: int, max_new: int, at_once: int = 1,
           hint: str | None = None) -> Program:
    """`program` with its prompt bucket, once its decode state is known to fit the free
    memory."""
    program = dataclasses.replace(program, bucket=bucket_for(prompt_len, program.capacity))
    memory.check(model, program, max_new, at_once, *(() if hint is None else (hint,)))
    return program


def request(model, family, prompt, options: DecodeOptions, seed=0) -> Request:
    """A checked request for one prompt (text or token ids)."""
    options = read_once(options)
    seed = validate.seed(seed)
    ids = validate.prompt_ids(model, prompt)
    program, limits, max_new = plan(family, model.config, options, prompt_len=len(ids),
                                    tokenizer=getattr(model, "tokenizer", None))
    program = _sized(model, program, len(ids), max_new)
    return Request(program, ids, limits, seed, max_new, stops.texts(options.stop_sequences))


def batch(model, family, prompts, options: DecodeOptions, seed=0,
          sequences: int | None = None) -> Batch:
    """Checked requests for a batched decode: `prompts` a non-empty list of prompts, `seed`
    one seed for every prompt or one per prompt. The batch shares one program: prompts
    are padded to the bucket of the longest, the cache sized for the longest request.
    `sequences`: how many are decoded at once (a queue's slots; default all), for the
    memory check."""
    options = read_once(options)
    prompts = validate.prompt_list(prompts)
    ids = [validate.prompt_ids(model, p, f"prompts[{i}]: ") for i, p in enumerate(prompts)]
    seeds = validate.seeds_for(seed, len(ids))
    longest = max(len(x) for x in ids)
    program, limits, max_new = plan(family, model.config, options, prompt_len=longest,
                                    tokenizer=getattr(model, "tokenizer", None))
    at_once = len(ids) if sequences is None else min(sequences, len(ids))
    program = _sized(model, program, longest, max_new, at_once, "a smaller cache_size or "
                     "fewer " + ("prompts per call" if sequences is None else "slots"))
    texts = stops.texts(options.stop_sequences)
    return Batch(program, tuple(Request(program, x, limits, s, max_new, texts)
                                for x, s in zip(ids, seeds)))
