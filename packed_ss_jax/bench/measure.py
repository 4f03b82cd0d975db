"""The bench's decoding and timing: every schedule on every prompt, the width probe, the
cache size of a task, chat rendering of its prompts and the profile.

`run` is what a bench run measures; `probe` chooses widths with it (App. F.1). Both go
through `api.decode` (or `api.decode_continuous` for a queue), so they time the
programs a user's decode runs.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from .. import api, engine, families, options, validate
from . import accounting, stats, timing

SPLITS = ("null", "doubled")
BATCHING = ("continuous", "static")
PROBE_PROMPTS = 10  # App. F.1: the first ten questions of the task

# The chat template's arguments where the paper renders a task's prompts through the
# checkpoint's template (App. E.3): WritingBench with thinking disabled; SetDLM's GSM8K
# with thinking enabled.
CHAT_TEMPLATE_KWARGS = {("nemotron", "writingbench"): {"enable_thinking": False},
                        ("setdlm", "writingbench"): {"enable_thinking": False},
                        ("setdlm", "gsm8k"): {"enable_thinking": True}}


def sample_seed(seed: int, prompt: int, sample: int, samples: int) -> int:
    """The seed of prompt `prompt`'s sample `sample` (of `samples`): every response of a
    run has its own seed (App. E.4); with one sample, prompt i is decoded with seed + i."""
    return seed + prompt * samples + sample


def batches(prompts, size: int, samples: int = 1) -> list[list[int]]:
    """The run's responses (sample j of prompt i is response i * samples + j) in static
    batches of at most `size` consecutive ones; a batch holds responses with the same
    output cap and EOS rule (one program decodes them)."""
    def rule(r):
        p = prompts[r // samples]
        return p.max_new_tokens, p.stop_at_eos

    out = []
    for r in range(len(prompts) * samples):
        if out and len(out[-1]) < size and rule(out[-1][0]) == rule(r):
            out[-1].append(r)
        else:
            out.append([r])
    return out


def counts(**values) -> None:
    """An InputError (a ValueError) naming the first value that is not an integer >= 1."""
    for name, value in values.items():
        validate.integer(value, name, 1)


def cache_size_for(model, prompts, max_new_tokens=None) -> int:
    """One cache size for the whole task: the longest prompt plus its output cap, sized by
    the engine's rule (`options.capacity_for`), so that every response of the task runs
    one program (a decode sized per request would compile one per size)."""
    need = 0
    for p in prompts:
        if p.ids is not None:
            n = len(p.ids)
        else:
            n = len(model.tokenizer.encode(p.text).ids) if model.tokenizer is not None \
                else len(p.text)
        need = max(need, n + (max_new_tokens or p.max_new_tokens))
    return options.capacity_for(need)


def chat_prompts(model, prompts, task: str):
    """The prompts as one user message each through the model's chat template (with the
    paper's template arguments for the task), as ids."""
    kwargs = CHAT_TEMPLATE_KWARGS.get((families.of(model.config).name, task), {})
    return [dataclasses.replace(p, ids=api.chat_prompt(
        model, [{"role": "user", "content": p.text}], kwargs)) for p in prompts]


