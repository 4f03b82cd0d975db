"""Training loop: data streams, the jitted step, progress and loss logging, export.

One loop for both families; `FAMILIES` holds what differs: the batch construction and
the loss terms (`objective` for Nemotron-Labs-Diffusion, `setdlm_objective` for SetDLM),
while the model config switches the backbone and `export` the checkpoint layout.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np
import optax

from .. import model as model_lib
from ..config import ModelConfig
from . import corpus, export, objective, setdlm_objective
from .tokenizer import special_ids, train_tokenizer


SOURCES = ("problems", "drills", "recall", "code", "prose")


@dataclasses.dataclass(frozen=True)
class Family:
    """What the training of one model family needs besides the shared loop."""
    terms: tuple[str, ...]                 # loss terms, in the order `losses` returns them
    objective_config: type                 # its knobs (recorded in training.json)
    batch: Callable                        # (rng, clean [N, L], mask_id, objective config) -> arrays
    losses: Callable                       # (config, params, *arrays) -> one value per term


FAMILIES = {
    "nemotron": Family(("ar", "diff"), objective.NoiseConfig, objective.noise_batch,
                       objective.losses),
    "setdlm": Family(("ar", "diff", "next"), setdlm_objective.OrderConfig,
                     setdlm_objective.two_stream_batch, setdlm_objective.losses),
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    family: str = "nemotron"
    steps: int = 3300
    batch: int = 8
    seq_len: int = 128
    lr: float = 2.5e-3
    warmup: int = 50
    weight_decay: float = 0.05
    # Loss weights: AR (the verifier's conditional), diffusion (the drafter's) and, for
    # SetDLM, the clean stream's auxiliary next-token loss (see setdlm_objective).
    ar_weight: float = 1.0
    diff_weight: float = 0.3
    next_weight: float = 0.0
    mix: tuple[float, ...] = (0.6, 0.2, 0.1, 0.05, 0.05)  # weights of SOURCES
    # The first `warm_fraction` of the steps sample `warm_mix`, mostly copying sheets: a
    # model learns to look tokens up in its context (which every solution needs) from
    # them in a few hundred steps, and far more slowly from the problems alone.
    warm_mix: tuple[float, ...] = (0.3, 0.1, 0.6, 0.0, 0.0)
    warm_fraction: float = 0.2
    n_problems: int = 60000
    n_drills: int = 30000
    n_recall: int = 30000
    vocab_size: int = 2048
    tokenizer_problems: int = 20000
    seed: int = 0
    log_every: int = 25

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"TrainConfig.family {self.family!r}: expected one of {sorted(FAMILIES)}")
        for name in ("mix", "warm_mix"):
            w = getattr(self, name)
            if len(w) != len(SOURCES) or min(w) < 0 or sum(w) <= 0:
                raise ValueError(f"TrainConfig.{name} needs {len(SOURCES)} non-negative weights "
                                 f"({', '.join(SOURCES)}), not all zero; got {w}")

    @classmethod
    def for_family(cls, family: str, **overrides) -> "TrainConfig":
        """The defaults the shipped model of `family` was trained with, then `overrides`."""
        return cls(**(FAMILY_DEFAULTS.get(family, {}) | {"family": family} | overrides))

    def weights(self) -> tuple[float, ...]:
        """The weight of each of the family's loss terms."""
        return tuple(getattr(self, f"{t}_weight") for t in FAMILIES[self.family].terms)

    def mix_at(self, step: int) -> tuple[float, ...]:
        """The sampling weights of the sources at 1-based `step`."""
        return self.warm_mix if step <= round(self.warm_fraction * self.steps) else self.mix


# SetDLM: three rows per token (clean, verifier and drafter streams) instead of two, so
# fewer steps fit the same time (and smaller source pools do: 1000 steps read 8000
# windows). In so few steps only the arithmetic task is learned, so the mix leaves out
# code and prose, and the copying warm-up is longer (300 steps): the model copies names
# and numbers from the question only once it has learned it there. The drafter weighs as
# much as the verifier.
FAMILY_DEFAULTS = {"setdlm": {"steps": 1000, "diff_weight": 1.0, "next_weight": 0.5,
                              "mix": (0.65, 0.2, 0.15, 0.0, 0.0),
                              "warm_mix": (0.3, 0.1, 0.6, 0.0, 0.0), "warm_fraction": 0.3,
                              "n_problems": 20000, "n_drills": 10000, "n_recall": 10000}}


