"""Public functions: `decode` (every schedule of every family), `stream` (the same decode,
its tokens and text handed out as they are produced), `decode_continuous` (a queue of
prompts on a few slots), `decoder` (the same decode as a pure, jittable function) and
`logits` (parity hook). The four decoding functions take one list of option keywords,
written once (`decode_options`, which maps each family's width argument, `block_size=`
or `window=`, to `DecodeOptions.width`), and hand the request to the model's `Engine`
(engine.py); chats go through the model's chat template (chat.py)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Iterator, Mapping
from typing import Callable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from . import (chat, continuous, families, inspection, options as options_lib, planner,
               scheduler, scoring, stops, validate)
from .config import ModelConfig
from .chunks import Chunker, StreamChunk
from .engine import Engine
from .scheduler import DEFAULT_CHUNK, Streaming
from .options import Checked, DecodeOptions, Program, Request
from .results import DecodeResult
from .model import Model
from .validate import InputError, InputTypeError

__all__ = ["DecodeResult", "StreamChunk", "auto_planner", "decode", "decode_continuous",
           "decoder", "logits", "stream"]


def engine_of(model, config: ModelConfig | None = None) -> Engine:
    """The engine of what `decode` and `logits` decode with: a Model (from `load`), or a
    params tree together with `config=` (the model is checked once, when its engine is
    made)."""
    return Engine.of(model if config is None else as_model(model, config))


def as_model(model, config: ModelConfig | None = None):
    """A Model (from `load`), or a params tree together with `config=`, as a Model."""
    if config is not None:
        if not isinstance(config, ModelConfig):
            raise InputTypeError(f"config must be a packed_ss_jax.ModelConfig, got "
                                 f"{type(config).__name__}", "config")
        if not isinstance(model, Mapping):
            raise InputTypeError(f"with config=, pass the params tree (a dict), got "
                                 f"{type(model).__name__}", "model")
        return Model(config=config, params=model)
    validate.check_model(model)
    return model


# --- the options of the decoding functions, written once ------------------------------------

def decode_options(family, *, schedule: str = "packed", block_size: int | None = None,
                   window: int | None = None, branches: int | None = None,
                   max_new_tokens: int = 128, eos_id: int | None = -1,
                   temperature: float = 0.0, top_k: int | None = None,
                   top_p: float | None = None, seed: int | Sequence[int] = 0,
                   cache_size: int | None = None, order: str = "ltr",
                   stop_sequences: Sequence = (),
                   options: DecodeOptions | None = None) -> DecodeOptions:
    """The keyword arguments of `decode`, `stream`, `decode_continuous` and `decoder` (what
    each means: `decode`) as the request's `DecodeOptions` for a model of `family`, its
    width given under the family's own name (`block_size=` or `window=`). `options`: a
    DecodeOptions made beforehand, instead of the other keywords. Nothing is checked
    here but the width's name (`DecodeOptions.check` checks the rest, once)."""
    if options is not None:
        if not isinstance(options, DecodeOptions):
            raise InputTypeError(f"options must be a packed_ss_jax.DecodeOptions, got "
                                 f"{type(options).__name__}", "options")
        return options
    return DecodeOptions(
        schedule=schedule, width=_width(family, block_size=block_size, window=window),
        order=order, temperature=temperature, top_k=top_k, top_p=top_p,
        max_new_tokens=max_new_tokens, eos_id=eos_id, stop_sequences=stop_sequences,
        cache_size=cache_size, branches=branches, seed=seed)


def _width(family, **given) -> int | None:
    """The width, given under the family's own name (`block_size=` for Nemotron, `window=`
    for SetDLM): the one place the API's names become `DecodeOptions.width`. The other
    family's name is refused, naming it."""
    other = [name for name, v in given.items() if v is not None and name != family.width_name]
    if other:
        raise InputError(f"{family.title} models take {family.width_name}=, not {other[0]}=",
                         other[0])
    return given.get(family.width_name)


