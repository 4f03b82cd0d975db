"""The request layer: a decode's options as one frozen value, checked once into a request.

`DecodeOptions` holds what a decode is asked to do (schedule, width, order, sampling,
length, stops, cache, seed). `DecodeOptions.check(family, config)` checks every option
once, against the family and the config, into the `Program` (everything a compiled
decode is specialised on) and the traced limits; `request` / `batch` add the prompt(s)
and give a `Request` / `Batch`: the program and what its traced arguments are made of
(the prompt, the family's limits with the sampling values, the seed). Nothing is
compiled or run here.

One sizing rule serves every path (`capacity_for`, `bucket_for`): the cache is the
request's tokens rounded up to a power of two, the prompt padded to a power of two, so
requests of similar length share one program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import memory, stops, validate
from .sampling import Sampler, Sampling
from .shape import Shape
from .validate import MAX_CACHE, InputError

MIN_BUCKET = 16
MIN_CAPACITY = 128
DEFAULT_CACHE_SIZE = 4096
DEFAULT_BRANCHES = 2   # Branched-SS: the zero-accepted branch and the all-accepted one


@dataclasses.dataclass(frozen=True)
class Program:
    """What one compiled decode program is specialised on; all else is traced."""

    family: str
    shape: Shape      # the schedule, its width (B or W) and Branched-SS's k
    bucket: int       # padded prompt length
    capacity: int     # KV positions for prompt + output
    sampling: Sampling = Sampling()
    order: str = "ltr"

    @property
    def schedule(self) -> str:
        return self.shape.schedule

    @property
    def width(self) -> int:
        """The family's width: block size B (Nemotron), window W (SetDLM); 1 for the
        one-token reference."""
        return self.shape.width

    @property
    def branches(self) -> int:
        return self.shape.branches


@dataclasses.dataclass(frozen=True)
class Checked:
    """A decode's options checked (`DecodeOptions.check`): its program (bucket 0 until the
    prompt is known), the traced limits (length, stop markers with EOS, sampling values),
    the length limit and the stops given as text (searched for on the host)."""

    program: Program
    limits: dict[str, Any]
    max_new: int
    stop_texts: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """What one decode is asked to do: `decode`'s keyword arguments, with the width under
    one name (the family's B or W; the public functions take it as `block_size` or
    `window`). Nothing is checked until `check`."""

    schedule: str = "packed"
    width: int | None = None          # B (Nemotron) or W (SetDLM); default: the config's
    order: str = "ltr"
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int = 128
    eos_id: int | None = -1
    stop_sequences: Sequence = ()
    cache_size: int | None = None
    branches: int | None = None       # Branched-SS's k (default 2)
    seed: int | Sequence[int] = 0     # one seed, or (a batch) one per prompt

    def check(self, family, config, *, tokenizer=None, prompt_len: int | None = None
              ) -> Checked:
        """Every option but the seed, checked against the family and the config, once
        (and with `prompt_len`, that the request fits the cache); stop strings are
        tokenized with `tokenizer`.

        Without a `cache_size`, the capacity is sized to the request: prompt +
        max_new_tokens rounded up to a power of two (at least MIN_CAPACITY), so attention
        reads a buffer the size of the sequence, not of the model's longest context. With
        no prompt length (`decoder`, before the prompt's shape is known) it is
        min(DEFAULT_CACHE_SIZE, max_position_embeddings)."""
        sampler = validate.sampler(self.temperature, self.top_k, self.top_p)
        schedule_and_order(family, self.schedule, self.order, sampler)
        width = family.width(self.schedule, validate.integer(
            config.block_size if self.width is None else self.width, family.width_name,
            family.min_width, MAX_CACHE, "a block must fit the cache, whose positions are int32"))
        max_new = validate.integer(self.max_new_tokens, "max_new_tokens", 1, MAX_CACHE,
                                   "prompt + max_new_tokens must fit the cache, whose "
                                   "positions are int32")
        eos = _eos_id(self.eos_id, config, config.vocab_size)
        shape = Shape(self.schedule, width,
                      branches(self.branches, self.schedule, width, family.width_name))
        with validate.about("stop_sequences"):
            limits, texts = stops.of_request(tokenizer, config.vocab_size, max_new, eos,
                                             self.stop_sequences)
        need = None if prompt_len is None else max(prompt_len + max_new, width)
        capacity = _cache_size(self.cache_size, config, width=width,
                               width_name=family.width_name,
                               default=DEFAULT_CACHE_SIZE if need is None else
                               capacity_for(need))
        if prompt_len is not None:
            _fits(prompt_len, max_new, capacity)
        program = Program(family.name, shape, 0, capacity, sampler.sampling, self.order)
        return Checked(program, {**limits, **sampler.traced}, max_new, texts)


def _eos_id(value, config, vocab: int) -> int | None:
    """-1 (the config's EOS), None (no EOS stop) or a token id."""
    if value is None:
        return None
    try:
        value = validate.integer(value, "eos_id", -1)
    except InputError as e:
        raise type(e)(f"eos_id must be a token id, -1 (the config's EOS) or None, got "
                      f"{value!r}", "eos_id") from None
    if value == -1:
        value = getattr(config, "eos_token_id", None)
        if value is not None and not 0 <= value < vocab:
            raise InputError(f"the config's eos_token_id {value} is outside the vocabulary "
                             f"[0, {vocab}); pass eos_id=None or a valid id", "eos_id")
        return value
    if value >= vocab:
        raise InputError(f"eos_id {value} is outside the vocabulary [0, {vocab})", "eos_id")
    return value


def _cache_size(value, config, *, width: int, width_name: str, default: int) -> int:
    """KV positions (None: `default`), at least one block (`width` rows, the argument
    `width_name`)."""
    if value is None:
        value = min(default, getattr(config, "max_position_embeddings", default))
    value = validate.integer(value, "cache_size", 1)
    if value > MAX_CACHE:
        raise InputError(f"cache_size {value} is too large (at most {MAX_CACHE}: positions "
                         "are int32)", "cache_size")
    if width > value:
        raise InputError(f"{width_name} {width} does not fit the cache ({value} positions): use "
                         f"{width_name} <= {value} or a larger cache_size", "cache_size")
    return value


def _fits(prompt_len: int, max_new: int, cache: int) -> None:
    if prompt_len + max_new > cache:
        raise InputError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new}) = "
                         f"{prompt_len + max_new} exceeds the cache ({cache} positions); "
                         "shorten the request or pass a larger cache_size", "max_new_tokens")