def model_config(vocab: int, ids: dict, *, family="nemotron", hidden=256, layers=4, heads=8,
                 kv_heads=4, head_dim=32, intermediate=640, block_size=8,
                 max_pos=1024) -> ModelConfig:
    """Nemotron: a Ministral-3 backbone with an untied diffusion head; SetDLM: Qwen3 (per-head
    q/k RMSNorm, head tied to the embedding). `block_size` is SetDLM's window W."""
    setdlm = family == "setdlm"
    return ModelConfig(
        family=family, vocab_size=vocab, hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=intermediate, rms_norm_eps=1e-6 if setdlm else 1e-5,
        mask_token_id=ids["mask"], eos_token_id=ids["eos"], bos_token_id=ids["bos"],
        block_size=block_size, max_position_embeddings=max_pos, rope_theta=10000.0,
        qk_norm=setdlm, tie_embeddings=setdlm)


class Streams:
    """Token streams (BOS text EOS, documents shuffled and concatenated) per source."""

    def __init__(self, tok, tc: TrainConfig, split: str = "train"):
        eos = special_ids(tok)["eos"]
        r = np.random.default_rng(tc.seed)
        probs = list(itertools.islice(corpus.arithmetic(split, tc.seed), tc.n_problems))
        drills = list(itertools.islice(corpus.drills(tc.seed), tc.n_drills))
        recall = list(itertools.islice(corpus.recall(tc.seed), tc.n_recall))
        sources = [[p.text for p in probs], drills, recall, corpus.code(split),
                   corpus.prose(split)]
        self.streams, self.starts = [], []
        for docs in sources:
            enc = tok.encode_batch(docs)
            order = r.permutation(len(enc))
            ids = [np.asarray(enc[i].ids + [eos], np.int32) for i in order]
            self.streams.append(np.concatenate(ids))
            self.starts.append(np.cumsum([0] + [len(x) for x in ids[:-1]]))

    def sizes(self) -> list[int]:
        return [len(s) for s in self.streams]

    def batch(self, rng: np.random.Generator, n: int, L: int, mix) -> np.ndarray:
        src = rng.choice(len(self.streams), size=n, p=np.asarray(mix) / np.sum(mix))
        out = np.empty((n, L), np.int32)
        for i, s in enumerate(src):
            # Windows start at a document start (BOS at position 0, as at inference), so
            # every document in a window but the last is whole: copying from the prompt
            # is always possible.
            stream, starts = self.streams[s], self.starts[s]
            o = int(starts[rng.integers(0, np.searchsorted(starts, len(stream) - L))])
            out[i] = stream[o:o + L]
        return out


def make_step(c: ModelConfig, tx, weights: tuple[float, ...]):
    """step(params, opt_state, *batch) -> (params, opt_state, loss, terms): one AdamW step
    on the weighted sum of the family's loss terms (`terms`: their values, unweighted)."""
    family = FAMILIES[c.family]
    if len(weights) != len(family.terms):
        raise ValueError(f"{c.family} has loss terms {family.terms}; got weights {weights}")

    def loss_fn(params, *batch):
        terms = family.losses(c, params, *batch)
        return sum(w * t for w, t in zip(weights, terms)), terms

    @jax.jit
    def step(params, opt_state, *batch):
        (loss, terms), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, terms

    return step


def optimizer(tc: TrainConfig):
    sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, min(tc.warmup, max(tc.steps // 2, 1)),
                                               max(tc.steps, 2), end_value=tc.lr * 0.05)
    decay = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # no decay on norm scales
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=tc.weight_decay,
                                   mask=decay))


def _bar(i, n, t0, terms: dict, width=24):
    done = int(width * i / n)
    el = time.monotonic() - t0
    eta = el / max(i, 1) * (n - i)
    losses = " ".join(f"{k} {v:.3f}" for k, v in terms.items())
    return (f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {losses} "
            f"{el / 60:5.1f}m elapsed, eta {eta / 60:4.1f}m ")