_OPTIONS = [p for p in inspect.signature(decode_options).parameters.values()
            if p.kind is p.KEYWORD_ONLY]


def _takes_options(without: tuple[str, ...] = ()):
    """A decoding function whose `**options` are `decode_options`'s keywords (all but
    `without`): its signature, as `help()` and `inspect` show it, lists them; a keyword it
    does not take is refused by name, and `options=` together with option keywords,
    before anything is checked."""
    shared = [p for p in _OPTIONS if p.name not in without]
    names = {p.name for p in shared}

    def wrap(fn):
        own = inspect.signature(fn)
        params = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
        known = names | {p.name for p in params}

        @functools.wraps(fn)
        def call(*args, **kwargs):
            unknown = [k for k in kwargs if k not in known]
            if unknown:
                raise InputTypeError(f"{fn.__name__}() got an unexpected keyword argument "
                                     f"{unknown[0]!r}", unknown[0])
            both = [k for k in kwargs if k in names and k != "options"]
            if kwargs.get("options") is not None and both:
                raise InputError(f"give options= or its fields as keywords, not both (got "
                                 f"{', '.join(both)})", "options")
            return fn(*args, **kwargs)

        call.__signature__ = own.replace(parameters=params + shared)
        return call

    return wrap


# --- prompts and requests -------------------------------------------------------------------

def is_batch(prompt) -> bool:
    """Whether `decode`'s prompt is a batch: a list of prompts (strings or id lists, or
    a 2-D array), not one prompt's ids."""
    if isinstance(prompt, np.ndarray):
        return prompt.ndim == 2
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and not any(validate.is_int(p) for p in prompt))


def chat_prompt(model, messages, chat_template_kwargs: Mapping | None = None, *,
                time_limit: float | None = None, max_chars: int | None = None) -> list[int]:
    """The prompt ids of a conversation: the model's chat template (see chat.py) rendered
    with the generation prompt, within `time_limit` seconds and `max_chars` characters
    (None: chat.py's defaults), tokenized without adding special tokens."""
    if getattr(model, "tokenizer", None) is None:
        raise InputError("messages need a tokenizer, and this model has none", "messages")
    with validate.about("chat_template_kwargs"):
        kwargs = chat.template_kwargs(chat_template_kwargs)
    kwargs.setdefault("add_generation_prompt", True)
    with validate.about("messages"):
        text = chat.of(model, time_limit=time_limit, max_chars=max_chars).render(messages,
                                                                                 **kwargs)
    return validate.encode(model.tokenizer, text, add_special_tokens=False)


def _prompt(model, prompt, messages, chat_template_kwargs):
    if prompt is None and messages is None:
        raise InputTypeError("prompt must be a string or a sequence of integer token ids (or "
                             "pass messages=[{'role': 'user', 'content': ...}]), got None",
                             "prompt")
    if prompt is not None and messages is not None:
        raise InputError("give a prompt (text or token ids) or messages (a chat), not both",
                         "prompt")
    if messages is not None:
        return chat_prompt(model, messages, chat_template_kwargs)
    if chat_template_kwargs:
        raise InputError("chat_template_kwargs apply to messages=, not to a prompt",
                         "chat_template_kwargs")
    return prompt


def _request(engine: Engine, prompt, messages, chat_template_kwargs,
             options: DecodeOptions) -> Request:
    prompt = _prompt(engine.model, prompt, messages, chat_template_kwargs)
    if options.schedule != planner.AUTO:
        return options_lib.request(engine.model, engine.family, prompt, options)
    ids = validate.prompt_ids(engine.model, prompt)
    options, auto = _chosen(engine, options, len(ids))
    return dataclasses.replace(options_lib.request(engine.model, engine.family, ids, options),
                               auto=auto)


def _chosen(engine: Engine, options: DecodeOptions, prompt_len: int,
            sequences: int = 1, refilled: bool = False) -> tuple[DecodeOptions, dict]:
    """Schedule "auto" resolved: the options of the candidate the model's planner
    chooses, and the choice's record for the results."""
    p = planner.Planner.of(engine.model)
    options = options_lib.read_once(options)   # stop markers may be an iterator: read once
    choice = p.choose(options, prompt_len, sequences, refilled=refilled)
    return p.options_for(options, choice.candidate), choice.summary(engine.family)