def _choice(value, name: str, choices, where: str = "") -> str:
    if not isinstance(value, str) or value not in choices:
        raise InputError(f"unknown {name} {value!r}{where}; expected one of {sorted(choices)}",
                         name)
    return value


def schedule_and_order(family, schedule, order, sampler: Sampler) -> None:
    """The schedule, order and sampling combination is one the family decodes."""
    _choice(schedule, "schedule", family.schedules, f" for {family.title} models")
    if order != family.orders[0]:
        if len(family.orders) == 1:
            raise InputError(f"order {order!r}: {family.title} models verify in one order "
                             f"only, order={family.orders[0]!r}", "order")
        _choice(order, "order", family.orders)
        if schedule in family.orderless:
            raise InputError(f"schedule {schedule!r} has no verification order; use "
                             f"order={family.orders[0]!r}", "order")
    if not sampler.greedy:
        if schedule not in family.sampled:
            raise InputError(f"schedule {schedule!r} is greedy only: temperature must be 0; "
                             f"sampling is supported by {sorted(family.sampled)}",
                             "temperature")
        if order != family.orders[0]:
            raise InputError("any-order sampling is not supported: temperature > 0 needs "
                             f"order={family.orders[0]!r}", "temperature")


def branches(value, schedule: str, width: int, width_name: str = "block_size") -> int:
    """Branched-SS's k: 1 <= k <= the width (Nemotron: one branch per outcome of the B - 1
    drafts, the zero-accepted one among them; SetDLM: per outcome that leaves a rank of
    the W to draft); given for another schedule, an error."""
    if schedule != "branched":
        if value is not None:
            raise InputError(f"branches applies to schedule 'branched' only, not {schedule!r}",
                             "branches")
        return 1
    if value is None:
        return min(DEFAULT_BRANCHES, width)
    return validate.integer(value, "branches", 1, width, f"at most one per acceptance "
                                                         f"outcome: {width_name} {width}")


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


