"""Public functions: `decode` (every schedule of every family), `stream` (the same decode,
its tokens and text handed out as they are produced), `decode_continuous` (a queue of
prompts on a few slots), `decoder` (the same decode as a pure, jittable function) and
`logits` (parity hook). Each builds the request's `DecodeOptions` and hands it to the
model's `Engine` (engine.py); chats go through the model's chat template (chat.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Callable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from . import chat, continuous, families, options as options_lib, planner, validate
from .config import ModelConfig
from .chunks import Chunker, StreamChunk
from .engine import DEFAULT_CHUNK, Engine, Streaming
from .options import DecodeOptions, Request
from .results import DecodeResult
from .model import Model
from .validate import InputError, InputTypeError

__all__ = ["DecodeResult", "StreamChunk", "auto_planner", "decode", "decode_continuous",
           "decoder", "logits", "stream"]


def as_model(model, config: ModelConfig | None = None):
    """What `decode` and `logits` decode with: a Model (from `load`), or a params tree
    together with `config=`."""
    if config is not None:
        if not isinstance(config, ModelConfig):
            raise InputTypeError(f"config must be a packed_ss_jax.ModelConfig, got "
                                 f"{type(config).__name__}")
        if not isinstance(model, Mapping):
            raise InputTypeError(f"with config=, pass the params tree (a dict), got "
                                 f"{type(model).__name__}")
        return Model(config=config, params=model)
    validate.check_model(model)
    return model


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
        raise InputError("messages need a tokenizer, and this model has none")
    kwargs = chat.template_kwargs(chat_template_kwargs)
    kwargs.setdefault("add_generation_prompt", True)
    text = chat.of(model, time_limit=time_limit, max_chars=max_chars).render(messages, **kwargs)
    return validate.encode(model.tokenizer, text, add_special_tokens=False)


def _prompt(model, prompt, messages, chat_template_kwargs):
    if prompt is None and messages is None:
        raise InputTypeError("prompt must be a string or a sequence of integer token ids (or "
                             "pass messages=[{'role': 'user', 'content': ...}]), got None")
    if prompt is not None and messages is not None:
        raise InputError("give a prompt (text or token ids) or messages (a chat), not both")
    if messages is not None:
        return chat_prompt(model, messages, chat_template_kwargs)
    if chat_template_kwargs:
        raise InputError("chat_template_kwargs apply to messages=, not to a prompt")
    return prompt


def _request(model, config, prompt, messages, chat_template_kwargs, seed,
             options: DecodeOptions) -> tuple[Engine, Request]:
    engine = Engine.of(as_model(model, config))
    prompt = _prompt(engine.model, prompt, messages, chat_template_kwargs)
    if options.schedule != planner.AUTO:
        return engine, engine.request(prompt, options, seed)
    ids = validate.prompt_ids(engine.model, prompt)
    options, auto = _chosen(engine, options, len(ids))
    return engine, dataclasses.replace(engine.request(ids, options, seed), auto=auto)


def _chosen(engine: Engine, options: DecodeOptions, prompt_len: int,
            sequences: int = 1) -> tuple[DecodeOptions, dict]:
    """Schedule "auto" resolved: the options of the candidate the engine's planner
    chooses, and the choice's record for the results."""
    p = planner.Planner.of(engine)
    options = options_lib.read_once(options)   # stop markers may be an iterator: read once
    choice = p.choose(options, prompt_len, sequences)
    return p.options_for(options, choice.candidate), choice.summary(engine.family)


def _observed(engine: Engine, options: DecodeOptions, results: list[DecodeResult]) -> None:
    """Decodes of an "auto" choice reported to the planner's acceptance model."""
    if options.schedule == planner.AUTO and results:
        planner.Planner.of(engine).observe(results)


def _batch(engine: Engine, prompts, options: DecodeOptions, seed, sequences=None):
    """`engine.batch`, schedule "auto" resolved for `sequences` sequences at once (default
    all) of the batch's longest prompt."""
    if options.schedule != planner.AUTO:
        return engine.batch(prompts, options, seed, sequences)
    prompts = validate.prompt_list(prompts)
    longest = max(len(validate.prompt_ids(engine.model, p, f"prompts[{i}]: "))
                  for i, p in enumerate(prompts))
    at_once = len(prompts) if sequences is None else min(sequences, len(prompts))
    options, auto = _chosen(engine, options, longest, at_once)
    batch = engine.batch(prompts, options, seed, sequences)
    return dataclasses.replace(batch, members=tuple(
        dataclasses.replace(r, auto=auto) for r in batch.members))