def _observed(engine: Engine, options: DecodeOptions, results: list[DecodeResult],
              iteration_s: float | None = None) -> None:
    """Decodes of an "auto" choice reported to its planner (Planner.observe)."""
    if options.schedule == planner.AUTO and results:
        planner.Planner.of(engine.model).observe(results, iteration_s)


def _batch(engine: Engine, prompts, options: DecodeOptions, sequences=None):
    """`engine.batch`, schedule "auto" resolved for `sequences` sequences at once (default
    all) of the batch's longest prompt."""
    if options.schedule != planner.AUTO:
        return engine.batch(prompts, options, sequences=sequences)
    prompts = validate.prompt_list(prompts)
    longest = max(len(validate.prompt_ids(engine.model, p, f"prompts[{i}]: "))
                  for i, p in enumerate(prompts))
    at_once = len(prompts) if sequences is None else min(sequences, len(prompts))
    # Slots are refilled only when there are more prompts than slots.
    options, auto = _chosen(engine, options, longest, at_once,
                            refilled=sequences is not None and len(prompts) > sequences)
    batch = engine.batch(prompts, options, sequences=sequences)
    return dataclasses.replace(batch, members=tuple(
        dataclasses.replace(r, auto=auto) for r in batch.members))


def check(model, prompt=None, options: DecodeOptions = DecodeOptions(), *, messages=None,
          chat_template_kwargs=None) -> Request:
    """The checked request `decode` and `stream` would run for `options`, without
    compiling or running anything: for a caller that checks on one thread and decodes on
    another (the server; then `decode_request`, `stream_request`)."""
    engine = engine_of(model)
    options = decode_options(engine.family, options=options)
    return _request(engine, prompt, messages, chat_template_kwargs, options)


def decode_request(model, request: Request) -> DecodeResult:
    """`decode` of a request already checked (`check`)."""
    engine = Engine.of(model)
    result = engine.decode(request)
    if result.auto is not None:
        planner.Planner.of(engine.model).observe([result])
    return result


# --- the decoding functions -------------------------------------------------------------------

@_takes_options()
def decode(model, prompt: str | Sequence[int] | None = None, *,
           messages: Sequence[Mapping] | None = None,
           chat_template_kwargs: Mapping | None = None, config: ModelConfig | None = None,
           **options) -> DecodeResult | list[DecodeResult]:
    """Decodes `prompt` (text, with the model's tokenizer, or token ids) with one schedule.

    A list of prompts (strings or id lists, of any lengths) is decoded as one batch (one
    prefill, one launch of the loop over every prompt's slot), and gives a list of
    DecodeResults, one per prompt, each what that prompt decoded alone gives (same
    tokens, NFE and statistics); `seed` is then one seed for every prompt or a list of
    one per prompt; `wall_s` is the whole batch's.

    messages:   instead of a prompt, a chat ([{"role": "user", "content": "..."}, ...])
                rendered with the checkpoint's chat template and the generation prompt;
                `chat_template_kwargs` go to the template (e.g. {"enable_thinking": False}).
    model:      a `Model` (from `load`), or a params tree with `config=` its ModelConfig.
    schedule:   Nemotron "ar", "linear", "quadratic", "packed", "branched"; SetDLM
                "serial", "native", "linear", "quadratic", "packed", "branched" (see
                `families.FAMILIES`); or "auto": the exact schedule, width and branches
                predicted fastest on this device for this request (planner.py; calibrated
                on first use; a width or branches given keep that width or k; the
                choice in `result.auto`).
    branches:   "branched": k, 1 <= k <= the width (B or W), branches pre-drafted per
                call (the zero-accepted one and k - 1 for the most accepted outcomes;
                default 2; 1 is Packed-SS).
    block_size: Nemotron: B >= 2 (W = B - 1 drafts per iteration); default the config's.
    window:     SetDLM: W >= 1, the active window; default the checkpoint's.
    temperature 0 is greedy (the speculative schedules return exactly the reference's
    argmax tokens). temperature > 0 samples exactly from the model's tempered, top-k /
    top-p truncated AR distribution (speculative rejection sampling); `seed` reproduces
    a run.
    eos_id:     stop at the first accepted EOS; -1 (default) uses the config's EOS, None
                disables EOS stopping.
    order:      SetDLM: "ltr" or "confidence" (App. E.6; greedy only).
    stop_sequences: markers (token-id lists, or strings with a tokenizer); one counts
                once all its tokens are accepted (detected in the decode loop), and a
                string also wherever it occurs in the decoded text, across token
                boundaries. The output ends at the earliest stop (stop included;
                `result.stop_at` is where a stop string starts in `result.text`).
    cache_size: KV positions for prompt + output (default: sized to the request); it is
                part of the compiled shape, so keep it fixed across calls.
    options:    a `DecodeOptions` (its width under one name, `width`) instead of the
                keywords above.
    """
    engine = engine_of(model, config)
    options = decode_options(engine.family, **options)
    if messages is None and is_batch(prompt):
        results = scheduler.decode_batch(engine, _batch(engine, prompt, options))
        _observed(engine, options, results)
        return results
    return decode_request(engine.model,
                          _request(engine, prompt, messages, chat_template_kwargs, options))