@dataclasses.dataclass(frozen=True)
class Batch:
    """Checked requests decoded together by one batched program: one program (the bucket
    of the longest prompt, the capacity of the longest request) and, per prompt, its
    request (its own ids, limits and seed, on that program)."""

    program: Program
    members: tuple[Request, ...]


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


def bucket_for(prompt_len: int, capacity: int) -> int:
    """Prompt length rounded up to a power of two (at least MIN_BUCKET, at most capacity)."""
    return min(_power_of_two(prompt_len, MIN_BUCKET), capacity)


def capacity_for(need: int) -> int:
    """KV positions for a request of `need` tokens: a power of two, at least MIN_CAPACITY."""
    return _power_of_two(need, MIN_CAPACITY)


def read_once(options: DecodeOptions) -> DecodeOptions:
    """`options` with its stop markers read into a checked tuple, for options checked more
    than once (`auto` checks them per candidate): a generator gives nothing the second
    time."""
    with validate.about("stop_sequences"):
        return dataclasses.replace(options, stop_sequences=stops.markers(options.stop_sequences))


def _sized(model, program: Program, prompt_len: int, max_new: int, at_once: int = 1,
           hint: str | None = None) -> Program:
    """`program` with its prompt bucket, once its decode state is known to fit the free
    memory."""
    program = dataclasses.replace(program, bucket=bucket_for(prompt_len, program.capacity))
    memory.check(model, program, max_new, at_once, *(() if hint is None else (hint,)))
    return program


def request(model, family, prompt, options: DecodeOptions, seed=None) -> Request:
    """A checked request for one prompt (text or token ids), with the options' seed or
    `seed`."""
    seed = validate.seed(options.seed if seed is None else seed)
    ids = validate.prompt_ids(model, prompt)
    c = options.check(family, model.config, tokenizer=getattr(model, "tokenizer", None),
                      prompt_len=len(ids))
    program = _sized(model, c.program, len(ids), c.max_new)
    return Request(program, ids, c.limits, seed, c.max_new, c.stop_texts)


def batch(model, family, prompts, options: DecodeOptions, seed=None,
          sequences: int | None = None) -> Batch:
    """Checked requests for a batched decode: `prompts` a non-empty list of prompts, the
    seed (the options', or `seed`) one for every prompt or one per prompt. The batch
    shares one program: prompts are padded to the bucket of the longest, the cache sized
    for the longest request. `sequences`: how many are decoded at once (a queue's slots;
    default all), for the memory check."""
    prompts = validate.prompt_list(prompts)
    ids = [validate.prompt_ids(model, p, f"prompts[{i}]: ") for i, p in enumerate(prompts)]
    seeds = validate.seeds_for(options.seed if seed is None else seed, len(ids))
    longest = max(len(x) for x in ids)
    c = options.check(family, model.config, tokenizer=getattr(model, "tokenizer", None),
                      prompt_len=longest)
    at_once = len(ids) if sequences is None else min(sequences, len(ids))
    program = _sized(model, c.program, longest, c.max_new, at_once, "a smaller cache_size or "
                     "fewer " + ("prompts per call" if sequences is None else "slots"))
    return Batch(program, tuple(Request(program, x, c.limits, s, c.max_new, c.stop_texts)
                                for x, s in zip(ids, seeds)))