def check(model, prompt=None, *, messages=None, chat_template_kwargs=None, seed: int = 0,
          **options) -> Request:
    """The checked request `decode` and `stream` would run, without compiling or running
    anything (`options`: `decode`'s keyword arguments): for a caller that checks on one
    thread and decodes on another (the server)."""
    return _request(model, None, prompt, messages, chat_template_kwargs, seed,
                    _options(options))[1]


def _options(given: dict) -> DecodeOptions:
    try:
        return DecodeOptions(**given)
    except TypeError as e:  # an unknown keyword: say which
        raise InputTypeError(str(e).replace("DecodeOptions.__init__()", "decode()")) from None


def decode(model, prompt: str | Sequence[int] | None = None, *,
           messages: Sequence[Mapping] | None = None,
           chat_template_kwargs: Mapping | None = None, config: ModelConfig | None = None,
           schedule: str = "packed", block_size: int | None = None, window: int | None = None,
           branches: int | None = None,
           max_new_tokens: int = 128, eos_id: int | None = -1, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, seed: int = 0,
           cache_size: int | None = None, order: str = "ltr",
           stop_sequences: Sequence = ()) -> DecodeResult | list[DecodeResult]:
    """Decodes `prompt` (text, with the model's tokenizer, or token ids) with one schedule.

    A list of prompts (strings or id lists, of any lengths) is decoded as one batch, in one
    program, and gives a list of DecodeResults, one per prompt, each what that prompt
    decoded alone gives (same tokens, NFE and statistics); `seed` is then one seed for
    every prompt or a list of one per prompt; `wall_s` is the whole batch's.

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
    cache_size: KV slots for prompt + output (default: sized to the request); it is
                part of the compiled shape, so keep it fixed across calls.
    """
    options = DecodeOptions(schedule, block_size, window, order, temperature, top_k, top_p,
                            max_new_tokens, eos_id, stop_sequences, cache_size, branches)
    if messages is None and is_batch(prompt):
        engine = Engine.of(as_model(model, config))
        results = engine.decode_batch(_batch(engine, prompt, options, seed))
        _observed(engine, options, results)
        return results
    engine, request = _request(model, config, prompt, messages, chat_template_kwargs, seed,
                               options)
    result = engine.decode(request)
    _observed(engine, options, [result])
    return result