@_takes_options()
def decode_continuous(model, prompts: Sequence, *, slots: int = 8, every: int = 64,
                      config: ModelConfig | None = None, **options):
    """Decodes a long list of prompts keeping `slots` sequences busy (continuous
    batching, see continuous.py): as soon as sequences stop, the host refills their
    slots with the next prompts, in one prefill (the loop reports back at least every
    `every` iterations). Returns (one DecodeResult per prompt, in order, each what that
    prompt decoded alone gives; `continuous.Stats`, with the host round trips' share of
    wall time). The other arguments are `decode`'s.

    `prompts` is a list (or any iterable, read once) of prompts, never one string: pass
    [prompt] for one. At most one slot per prompt is used, and the slots' decode state
    (their KV caches) must fit in the free memory, which is checked before anything is
    allocated.
    """
    slots = validate.integer(slots, "slots", 1, validate.INT32_MAX, "slot indices are int32")
    every = validate.integer(every, "every", 1, validate.INT32_MAX,
                             "the loop counts iterations in int32")
    engine = engine_of(model, config)
    options = decode_options(engine.family, **options)
    batch = _batch(engine, prompts, options, sequences=slots)
    # A slot past the prompts would never hold one (and would cost its cache); no
    # request runs more than max_new_tokens + 1 iterations, so a larger `every` is that.
    slots = min(slots, len(batch.members))
    every = min(every, batch.members[0].max_new + 1)
    out = continuous.decode_queue(engine, batch, slots, every)   # (results, stats)
    if options.schedule == planner.AUTO:
        # Every request's iterations ran beside the others': the loop's seconds per step
        # (no step: nothing to time, NaN is dropped).
        stats = out[1]
        _observed(engine, options, out[0],
                  stats.loop_s / stats.steps if stats.steps else math.nan)
    return out


@_takes_options()
def stream(model, prompt: str | Sequence[int] | None = None, *,
           messages: Sequence[Mapping] | None = None,
           chat_template_kwargs: Mapping | None = None, config: ModelConfig | None = None,
           chunk: int = DEFAULT_CHUNK, **options) -> Iterator[StreamChunk]:
    """`decode`, handing out its output while it decodes: a `StreamChunk` after every
    launch of `chunk` decoder iterations (the same compiled loop, its state kept between
    launches), then a last one with the `DecodeResult`.

    The chunks' tokens together are `decode`'s tokens (greedy, and sampled with the same
    seed); their text together is `decode`'s text. Text is handed out once it is stable:
    never half a multi-byte character, nor the beginning of a stop string that may still
    complete. The arguments are `decode`'s, checked before the first chunk. Stopping the
    iteration early stops the decoding.
    """
    engine = engine_of(model, config)
    request = _request(engine, prompt, messages, chat_template_kwargs,
                       decode_options(engine.family, **options))
    return stream_request(engine.model, request, chunk)