@dataclasses.dataclass(frozen=True)
class _Decoding:
    """What every decode of one run shares: the model, the prompts and the settings."""

    model: Any
    prompts: list
    widths: dict
    capacity: int
    temperature: float
    seed: int
    max_new_tokens: int | None
    order: str
    samples: int
    batch_size: int
    queue: bool       # a continuous queue (batch size > 1), else static batches

    def width(self, s: str) -> int:
        return self.widths[s] or self.model.config.block_size

    def decode(self, s: str, group: list[int], m=None) -> tuple[list, int, int]:
        """The group's results, the batched forward calls and loop iterations they took;
        decoded by `m` (a model with its forward replaced), or by the model."""
        m = self.model if m is None else m
        family = families.of(self.model.config)
        p = self.prompts[group[0] // self.samples]
        kw = dict(schedule=s, **{family.width_name: self.width(s)},
                  order=family.orders[0] if s in family.orderless else self.order,
                  max_new_tokens=self.max_new_tokens or p.max_new_tokens,
                  eos_id=-1 if p.stop_at_eos else None, temperature=self.temperature,
                  cache_size=self.capacity)
        seeds = [sample_seed(self.seed, r // self.samples, r % self.samples, self.samples)
                 for r in group]
        if self.batch_size == 1:
            r = api.decode(m, p.source, seed=seeds[0], **kw)
            return [r], r.nfe, r.iterations
        sources = [self.prompts[r // self.samples].source for r in group]
        if self.queue:
            rs, st = api.decode_continuous(m, sources, slots=self.batch_size, seed=seeds, **kw)
            return rs, st.forward_calls, st.steps
        rs = api.decode(m, sources, seed=seeds, **kw)
        return rs, max(r.nfe for r in rs), max(r.iterations for r in rs)

    def rows_per_call(self, s: str, r) -> int:
        if r.max_rows is not None:  # SetDLM: the decode counts its rows
            return r.max_rows
        return accounting.adapter_rows(s, self.width(s), False)["max_rows_per_call"]


def _check_run(prompts, repeats, samples, batch_size, batching, split) -> None:
    if not prompts:
        raise ValueError("no prompts to run")
    counts(repeats=repeats, samples=samples, batch_size=batch_size)
    if batching not in BATCHING:
        raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")


def run(model, prompts, schedules, widths, *, capacity: int, temperature=0.0, seed=0,
        max_new_tokens=None, repeats=1, split="null", order="ltr", samples=1,
        progress=True, batch_size=1, batching="continuous") -> dict:
    """Per schedule, per prompt: tokens, wall, NFE, model time, correctness.

    With `samples` > 1 every prompt is answered that many times per schedule, sample j of
    prompt i with seed `sample_seed(seed, i, j, samples)` (App. E.4: repeated sampling at
    temperature 1); each response is decoded and timed on its own, a prompt's tokens,
    wall, NFE and model time are the sums over its responses and its correctness is the
    list of their scores (pass@1 is then the mean over samples, then over prompts).
    With `repeats` > 1 every response is decoded that many times by every schedule, in
    turn (so slow drift of the machine hits all schedules alike), and the fastest wall
    time is kept; the outputs of the repeats are identical (same seed). Unless `split`
    is None, each decode is also run with the model replaced (same repeats; see
    `timing`): by one whose forward costs nothing (`split="null"`: that decode's time,
    scaled to the real iteration count, is the non-model work) or by one that does every
    forward pass twice (`split="doubled"`: the extra wall time is the model's).

    With `batch_size` N > 1 the responses are decoded N at a time, every response with
    its own seed, so its tokens are those decoded alone. `batching="continuous"` (the
    default) keeps N slots busy over the queue, refilling a slot as soon as its sequence
    stops (`api.decode_continuous`); `"static"` decodes consecutive groups of N
    (`batches`), each a prefill and one launch run until its last sequence stops. The
    wall time (and model time) of a batch or queue is shared equally by its responses,
    so sums over prompts are totals; `calls` is each response's share of its batch's or queue's
    batched forward calls.
    """
    _check_run(prompts, repeats, samples, batch_size, batching, split)
    queue = batch_size > 1 and batching == "continuous"
    d = _Decoding(model, prompts, widths, capacity, temperature, seed, max_new_tokens, order,
                  samples, batch_size, queue)
    other = None if split is None else \
        timing.Null(model) if split == "null" else timing.Doubled(model)
    # A queue holds every response with the same output cap and EOS rule.
    groups = batches(prompts, len(prompts) * samples if queue else batch_size, samples)
    _warm_up(d, schedules, groups, other)
    sums = {s: [dict(tokens=0, wall_s=0.0, nfe=0, iterations=0, model_s=0.0, calls=0.0,
                     max_rows=0) for _ in prompts] for s in schedules}
    scores = {s: [[] for _ in prompts] for s in schedules}
    hists = dict.fromkeys(schedules)
    t0, done = time.monotonic(), 0
    for group in groups:
        timed = _timed(d, schedules, group, repeats, split, other)
        for s, (best, model_s) in timed.items():
            hists[s] = _add(d, s, group, best, model_s, sums[s], scores[s], hists[s])
        done = group[-1] // samples + 1
        if progress:
            _progress(done, len(prompts), t0)
    if progress:
        sys.stderr.write("\n")
    return _per_schedule(prompts, schedules, sums, scores, hists, samples, split)


def _warm_up(d: _Decoding, schedules, groups, other) -> None:
    """Compiles and runs once, outside the measurements, every batch size the run uses
    (a queue: a short one), with the model and with its replacement."""
    for s in schedules:
        for group in {len(g): g for g in groups}.values():
            group = group[:d.batch_size + 1] if d.queue else group
            d.decode(s, group)
            if other is not None:
                d.decode(s, group, other)


def _timed(d: _Decoding, schedules, group, repeats: int, split, other) -> dict:
    """Per schedule: the fastest of `repeats` decodes of the group (results, calls,
    iterations) and the model time of the group from the fastest replaced decode (None
    without a split). The schedules take turns within each repeat."""
    runs = {s: [] for s in schedules}
    replaced = {s: [] for s in schedules}
    for _ in range(repeats):
        for s in schedules:
            runs[s].append(d.decode(s, group))
            if split:
                replaced[s].append(d.decode(s, group, other))
    out = {}
    for s in schedules:
        best = min(runs[s], key=lambda x: x[0][0].wall_s)
        model_s = None
        if split:
            wall, it_r = best[0][0].wall_s, best[2]  # the batch's (the queue's)
            o, _, it_o = min(replaced[s], key=lambda x: x[0][0].wall_s)
            if split == "null":
                model_s = wall - o[0].wall_s * (it_r + 1) / (it_o + 1)
            else:
                model_s = o[0].wall_s - wall
        out[s] = (best, model_s)
    return out


def _add(d: _Decoding, s: str, group, best, model_s, sums, scores, hist):
    """Adds a group's responses to their prompts' sums and scores (an equal share of the
    batch's wall time, calls and model time each); returns the accepted-length histogram
    with theirs added."""
    rs, calls, _ = best
    wall, n = rs[0].wall_s, len(group)
    for response, r in zip(group, rs):
        i = response // d.samples
        t = sums[i]
        t["tokens"] += len(r.tokens)
        t["wall_s"] += wall / n
        t["nfe"] += r.nfe
        t["iterations"] += r.iterations
        t["calls"] += calls / n
        t["max_rows"] = max(t["max_rows"], d.rows_per_call(s, r))
        if model_s is not None:
            t["model_s"] += model_s / n
        hist = r.accept_hist if hist is None else hist + r.accept_hist
        score = d.prompts[i].score
        if score is not None:
            scores[i].append(bool(score(r.text if r.text is not None else "")))
    return hist


def _progress(done: int, total: int, t0: float) -> None:
    sys.stderr.write(f"\rprompts {done}/{total} ({time.monotonic() - t0:.0f}s)")
    sys.stderr.flush()


def _per_schedule(prompts, schedules, sums, scores, hists, samples: int, split) -> dict:
    """`run`'s result: per schedule, a list per measure with an entry per prompt."""
    per = {}
    for s in schedules:
        d = {"tokens": [], "wall_s": [], "nfe": [], "iterations": [], "model_s": [],
             "calls": [], "correct": [], "max_rows": [], "hist": hists[s]}
        for i, p in enumerate(prompts):
            for k, v in sums[s][i].items():
                if k != "model_s" or split:
                    d[k].append(v)
            if p.score is not None:
                d["correct"].append(scores[s][i][0] if samples == 1 else scores[s][i])
        per[s] = d
    return per


def probe(model, prompts, schedules, sizes, fixed, *, progress=True, **kw) -> tuple[dict, list]:
    """App. F.1's block-size probe: every speculative schedule whose width is not `fixed`
    decodes the first PROBE_PROMPTS prompts at each size in `sizes` (with the run's cache
    size and repeats, so it times the programs the run will use); the size with the
    highest throughput (tokens / wall) is chosen. Returns ({schedule: width}, table rows)."""
    chosen, rows = dict(fixed), []
    reference = families.of(model.config).reference
    for s in schedules:
        if s == reference or fixed.get(s):
            continue
        best = None
        for B in sizes:
            d = run(model, prompts[:PROBE_PROMPTS], [s], {s: B}, split=None,
                    progress=False, **kw)[s]
            row = _probe_row(s, B, d)
            rows.append(row)
            if best is None or row["throughput_tok_s"] > best[1]:
                best = (B, row["throughput_tok_s"])
            if progress:
                sys.stderr.write(f"probe {s} {B}: {row['throughput_tok_s']:.1f} tok/s, "
                                 f"{row['tokens_per_nfe']:.2f} tok/NFE\n")
        chosen[s] = best[0]
    return chosen, rows


def _probe_row(s: str, B: int, d: dict) -> dict:
    """One row of the probe table: a schedule at one width, from its `run` result."""
    tok, wall, nfe = sum(d["tokens"]), sum(d["wall_s"]), sum(d["nfe"])
    n = len(d["tokens"])
    return {"schedule": s, "width": B, "prompts": n, "tokens": tok,
            "wall_s": wall, "nfe": nfe, "mean_tokens": tok / n,
            "mean_wall_s": wall / n, "mean_nfe": nfe / n,
            "tokens_per_nfe": tok / nfe, "throughput_tok_s": tok / wall,
            "rows_per_call": max(d["max_rows"]),
            "accuracy": stats.pass_at_1(d["correct"]) if d["correct"] else None}


def profile(model, prompt, schedules, widths, out_dir: str, max_new: int = 32) -> None:
    """A jax.profiler trace of a few decode iterations per schedule, and each schedule's
    optimised HLO (the whole compiled decode program: first call plus while_loop step)."""
    import jax

    out = Path(out_dir)
    (out / "hlo").mkdir(parents=True, exist_ok=True)
    width_name = families.of(model.config).width_name
    for s in schedules:
        api.decode(model, prompt, schedule=s, **{width_name: widths[s]}, max_new_tokens=max_new)
    with jax.profiler.trace(str(out / "trace")):
        for s in schedules:
            with jax.profiler.TraceAnnotation(f"decode {s}"):
                api.decode(model, prompt, schedule=s, **{width_name: widths[s]},
                           max_new_tokens=max_new)
    programs = engine.Engine.of(model).executables()
    for program, exe in ((k[1], exe) for k, exe in programs.items() if k[0] == "decode"):
        name = (f"{program.schedule}_{program.order}_w{program.width}_bucket{program.bucket}"
                ".hlo.txt")
        (out / "hlo" / name).write_text(exe.as_text())