def decode_continuous(model, prompts: Sequence, *, slots: int = 8, every: int = 64,
                      config: ModelConfig | None = None, schedule: str = "packed",
                      block_size: int | None = None, window: int | None = None,
                      branches: int | None = None,
                      max_new_tokens: int = 128, eos_id: int | None = -1,
                      temperature: float = 0.0, top_k: int | None = None,
                      top_p: float | None = None, seed=0, cache_size: int | None = None,
                      order: str = "ltr", stop_sequences: Sequence = ()):
    """Decodes a long list of prompts keeping `slots` sequences busy (continuous
    batching, see continuous.py): as soon as sequences stop, the host refills their
    slots with the next prompts, in one call (the loop reports back at least every
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
    options = DecodeOptions(schedule, block_size, window, order, temperature, top_k, top_p,
                            max_new_tokens, eos_id, stop_sequences, cache_size, branches)
    engine = Engine.of(as_model(model, config))
    batch = _batch(engine, prompts, options, seed, sequences=slots)
    # A slot past the prompts would never hold one (and would cost its cache); no
    # request runs more than max_new_tokens + 1 iterations, so a larger `every` is that.
    slots = min(slots, len(batch.members))
    every = min(every, batch.members[0].max_new + 1)
    out = continuous.decode_queue(engine, batch, slots, every)   # (results, stats)
    _observed(engine, options, out[0])
    return out


def stream(model, prompt: str | Sequence[int] | None = None, *,
           messages: Sequence[Mapping] | None = None,
           chat_template_kwargs: Mapping | None = None, config: ModelConfig | None = None,
           schedule: str = "packed", block_size: int | None = None, window: int | None = None,
           branches: int | None = None,
           max_new_tokens: int = 128, eos_id: int | None = -1, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, seed: int = 0,
           cache_size: int | None = None, order: str = "ltr", stop_sequences: Sequence = (),
           chunk: int = DEFAULT_CHUNK) -> Iterator[StreamChunk]:
    """`decode`, handing out its output while it decodes: a `StreamChunk` after every
    launch of `chunk` decoder iterations (the same compiled loop, its state kept between
    launches), then a last one with the `DecodeResult`.

    The chunks' tokens together are `decode`'s tokens (greedy, and sampled with the same
    seed); their text together is `decode`'s text. Text is handed out once it is stable:
    never half a multi-byte character, nor the beginning of a stop string that may still
    complete. The arguments are `decode`'s, checked before the first chunk. Stopping the
    iteration early stops the decoding.
    """
    options = DecodeOptions(schedule, block_size, window, order, temperature, top_k, top_p,
                            max_new_tokens, eos_id, stop_sequences, cache_size, branches)
    engine, request = _request(model, config, prompt, messages, chat_template_kwargs, seed,
                               options)
    return stream_request(engine.model, request, chunk)


def stream_request(model, request: Request, chunk: int = DEFAULT_CHUNK):
    """`stream` of a request already checked (`check`): the chunks, nothing checked again."""
    engine = Engine.of(model)
    return _chunks(engine, engine.stream(request, chunk), request.stop_texts)


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
        planner.Planner.of(engine).observe([result])
    yield chunker.last(result)


def decoder(model_or_config, *, schedule: str = "packed", block_size: int | None = None,
            window: int | None = None, branches: int | None = None, max_new_tokens: int = 128,
            eos_id: int | None = -1,
            temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
            cache_size: int | None = None, order: str = "ltr",
            stop_sequences: Sequence = ()) -> Callable:
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

    The arguments are `decode`'s (checked here, once); `model_or_config` is a Model or a
    ModelConfig (then stop strings cannot be tokenized: give stop sequences as ids).
    """
    if schedule == planner.AUTO:
        raise InputError("schedule 'auto' chooses per request and device; a decoder is one "
                         "compiled schedule: pass the one `decode(..., schedule='auto')` "
                         "chose (its result's `schedule`, width and `branches`)")
    if isinstance(model_or_config, ModelConfig):
        model = Model(config=model_or_config, params=None)
    else:
        model = as_model(model_or_config)
    family = families.of(model.config)
    options = options_lib.read_once(DecodeOptions(
        schedule, block_size, window, order, temperature, top_k, top_p, max_new_tokens, eos_id,
        stop_sequences, cache_size, branches))
    program, limits, max_new = options_lib.plan(family, model.config, options,
                                                tokenizer=getattr(model, "tokenizer", None))

    def fn(params, prompt_ids, prompt_len, key):
        prompt_ids, prompt_len = jnp.asarray(prompt_ids), jnp.asarray(prompt_len)
        chex.assert_rank([prompt_ids, prompt_len], [1, 0])
        chex.assert_type([prompt_ids, prompt_len], int)
        P = prompt_ids.shape[0]
        p = program
        if cache_size is None:  # sized from the prompt's static length, as decode does
            need = options_lib.capacity_for(max(P + max_new, p.width))
            p = dataclasses.replace(p, capacity=min(need, model.config.max_position_embeddings))
        if P + max_new > p.capacity:
            raise InputError(f"prompt_ids of length {P} + max_new_tokens ({max_new}) exceed "
                             f"the cache ({p.capacity} slots)")
        if key is None:
            if not program.sampling.greedy:
                raise InputError("a sampling decoder needs a PRNG key")
            key = jax.random.PRNGKey(0)
        run = family.build(model, p)
        out = run.run(params, prompt_ids.astype(jnp.int32), prompt_len.astype(jnp.int32),
                  jax.tree.map(jnp.asarray, limits), key)
        tokens, n_tokens = out.pop("tokens")[:max_new], out.pop("n_tokens")
        return tokens, n_tokens, out

    return fn


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
                             "params=...))")
    return planner.Planner.of(Engine.of(model))


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
                         f"{positions.shape}, {mask.shape}")
    validate.check_ids(tokens, model.vocab_size, "tokens")
    rows = np.zeros(T, bool) if draft_rows is None else np.asarray(draft_rows, bool)
    out, _ = Engine.of(model).forward(jnp.asarray(tokens, jnp.int32),
                                      jnp.asarray(positions, jnp.int32), jnp.asarray(mask),
                                      jnp.asarray(rows))
    return np.asarray(out, np.float32)