def stream_request(model, request: Request, chunk: int = DEFAULT_CHUNK):
    """`stream` of a request already checked (`check`): the chunks, nothing checked again."""
    engine = Engine.of(model)
    return _chunks(engine, Streaming(engine, request, chunk), request.stop_texts)


def _chunks(engine: Engine, decoding: Streaming, stop_texts) -> Iterator[StreamChunk]:
    chunker = Chunker(getattr(engine.model, "tokenizer", None), stop_texts)
    while not decoding.done:
        chunk = chunker.add(decoding.launch(), decoding.done)
        if chunker.ended:
            break  # the output ends here: the result cuts it at the stop
        if chunk is not None:
            yield chunk
    result = decoding.result()
    if result.auto is not None:
        planner.Planner.of(engine.model).observe([result])
    yield chunker.last(result)


@_takes_options(without=("seed",))
def decoder(model_or_config, **options) -> Callable:
    """The decode as a pure function, for use inside JAX programs:

        fn(params, prompt_ids, prompt_len, key) -> (tokens, n_tokens, stats)

    prompt_ids: [P] int token ids, padded (with any valid id) past `prompt_len`; P is
    static, P + max_new_tokens <= cache_size. key: a PRNG key (ignored when greedy).
    Without a `cache_size`, the cache is sized from P + max_new_tokens (a power of two, as
    `decode` sizes it), when `fn` is traced.
    tokens: [max_new_tokens] int32, valid up to n_tokens. stats: nfe, iterations,
    accept_hist, nonfinite_at (the generated position where NaN/Inf logits stopped the
    loop, -1 when none; tokens past it are not emitted) and, for SetDLM, the row counts
    and traces. Shapes are static, so `fn` composes with `jax.jit`, `jax.vmap` (over
    prompts and keys: `jax.vmap(fn, in_axes=(None, 0, 0, 0))`) and sharding; called with
    `key = jax.random.PRNGKey(seed)` it returns what `decode(..., seed=seed)` returns.

    The arguments are `decode`'s but the seed (checked here, once); `model_or_config` is a
    Model or a ModelConfig (then stop strings cannot be tokenized: give stop sequences as
    ids).
    """
    if isinstance(model_or_config, ModelConfig):
        model = Model(config=model_or_config, params=None)
    else:
        model = as_model(model_or_config)
    family = families.of(model.config)
    options = decode_options(family, **options)
    if not (validate.is_int(options.seed) and options.seed == 0):
        raise InputError("a decoder takes its PRNG key when called, not a seed: pass "
                         "key=jax.random.PRNGKey(seed)", "seed")
    if options.schedule == planner.AUTO:
        raise InputError("schedule 'auto' chooses per request and device; a decoder is one "
                         "compiled schedule: pass the one `decode(..., schedule='auto')` "
                         "chose (its result's `schedule`, width and `branches`)", "schedule")
    checked = options.check(family, model.config, tokenizer=getattr(model, "tokenizer", None))
    context = model.config.max_position_embeddings

    def fn(params, prompt_ids, prompt_len, key):
        prompt_ids, prompt_len = jnp.asarray(prompt_ids), jnp.asarray(prompt_len)
        chex.assert_rank([prompt_ids, prompt_len], [1, 0])
        chex.assert_type([prompt_ids, prompt_len], int)
        program = _for_prompts_of(checked, prompt_ids.shape[0], options.cache_size is None,
                                  context)
        if key is None:
            if not program.sampling.greedy:
                raise InputError("a sampling decoder needs a PRNG key", "key")
            key = jax.random.PRNGKey(0)
        out = family.build(model, program).run(
            params, prompt_ids.astype(jnp.int32), prompt_len.astype(jnp.int32),
            jax.tree.map(jnp.asarray, checked.limits), key)
        tokens, n_tokens = out.pop("tokens")[: checked.max_new], out.pop("n_tokens")
        return tokens, n_tokens, out

    return fn