def train(out_dir: str | Path, tc: TrainConfig = TrainConfig(), model_kw: dict | None = None,
          max_minutes: float | None = None, quiet: bool = False, tokenizer=None,
          objective_config=None):
    """Trains from scratch and exports to `out_dir`; returns (config, params, log).

    objective_config: the family's `Family.objective_config` (default: its defaults)."""
    t_start = time.monotonic()
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    if tokenizer is None:
        tokenizer = _corpus_tokenizer(tc)
    ids = special_ids(tokenizer)
    family = FAMILIES[tc.family]
    oc = _objective_config(tc.family, objective_config)
    c = model_config(tokenizer.get_vocab_size(), ids, family=tc.family, **(model_kw or {}))
    streams = Streams(tokenizer, tc)
    say(f"tokenizer: {c.vocab_size} tokens; corpus tokens ({', '.join(SOURCES)}): "
        f"{streams.sizes()}; {time.monotonic() - t_start:.0f}s")

    params = model_lib.init_params(c, jax.random.PRNGKey(tc.seed))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    say(f"model: {n_params / 1e6:.2f}M params, {c.num_layers} layers, hidden {c.hidden_size}")
    batches = _batches(streams, tc, family, c.mask_token_id, oc)
    deadline = None if max_minutes is None else t_start + 60 * max_minutes
    params, steps_done, log, out_of_time = _fit(c, params, tc, batches, deadline, quiet)
    if out_of_time:
        say(f"\nstopping at step {steps_done}: the {max_minutes} min limit")
    jax.block_until_ready(params)
    wall = time.monotonic() - t_start
    say(f"\ntrained {steps_done} steps in {wall / 60:.1f} min")
    info = {"train_config": dataclasses.asdict(tc), "objective": dataclasses.asdict(oc),
            "model": model_kw or {}, "steps_done": steps_done, "params": int(n_params),
            "wall_s": round(wall, 1), "log": log}
    if out_dir is not None:
        export.export(out_dir, c, params, tokenizer, extra=info, length=tc.seq_len)
        say(f"saved to {out_dir}")
    return c, params, info


def _corpus_tokenizer(tc: TrainConfig):
    """A BPE tokenizer of `tc.vocab_size` tokens trained on the training split: the first
    `tc.tokenizer_problems` arithmetic problems, the code and the prose."""
    texts = [p.text for p in itertools.islice(corpus.arithmetic("train", tc.seed),
                                              tc.tokenizer_problems)]
    texts += corpus.code("train") + corpus.prose("train")
    return train_tokenizer(texts, tc.vocab_size)


def _objective_config(family_name: str, given):
    """`given`, or the family's default objective config; refuses one of another family."""
    family = FAMILIES[family_name]
    oc = given if given is not None else family.objective_config()
    if not isinstance(oc, family.objective_config):
        raise TypeError(f"objective_config for {family_name} must be a "
                        f"{family.objective_config.__name__}, got {type(oc).__name__}")
    return oc


def _batches(streams: Streams, tc: TrainConfig, family: Family, mask_id: int, oc):
    """next_batch(step) -> the family's training arrays for 1-based `step`: clean windows
    drawn with that step's source mix, then noised or ordered by the family's batch."""
    rng = np.random.default_rng(tc.seed + 1)

    def next_batch(i):
        clean = streams.batch(rng, tc.batch, tc.seq_len, tc.mix_at(i))
        return family.batch(rng, clean, mask_id, oc)

    return next_batch


def _fit(c: ModelConfig, params, tc: TrainConfig, next_batch: Callable,
         deadline: float | None, quiet: bool):
    """Runs up to `tc.steps` optimizer steps from `params`, stopping early once the clock
    passes `deadline` (a `time.monotonic()` value); returns (params, steps done, log,
    whether the deadline stopped it)."""
    tx = optimizer(tc)
    opt_state = tx.init(params)
    step = make_step(c, tx, tc.weights())
    terms_of = FAMILIES[c.family].terms
    log, t0 = [], time.monotonic()
    batch = next_batch(1)
    i = 0
    for i in range(1, tc.steps + 1):
        params, opt_state, loss, terms = step(params, opt_state, *batch)
        batch = next_batch(i + 1)  # prepared while the step runs
        if i % tc.log_every == 0 or i == tc.steps or i == 1:
            values = {k: float(v) for k, v in zip(terms_of, terms)}
            log.append({"step": i, **values, "loss": float(loss),
                        "elapsed_s": round(time.monotonic() - t0, 1)})
            if not quiet:
                _show_progress(i, tc, t0, values)
        if deadline is not None and time.monotonic() > deadline:
            return params, i, log, True
    return params, i, log, False


def _show_progress(i: int, tc: TrainConfig, t0: float, values: dict) -> None:
    """Redraws the progress bar on stderr, starting a new line every ten log steps."""
    sys.stderr.write(_bar(i, tc.steps, t0, values))
    if i % (tc.log_every * 10) == 0:
        sys.stderr.write("\n")
    sys.stderr.flush()