def _for_prompts_of(checked: Checked, length: int, sized: bool, context: int) -> Program:
    """A decoder's program for prompts padded to `length` tokens (static): without a
    cache_size (`sized`), its cache sized from that length as `decode` sizes it; refused
    if the prompt and the output cannot fit it."""
    program, max_new = checked.program, checked.max_new
    if sized:
        need = options_lib.capacity_for(max(length + max_new, program.width))
        program = dataclasses.replace(program, capacity=min(need, context))
    if length + max_new > program.capacity:
        raise InputError(f"prompt_ids of length {length} + max_new_tokens ({max_new}) exceed "
                         f"the cache ({program.capacity} positions)", "prompt_ids")
    return program


def auto_planner(model) -> planner.Planner:
    """What `schedule="auto"` decides with for this Model (see planner.py): its
    candidates, `calibrate(prompts)` (to calibrate on a workload's own prompts), `choose`
    (every candidate's prediction) and the running acceptance (`acceptance.table()`).
    `Planner(...).attach()` replaces it (other candidates, calibration folder). It is
    kept with the Model object: a params tree decoded with `config=` is a new model each
    call, so there `auto` reads its calibration back each time and keeps no running
    tally (make one `ps.Model(config=..., params=...)` to keep it)."""
    if not isinstance(model, Model):
        raise InputTypeError(f"auto_planner takes a packed_ss_jax.Model, got "
                             f"{type(model).__name__} (a params tree: ps.Model(config=..., "
                             "params=...))", "model")
    return planner.Planner.of(model)


def logits(model, tokens, positions, mask, draft_rows=None, *,
           config: ModelConfig | None = None) -> np.ndarray:
    """One full forward with no cache: tokens/positions [T], mask [T, T] -> [T, V] float32.

    `draft_rows` ([T] bool, optional) switches the draft-only adapter on for those rows.
    """
    model = as_model(model, config)
    tokens = np.asarray(tokens)
    positions = np.asarray(positions)
    mask = np.asarray(mask, bool)
    T = tokens.shape[0] if tokens.ndim == 1 else -1
    if tokens.ndim != 1 or positions.shape != (T,) or mask.shape != (T, T):
        raise InputError(f"expected tokens [T], positions [T], mask [T, T]; got {tokens.shape}, "
                         f"{positions.shape}, {mask.shape}", "tokens")
    validate.check_ids(tokens, model.vocab_size, "tokens")
    rows = np.zeros(T, bool) if draft_rows is None else np.asarray(draft_rows, bool)
    out, _ = inspection.forward(Engine.of(model), jnp.asarray(tokens, jnp.int32),
                                jnp.asarray(positions, jnp.int32), jnp.asarray(mask),
                                jnp.asarray(rows))
    return np.asarray(out, np.float32)


# --- what a front end checks itself, before it asks for a request (the server) -------------

MAX_STOP_LEN = stops.MAX_STOP_LEN   # tokens a stop marker may have
MAX_TOP = scoring.MAX_TOP           # most likely tokens a scored position may list
SEED_LIMIT = validate.SEED_LIMIT    # seeds lie in [0, SEED_LIMIT)
text = validate.text                # text a tokenizer can take (no lone surrogate)


def prompt_ids(model, prompt, *, add_special_tokens: bool = True) -> list[int]:
    """A prompt's ids as `decode` reads them: text through the model's tokenizer, or ids
    checked against its vocabulary; `add_special_tokens=False`: text tokenized without
    the tokenizer's special tokens (what a server's /tokenize may ask for)."""
    if add_special_tokens or not isinstance(prompt, str):
        return [int(i) for i in validate.prompt_ids(model, prompt)]
    return validate.encode(model.tokenizer, validate.text(prompt, "prompt", "prompt"),
                           add_special_tokens=False)
