"""`packed-ss bench`: the paper's measurements for chosen schedules on one task.

Either family: Nemotron-Labs-Diffusion schedules take block sizes (`--block-size`), SetDLM
schedules windows (`--window`, and `--order`), as the family table says; the default
schedules are all of the model's family. Batch size 1, one prompt at a time (optionally
several times, keeping the fastest).
Per schedule: tokens (total, mean), decoder wall time, NFE, tokens/NFE, time/NFE,
throughput (total tokens / total wall), the split of wall time into model execution and
non-model decoder work, the accepted-length histogram and task accuracy. Packed-SS is
compared with each baseline by paired bootstrap intervals over prompts (same resampled
indices for every method). Compilation is excluded: every program is compiled before
it is timed (AOT), and each schedule is warmed up on the first prompt. Widths are
given, or chosen per schedule by the paper's throughput probe on the first prompts
(App. F.1).

One invocation can sweep widths, SetDLM verification orders, the draft-only adapter (on,
off) and tasks; every combination is a run. Prompts can be answered several times with
distinct seeds (App. E.4, pass@1). Beyond each run's table: paired accuracy differences
(Table 11), the adapter's row accounting (App. F.2), the time split normalised per task
(Figure 5), and a record of versions, device, model checksum, flags and seeds; a saved
run is redrawn with --replot.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from .. import api, engine, families, requests
from ..arguments import (Parser, UsageError, distributed, int_at_least, load_model, model_args,
                         run_command, seed as seed_arg, temperature as temperature_arg)
from . import accounting, figures, provenance, stats, tasks, timing


def _size(text: str, spec: str, flag: str, minimum: int) -> int:
    text = text.strip()
    if not text.isdigit() or int(text) < minimum:
        raise ValueError(f"{flag}: sizes must be integers >= {minimum}, got {spec!r}")
    return int(text)


def parse_widths(spec: str | None, schedules, flag: str = "--block-size",
                 minimum: int = 2) -> dict[str, int | None]:
    """'16' for all, or 'packed=32,linear=32,quadratic=8'; every size an integer >= minimum."""
    out = {s: None for s in schedules}
    if not spec:
        return out
    if "=" not in spec:
        size = _size(spec, spec, flag, minimum)
        return {s: size for s in schedules}
    for part in filter(None, (x.strip() for x in spec.split(","))):
        name, eq, value = (x.strip() for x in part.partition("="))
        if not eq:
            raise ValueError(f"{flag}: {part!r} is not SCHEDULE=SIZE (in {spec!r})")
        if name not in out:
            raise ValueError(f"{flag} names {name!r}, which is not among --schedules")
        out[name] = _size(value, spec, flag, minimum)
    return out


def parse_probe(spec: str, minimum: int = 2) -> list[int]:
    """'4,8,16' -> [4, 8, 16]; every size an integer >= minimum."""
    parts = [x.strip() for x in spec.split(",") if x.strip()]
    if not parts or not all(x.isdigit() and int(x) >= minimum for x in parts):
        raise ValueError(f"--probe: sizes must be integers >= {minimum}, got {spec!r}")
    return list(dict.fromkeys(int(x) for x in parts))


SPLITS = ("null", "doubled")
BATCHING = ("continuous", "static")


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


def _counts(**values) -> None:
    """An InputError (a ValueError) naming the first value that is not an integer >= 1."""
    for name, value in values.items():
        requests.integer(value, name, 1)


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
    (`batches`), each one program run until its last sequence stops. The wall time (and
    model time) of a batch or queue is shared equally by its responses, so sums over
    prompts are totals; `calls` is each response's share of its batch's or queue's
    batched forward calls.
    """
    if not prompts:
        raise ValueError("no prompts to run")
    _counts(repeats=repeats, samples=samples, batch_size=batch_size)
    if batching not in BATCHING:
        raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
    queue = batch_size > 1 and batching == "continuous"
    per = {s: {"tokens": [], "wall_s": [], "nfe": [], "iterations": [], "model_s": [],
               "calls": [], "correct": [], "max_rows": [], "hist": None} for s in schedules}
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")
    other = timing.Null(model) if split == "null" else timing.Doubled(model)

    family = families.of(model.config)

    def width(s):
        return widths[s] or model.config.block_size

    def one(s, group, m=model) -> tuple[list, int, int]:
        """The group's results, the batched forward calls and loop iterations they took."""
        p = prompts[group[0] // samples]
        kw = dict(schedule=s, **{family.width_name: width(s)},
                  order=family.orders[0] if s in family.orderless else order,
                  max_new_tokens=max_new_tokens or p.max_new_tokens,
                  eos_id=-1 if p.stop_at_eos else None, temperature=temperature,
                  cache_size=capacity)
        seeds = [sample_seed(seed, r // samples, r % samples, samples) for r in group]
        if batch_size == 1:
            r = api.decode(m, p.source, seed=seeds[0], **kw)
            return [r], r.nfe, r.iterations
        sources = [prompts[r // samples].source for r in group]
        if queue:
            rs, st = api.decode_continuous(m, sources, slots=batch_size, seed=seeds, **kw)
            return rs, st.forward_calls, st.steps
        rs = api.decode(m, sources, seed=seeds, **kw)
        return rs, max(r.nfe for r in rs), max(r.iterations for r in rs)

    def rows_per_call(s, r):
        if r.max_rows is not None:  # SetDLM: the decode counts its rows
            return r.max_rows
        return accounting.adapter_rows(s, width(s), False)["max_rows_per_call"]

    # A queue holds every response with the same output cap and EOS rule.
    groups = batches(prompts, len(prompts) * samples if queue else batch_size, samples)
    for s in schedules:  # warm-up: compile, and run once, outside the measurements
        for group in {len(g): g for g in groups}.values():  # every batch size used
            group = group[:batch_size + 1] if queue else group  # a queue: a short one
            one(s, group)
            if split:
                one(s, group, other)
    t0 = time.monotonic()
    sums = {s: [dict(tokens=0, wall_s=0.0, nfe=0, iterations=0, model_s=0.0, calls=0.0,
                     max_rows=0) for _ in prompts] for s in schedules}
    scores = {s: [[] for _ in prompts] for s in schedules}
    done = 0
    for group in groups:
        runs = {s: [] for s in schedules}
        replaced = {s: [] for s in schedules}
        for _ in range(repeats):
            for s in schedules:
                runs[s].append(one(s, group))
                if split:
                    replaced[s].append(one(s, group, other))
        n = len(group)
        for s in schedules:
            rs, calls, it_r = min(runs[s], key=lambda x: x[0][0].wall_s)
            wall = rs[0].wall_s  # the batch's (the queue's)
            if split:
                o, _, it_o = min(replaced[s], key=lambda x: x[0][0].wall_s)
                if split == "null":
                    model_s = wall - o[0].wall_s * (it_r + 1) / (it_o + 1)
                else:
                    model_s = o[0].wall_s - wall
            d = per[s]
            for response, r in zip(group, rs):
                i = response // samples
                t = sums[s][i]
                t["tokens"] += len(r.tokens)
                t["wall_s"] += wall / n
                t["nfe"] += r.nfe
                t["iterations"] += r.iterations
                t["calls"] += calls / n
                t["max_rows"] = max(t["max_rows"], rows_per_call(s, r))
                if split:
                    t["model_s"] += model_s / n
                d["hist"] = r.accept_hist if d["hist"] is None else d["hist"] + r.accept_hist
                if prompts[i].score is not None:
                    scores[s][i].append(bool(prompts[i].score(r.text if r.text is not None
                                                              else "")))
        done = group[-1] // samples + 1
        if progress:
            sys.stderr.write(f"\rprompts {done}/{len(prompts)} ({time.monotonic() - t0:.0f}s)")
            sys.stderr.flush()
    for s in schedules:
        d = per[s]
        for i, p in enumerate(prompts):
            for k, v in sums[s][i].items():
                if k != "model_s" or split:
                    d[k].append(v)
            if p.score is not None:
                d["correct"].append(scores[s][i][0] if samples == 1 else scores[s][i])
        if progress:
            sys.stderr.write(f"\rprompts {done}/{len(prompts)} ({time.monotonic() - t0:.0f}s)")
            sys.stderr.flush()
    if progress:
        sys.stderr.write("\n")
    return per


PROBE_PROMPTS = 10  # App. F.1: the first ten questions of the task


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
            tok, wall, nfe = sum(d["tokens"]), sum(d["wall_s"]), sum(d["nfe"])
            n = len(d["tokens"])
            rows.append({"schedule": s, "width": B, "prompts": n, "tokens": tok,
                         "wall_s": wall, "nfe": nfe, "mean_tokens": tok / n,
                         "mean_wall_s": wall / n, "mean_nfe": nfe / n,
                         "tokens_per_nfe": tok / nfe, "throughput_tok_s": tok / wall,
                         "rows_per_call": max(d["max_rows"]),
                         "accuracy": stats.pass_at_1(d["correct"]) if d["correct"] else None})
            if best is None or tok / wall > best[1]:
                best = (B, tok / wall)
            if progress:
                sys.stderr.write(f"probe {s} {B}: {tok / wall:.1f} tok/s, "
                                 f"{tok / nfe:.2f} tok/NFE\n")
        chosen[s] = best[0]
    return chosen, rows


def probe_markdown(rows: list, chosen: dict, width_label: str = "B") -> str:
    """Table 3's layout: means per response, rates from totals, the most input rows in
    one call after the first, accuracy for comparison, and the size chosen."""
    out = [f"block-size probe (first {PROBE_PROMPTS} prompts; App. F.1):",
           f"| schedule | {width_label} | tokens | wall (s) | NFE | tokens/NFE | "
           "throughput (tok/s) | rows/call | accuracy | chosen |",
           "|" + "---|" * 10]
    for r in rows:
        mark = "yes" if chosen.get(r["schedule"]) == r["width"] else ""
        acc = "-" if r.get("accuracy") is None else f"{100 * r['accuracy']:.1f}%"
        out.append(f"| {r['schedule']} | {r['width']} | {r['mean_tokens']:.1f} | "
                   f"{r['mean_wall_s']:.4f} | {r['mean_nfe']:.1f} | {r['tokens_per_nfe']:.2f} | "
                   f"{r['throughput_tok_s']:.1f} | {r['rows_per_call']} | {acc} | {mark} |")
    return "\n".join(out)


# The chat template's arguments where the paper renders a task's prompts through the
# checkpoint's template (App. E.3): WritingBench with thinking disabled; SetDLM's GSM8K
# with thinking enabled.
CHAT_TEMPLATE_KWARGS = {("nemotron", "writingbench"): {"enable_thinking": False},
                        ("setdlm", "writingbench"): {"enable_thinking": False},
                        ("setdlm", "gsm8k"): {"enable_thinking": True}}


def chat_prompts(model, prompts, task: str):
    """The prompts as one user message each through the model's chat template (with the
    paper's template arguments for the task), as ids."""
    kwargs = CHAT_TEMPLATE_KWARGS.get((families.of(model.config).name, task), {})
    return [dataclasses.replace(p, ids=api.chat_prompt(
        model, [{"role": "user", "content": p.text}], kwargs)) for p in prompts]


def cache_size_for(model, prompts, max_new_tokens=None) -> int:
    """One cache size for the whole task: the longest prompt plus its output cap, rounded
    up to a power of two (every call attends over the whole buffer, so size it to the task)."""
    need = 0
    for p in prompts:
        if p.ids is not None:
            n = len(p.ids)
        else:
            n = len(model.tokenizer.encode(p.text).ids) if model.tokenizer is not None \
                else len(p.text)
        need = max(need, n + (max_new_tokens or p.max_new_tokens))
    size = 64
    while size < need:
        size *= 2
    return size


def summarize(model_name: str, task: str, per: dict, widths, config_width: int,
              resamples: int = stats.RESAMPLES, family: str = "nemotron",
              samples: int = 1, batch_size: int = 1, mesh: dict | None = None,
              batching: str = "continuous") -> dict:
    """The run's table: totals and rates per schedule (means per response), and Packed-SS
    against each baseline with paired bootstrap intervals over prompts (every response
    of a resampled prompt included; the wall difference is per response)."""
    _counts(resamples=resamples, samples=samples)
    n = len(next(iter(per.values()))["tokens"])
    fam = families.FAMILIES[family]
    results = {}
    for s, d in per.items():
        tokens, wall, nfe = (np.asarray(d[k], float) for k in ("tokens", "wall_s", "nfe"))
        model_s = float(np.sum(d["model_s"]))
        calls = float(np.sum(d["calls"])) if d.get("calls") else float(nfe.sum())
        results[s] = {
            fam.width_name: None if s == fam.reference else (widths[s] or config_width),
            "tokens": int(tokens.sum()), "mean_tokens": float(tokens.mean() / samples),
            "wall_s": float(wall.sum()), "nfe": int(nfe.sum()),
            "tokens_per_nfe": float(tokens.sum() / nfe.sum()),
            "time_per_nfe_ms": float(1e3 * wall.sum() / nfe.sum()),
            # One forward call of the batch (all its sequences): time/NFE at batch size 1.
            "time_per_call_ms": float(1e3 * wall.sum() / calls),
            "throughput_tok_s": float(tokens.sum() / wall.sum()),
            "model_time_s": model_s,
            "non_model_time_s": float(wall.sum() - model_s),
            "non_model_fraction": float(1 - model_s / wall.sum()),
            "accept_hist": [int(x) for x in d["hist"]],
            "accuracy": stats.pass_at_1(d["correct"]) if d["correct"] else None,
            "max_rows_per_call": max(d["max_rows"]) if d.get("max_rows") else None,
        }
    idx = stats.resample_indices(n, resamples)
    paired, figure3 = {}, {}
    scored = {s for s, d in per.items() if d["correct"]}
    if "packed" in per:
        for s in per:
            if s != "packed":
                p = stats.paired(per["packed"], per[s], idx)
                p["wall_diff_s"] /= samples  # per prompt -> per response
                p["wall_diff_ci95"] = [x / samples for x in p["wall_diff_ci95"]]
                paired[f"packed_vs_{s}"] = p
                if {"packed", s} <= scored:  # Table 11: accuracy differences
                    acc = stats.paired_accuracy(per["packed"]["correct"], per[s]["correct"], idx)
                    paired[f"packed_vs_{s}"].update(accuracy_diff_pp=acc["diff_pp"],
                                                    accuracy_diff_ci95_pp=acc["ci95_pp"])
    if "linear" in per:
        figure3 = {s: stats.ratio_to(per[s], per["linear"], idx) for s in per}
        for s in per:  # the accuracy-difference panel of Figures 3/4
            if {"linear", s} <= scored:
                acc = stats.paired_accuracy(per[s]["correct"], per["linear"]["correct"], idx)
                figure3[s]["accuracy_diff_pp"] = {"diff": acc["diff_pp"], "ci95": acc["ci95_pp"]}
    return {"model": model_name, "family": family, "width_name": fam.width_name, "task": task,
            "n_prompts": n, "samples": samples, "batch_size": batch_size, "mesh": mesh,
            "batching": batching if batch_size > 1 else None,
            "results": results,
            "paired": paired, "ratios_to_linear": figure3, "bootstrap_resamples": resamples,
            "warmup": "each schedule decoded the first prompt once before timing; "
                      "compilation is ahead of time and never inside wall_s",
            "wall_s_is": "per prompt, the sum over its responses of the fastest of `repeats` "
                         "identical decodes (with a batch size N > 1: each response's "
                         "equal share of its batch's, or continuous queue's)",
            "per_prompt": {s: {k: d[k] for k in ("tokens", "wall_s", "nfe", "iterations",
                                                 "model_s", "correct") if k in d}
                           for s, d in per.items()}}


def markdown(summary: dict) -> str:
    family = families.FAMILIES[summary.get("family", "nemotron")]
    width_name, label = family.width_name, family.width_symbol
    batch = summary.get("batch_size", 1)
    if summary.get("batching"):
        batch = f"{batch} {summary['batching']}"
    mesh = mesh_label(summary.get("mesh"))
    # tokens/NFE is per sequence; time/call is one forward call of the whole batch.
    rows = [f"| schedule | {label} | batch | mesh | tokens | mean tokens | wall (s) | NFE "
            "| tokens/NFE | time/call (ms) | throughput (tok/s) | non-model time | accuracy |",
            "|" + "---|" * 13]
    for s, r in summary["results"].items():
        acc = "-" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}%"
        per_call = r.get("time_per_call_ms", r["time_per_nfe_ms"])
        rows.append(f"| {s} | {r[width_name] or '-'} | {batch} | {mesh} | {r['tokens']} | "
                    f"{r['mean_tokens']:.1f} | {r['wall_s']:.2f} | {r['nfe']} | "
                    f"{r['tokens_per_nfe']:.2f} | {per_call:.2f} | "
                    f"{r['throughput_tok_s']:.1f} | {100 * r['non_model_fraction']:.1f}% | "
                    f"{acc} |")
    if summary["paired"]:
        rows += ["", "| Packed-SS vs | throughput ratio [95% CI] | wall diff per response (s) "
                 "[95% CI] | accuracy diff (points) [95% CI] |", "|---|---|---|---|"]
        for name, p in summary["paired"].items():
            lo, hi = p["throughput_ratio_ci95"]
            dlo, dhi = p["wall_diff_ci95"]
            acc = "-"
            if "accuracy_diff_pp" in p:
                alo, ahi = p["accuracy_diff_ci95_pp"]
                acc = f"{p['accuracy_diff_pp']:+.1f} [{alo:+.1f}, {ahi:+.1f}]"
            rows.append(f"| {name.removeprefix('packed_vs_')} | {p['throughput_ratio']:.3f} "
                        f"[{lo:.3f}, {hi:.3f}] | {p['wall_diff_s']:+.4f} [{dlo:+.4f}, {dhi:+.4f}] "
                        f"| {acc} |")
    hist = ["", "accepted tokens per iteration (histogram, index = tokens):"]
    for s, r in summary["results"].items():
        hist.append(f"  {s}: {r['accept_hist']}")
    return "\n".join(rows + hist)


def mesh_label(mesh: dict | None) -> str:
    """'data=2,model=4', or '-' for one device."""
    return ",".join(f"{k}={v}" for k, v in mesh.items()) if mesh else "-"


def check_plot(path: str, schedules) -> None:
    """What --plot needs, checked before the run: Linear-SS (the ratios' baseline),
    matplotlib, and an image format it writes."""
    if schedules is not None and "linear" not in schedules:
        raise UsageError("--plot needs linear among --schedules (ratios are to Linear-SS)")
    try:
        figures.check_writable_format(path)
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
    except ValueError as e:
        raise UsageError(f"--plot {path}: {e}") from None


def plot(results: dict, path: str) -> None:
    """Figures 3/4 (a row per run) and Figure 5; see `figures.plot`."""
    figures.plot(results, path)


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
    for program, exe in engine.executables(model.key).items():
        name = (f"{program.schedule}_{program.order}_w{program.width}_bucket{program.bucket}"
                ".hlo.txt")
        (out / "hlo" / name).write_text(exe.as_text())


def check_output_file(path: str, flag: str) -> None:
    """Refuses an output file that could not be written, before the run (creates nothing)."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file name")
    parent = p.parent
    if parent.exists() and not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is not a directory")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")


def check_output_dir(path: str, flag: str) -> None:
    """Refuses an output directory that could not be created or written, before the run."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {path} exists and is not a directory")
    existing = p
    while not existing.exists():  # the directories that mkdir(parents=True) would create
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {existing} is not writable")


def check_distinct(paths: dict[str, str | None]) -> None:
    seen = {}
    for flag, path in paths.items():
        if path is None:
            continue
        key = Path(path).resolve()
        if key in seen:
            raise UsageError(f"{seen[key]} and {flag} name the same path {path}")
        seen[key] = flag


MAX_BOOTSTRAP_ENTRIES = 200_000_000  # resamples x prompts indices (8 bytes each) in memory


def main(argv: list[str] | None = None, prog: str = "packed-ss bench") -> int:
    """`packed-ss bench`; every argument is checked before the model is loaded or anything
    is compiled, so a careless command line fails at once, not after the run."""
    return run_command(prog, _main, argv)




def parse_width_sweep(spec: str | None, schedules, flag: str, minimum: int) -> list[dict]:
    """'8' or 'packed=32,linear=8': one width setting; '8,16' (sizes only): one setting per
    size, each for every schedule (a sweep, e.g. Tables 8-10's W = 8 and 16)."""
    if spec and "=" not in spec and "," in spec:
        sizes = [_size(x, spec, flag, minimum) for x in spec.split(",") if x.strip()]
        if not sizes:
            raise ValueError(f"{flag}: no sizes in {spec!r}")
        return [{s: B for s in schedules} for B in dict.fromkeys(sizes)]
    return [parse_widths(spec, schedules, flag, minimum)]


def parse_names(spec: str, flag: str, allowed) -> list[str]:
    """'a,b' -> ['a', 'b'], each one of `allowed`, duplicates dropped, at least one."""
    names = list(dict.fromkeys(x.strip() for x in spec.split(",") if x.strip()))
    bad = [x for x in names if x not in allowed]
    if bad or not names:
        raise UsageError(f"{flag}: {'unknown ' + str(bad) if bad else 'none given'}; "
                         f"expected one or more of {list(allowed)}")
    return names


def parse_data(spec: str | None, names: list[str]) -> dict[str, str | None]:
    """--data: the file of the one file task among the tasks, or TASK=PATH,TASK=PATH."""
    files = [t for t in names if t in tasks.FILE_TASKS]
    out = {t: None for t in names}
    if spec is None:
        return out
    if not files:
        raise UsageError(f"--data is for the file tasks {sorted(tasks.FILE_TASKS)}; "
                         f"tasks {names} are generated offline")
    if len(files) == 1:
        out[files[0]] = spec.removeprefix(files[0] + "=")
        return out
    for part in filter(None, (x.strip() for x in spec.split(","))):
        task, eq, path = part.partition("=")
        if not eq or task not in files:
            raise UsageError(f"--data: with several file tasks give TASK=PATH for each of "
                             f"{files}, got {part!r}")
        out[task] = path
    return out


def sweep_markdown(runs: list[dict]) -> str:
    """Tables 8-10's layout for a sweep: per run (task, width, order, adapter) and schedule,
    means per response and rates from totals, then Packed-SS against the schedule with
    paired 95% intervals (throughput ratio, wall difference, accuracy difference)."""
    out = ["| run | schedule | tokens | wall (s) | NFE | tokens/NFE | time/NFE (ms) | "
           "throughput (tok/s) | accuracy | Packed-SS / it, throughput [95% CI] | "
           "Packed-SS - it, wall (s) [95% CI] | Packed-SS - it, accuracy (points) [95% CI] |",
           "|" + "---|" * 12]
    for run in runs:
        n = run["n_prompts"] * run.get("samples", 1)
        label = figures.run_label(run)
        for s, r in run["results"].items():
            acc = "-" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}%"
            cells = ["-", "-", "-"]
            p = run["paired"].get(f"packed_vs_{s}")
            if p:
                lo, hi = p["throughput_ratio_ci95"]
                dlo, dhi = p["wall_diff_ci95"]
                cells[0] = f"{p['throughput_ratio']:.3f} [{lo:.3f}, {hi:.3f}]"
                cells[1] = f"{p['wall_diff_s']:+.4f} [{dlo:+.4f}, {dhi:+.4f}]"
                if "accuracy_diff_pp" in p:
                    alo, ahi = p["accuracy_diff_ci95_pp"]
                    cells[2] = f"{p['accuracy_diff_pp']:+.1f} [{alo:+.1f}, {ahi:+.1f}]"
            out.append(f"| {label} | {s} | {r['tokens'] / n:.1f} | {r['wall_s'] / n:.4f} | "
                       f"{r['nfe'] / n:.1f} | {r['tokens_per_nfe']:.2f} | "
                       f"{r['time_per_nfe_ms']:.2f} | {r['throughput_tok_s']:.1f} | {acc} | "
                       + " | ".join(cells) + " |")
    return "\n".join(out)


def report(results: dict) -> str:
    """Everything a run prints: each run's table, the sweep table, Figure 5's numbers and
    the adapter accounting (also what --replot prints from a saved run)."""
    runs = figures.runs_of(results)
    parts = []
    for run in runs:
        if len(runs) > 1:
            parts.append(f"### {figures.run_label(run)}")
        if run.get("probe"):
            chosen = {s: r.get(run.get("width_name", "block_size"))
                      for s, r in run["results"].items()}
            symbol = "W" if run.get("width_name") == "window" else "B"
            parts.append(probe_markdown(run["probe"], chosen, symbol))
        parts.append(markdown(run))
    if len(runs) > 1:
        parts.append(sweep_markdown(runs))
    if results.get("figure5"):
        parts.append(figures.decomposition_markdown(results["figure5"]))
    if results.get("lora_accounting"):
        parts.append(accounting.lora_markdown(results["lora_accounting"]))
    return "\n\n".join(parts)


def replot(path: str, plot_path: str | None) -> int:
    """--replot: the tables and the figure of a saved run, without decoding."""
    if plot_path is None:
        raise UsageError("--replot needs --plot FILE (where to draw the figure)")
    check_output_file(plot_path, "--plot")
    check_distinct({"--replot": path, "--plot": plot_path})
    check_plot(plot_path, None)
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--replot {path}: no such file")
    try:
        results = json.loads(p.read_text(encoding="utf-8"))
        figures.runs_of(results)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise UsageError(f"--replot {path}: not a packed-ss bench result ({e})") from None
    try:
        print(report(results))
        plot(results, plot_path)
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise UsageError(f"--replot {path}: a field the figure needs is missing or "
                         f"malformed ({type(e).__name__}: {e})") from None
    except ValueError as e:
        raise UsageError(f"--replot {path}: {e}") from None
    print(f"figure written to {plot_path}", file=sys.stderr)
    return 0


LORA_SETTINGS = {"on": True, "off": False}


def _main(argv: list[str] | None, prog: str) -> int:
    p = Parser(prog=prog, description=__doc__.split("\n\n")[0])
    model_args(p)
    all_tasks = sorted(tasks.OFFLINE_TASKS) + sorted(tasks.FILE_TASKS)
    p.add_argument("--task", default="arithmetic",
                   help=f"one of {all_tasks}, or several comma-separated (Figure 5 averages "
                        f"the time split over them)")
    p.add_argument("--data", help="local task file in its public jsonl format (paper tasks); "
                                  "with several file tasks TASK=PATH,TASK=PATH")
    p.add_argument("--chat", action="store_true",
                   help="render each prompt as a user message through the checkpoint's chat "
                        "template (WritingBench: enable_thinking=False; SetDLM GSM8K: "
                        "enable_thinking=True, as in the paper)")
    p.add_argument("--schedules", default=None,
                   help="comma-separated (default: every schedule of the model's family)")
    p.add_argument("--block-size", help="Nemotron-Labs-Diffusion: B for all, or per schedule: "
                                        "packed=32,linear=32,quadratic=8, or a sweep: 4,8")
    p.add_argument("--window", help="SetDLM: W for all, or per schedule: packed=8,linear=8, "
                                    "or a sweep: 8,16")
    p.add_argument("--order", default=None,
                   help="SetDLM: verification order of the speculative schedules, ltr "
                        "(default), confidence, or both: ltr,confidence")
    p.add_argument("--lora", default=None,
                   help="Nemotron-Labs-Diffusion with a draft-only adapter: on, off, or on,off "
                        "(both, with the adapter's row accounting; App. F.2)")
    p.add_argument("--probe", metavar="SIZES",
                   help=f"choose each schedule's width as in App. F.1: the highest throughput "
                        f"on the first {PROBE_PROMPTS} prompts among these sizes, e.g. 4,8,16 "
                        f"(with --repeats as set; a size given by --block-size/--window wins)")
    p.add_argument("--repeats", type=int_at_least(1), default=1,
                   help="decode each prompt this many times per schedule and keep the fastest "
                        "wall time (less timing noise; tokens are identical)")
    p.add_argument("--samples", type=int_at_least(1), default=1,
                   help="responses per prompt, each with its own seed (App. E.4; needs "
                        "--temperature > 0); accuracy is then pass@1, the mean over samples")
    p.add_argument("--split", choices=SPLITS, default="null",
                   help="how the model / non-model time split is measured: null (a decode whose "
                        "forward computes nothing) or doubled (every forward done twice)")
    p.add_argument("--batch-size", type=int_at_least(1), default=1,
                   help="decode this many prompts at once (per prompt the same tokens); see "
                        "--batching")
    p.add_argument("--batching", choices=BATCHING, default="continuous",
                   help="with --batch-size N > 1: continuous (default) keeps N slots busy, "
                        "refilling a slot as soon as its sequence stops; static decodes "
                        "groups of N consecutive prompts, each until its last one stops")
    p.add_argument("--limit", type=int_at_least(1), default=None,
                   help="first N prompts (offline tasks: 100)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=None,
                   help="override the task's output cap")
    p.add_argument("--temperature", type=temperature_arg, default=0.0)
    p.add_argument("--seed", type=seed_arg, default=0,
                   help="sample j of prompt i is decoded with seed + i * samples + j")
    p.add_argument("--resamples", type=int_at_least(1), default=stats.RESAMPLES,
                   help=f"bootstrap resamples (at least 1; default {stats.RESAMPLES})")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write Figures 3/4 (ratios to Linear-SS, accuracy "
                                  "difference) and 5 (time split) here (PNG)")
    p.add_argument("--replot", metavar="RESULTS_JSON",
                   help="draw --plot from a saved --json run, without decoding")
    p.add_argument("--profile", help="write a jax.profiler trace and optimised HLO here")
    args = p.parse_args(argv)
    if args.replot is not None:
        return replot(args.replot, args.plot)

    # Everything that can be checked without the model's weights, before they are read:
    # the command line, the output paths, the task, and the config (for the family).
    task_names = parse_names(args.task, "--task", all_tasks)
    data = parse_data(args.data, task_names)
    for flag in ("--json", "--plot"):
        if getattr(args, flag[2:]):
            check_output_file(getattr(args, flag[2:]), flag)
    if args.profile:
        check_output_dir(args.profile, "--profile")
    check_distinct({"--json": args.json, "--plot": args.plot, "--profile": args.profile})
    if args.samples > 1 and args.temperature == 0:
        raise UsageError(f"--samples {args.samples}: greedy decoding (--temperature 0) gives "
                         f"the same response every time; sample with --temperature > 0")
    from .. import loading

    config = loading.read_config(args.model, dtype=args.dtype, base_config=args.base_config)
    family = families.of(config)
    names = family.schedules if args.schedules is None else \
        [s.strip() for s in args.schedules.split(",") if s.strip()]
    schedules = list(dict.fromkeys(names))
    bad = [s for s in schedules if s not in family.schedules]
    if bad or not schedules:
        raise UsageError(f"--schedules: {'unknown ' + str(bad) if bad else 'none given'}; "
                         f"{family.title} models decode with {list(family.schedules)}")
    flag = "--" + family.width_name.replace("_", "-")
    other = [f for f in ("--block-size", "--window") if f != flag and getattr(args, f[2:].replace("-", "_"))]
    if other:
        raise UsageError(f"{other[0]} is for other model families; this {family.title} model "
                         f"takes {flag}")
    orders = [family.orders[0]]
    if args.order is not None:
        try:
            orders = parse_names(args.order, "--order", family.orders)
        except UsageError:
            raise UsageError(f"--order {args.order}: {family.title} models verify in order "
                             f"{', '.join(family.orders)}") from None
    loras = [None]
    if args.lora is not None:
        if family.name != "nemotron":
            raise UsageError(f"--lora: {family.title} checkpoints have no draft-only adapter")
        loras = [LORA_SETTINGS[x] for x in parse_names(args.lora, "--lora", LORA_SETTINGS)]
    if args.temperature > 0:
        greedy_only = [s for s in schedules if s not in family.sampled] + \
            [o for o in orders if o != family.orders[0]]
        if greedy_only:
            raise UsageError(f"{family.title} models sample (--temperature > 0) with "
                             f"{list(family.sampled)} in {family.orders[0]} order only; drop "
                             f"{greedy_only}")
    if args.plot:
        check_plot(args.plot, schedules)
    try:
        width_sets = parse_width_sweep(getattr(args, family.width_name), schedules, flag,
                                       family.min_width)
        sizes = parse_probe(args.probe, family.min_width) if args.probe else []
    except ValueError as e:
        raise UsageError(str(e)) from None
    if sizes and len(width_sets) > 1:
        raise UsageError(f"--probe chooses the widths; a sweep of {flag} sizes fixes them: "
                         f"give one or the other")
    widths = width_sets[0]
    if sizes and all(s == family.reference or widths[s] for s in schedules):
        raise UsageError(f"--probe: every schedule's width is already fixed by {flag} (or only "
                         f"{family.reference} is run); nothing to probe")
    prompt_sets = {t: tasks.load(t, data[t], args.limit) for t in task_names}
    most = max(len(v) for v in prompt_sets.values())
    if args.seed + most * args.samples - 1 >= 2**32:
        raise UsageError(f"--seed {args.seed}: sample j of prompt i is decoded with seed + i * "
                         f"samples + j, which must stay below 2**32 for all {most} prompts "
                         f"x {args.samples} samples")
    if args.resamples * most > MAX_BOOTSTRAP_ENTRIES:
        raise UsageError(f"--resamples {args.resamples} x {most} prompts is more "
                         f"bootstrap indices than fit in memory (at most "
                         f"{MAX_BOOTSTRAP_ENTRIES:,})")
    model_dir = loading.resolve(args.model)
    # The provenance record lists the devices, which starts JAX: a multi-host run must
    # join its processes first.
    distributed(args)
    tokenizer = args.tokenizer
    if tokenizer is not None and Path(tokenizer).is_dir():  # the file that is read
        tokenizer = str(Path(tokenizer) / "tokenizer.json")
    record = provenance.record(argv if argv is not None else sys.argv[1:], vars(args),
                               args.model or "nld-tiny", model_dir,
                               {"base_config": args.base_config, "tokenizer": tokenizer,
                                **{f"data {t}": path for t, path in data.items()}})
    record["seeds"] = {"seed": args.seed, "decode": "seed + prompt * samples + sample",
                       "bootstrap": stats.BOOTSTRAP_SEED}

    name = args.model or "embedded"
    runs, first = [], None
    for lora in loras:
        model = load_model(args, lora=lora)
        if args.chat and first is None:  # the rendering needs the tokenizer
            prompt_sets = {t: chat_prompts(model, ps, t) for t, ps in prompt_sets.items()}
        capacity = {t: cache_size_for(model, ps, args.max_new_tokens)
                    for t, ps in prompt_sets.items()}
        if first is None:
            first = model
            # Checked before anything is compiled: every width (and probed size) fits.
            used = {}
            for ws in width_sets:
                used.update({f"{s} {flag}={ws[s] or config.block_size}": ws[s] or config.block_size
                             for s in schedules if s != family.reference
                             and not (sizes and not ws[s])})
            used.update({f"--probe {B}": B for B in sizes})
            room = min(capacity.values())
            too_big = [n for n, B in used.items() if B > room]
            if too_big:
                raise UsageError(f"widths larger than the task's cache ({room} slots): "
                                 f"{', '.join(too_big)}")
        for task, prompts in prompt_sets.items():
            for ws in width_sets:
                for order in orders:
                    # Orderless schedules (the reference, native) decode the same in every
                    # order: they run with the first order only.
                    run_schedules = schedules if order == orders[0] else \
                        [s for s in schedules if s not in family.orderless]
                    print(f"{name}: {len(prompts)} {task} prompts"
                          + (f" x {args.samples} samples" if args.samples > 1 else "")
                          + f", schedules {run_schedules}, order {order}, temperature "
                          f"{args.temperature}" + ("" if lora is None else
                                                   f", adapter {'on' if lora else 'off'}"),
                          file=sys.stderr)
                    kw = dict(temperature=args.temperature, seed=args.seed,
                              max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                              capacity=capacity[task], order=order, samples=args.samples,
                              batch_size=args.batch_size, batching=args.batching)
                    used_widths, probe_rows = {s: ws[s] for s in run_schedules}, []
                    if sizes:
                        used_widths, probe_rows = probe(model, prompts, run_schedules, sizes,
                                                        used_widths, **kw)
                    per = run(model, prompts, run_schedules, used_widths, split=args.split, **kw)
                    summary = summarize(name, task, per, used_widths, config.block_size,
                                        args.resamples, family=family.name, samples=args.samples,
                                        batch_size=args.batch_size, mesh=args.mesh,
                                        batching=args.batching)
                    summary.update(temperature=args.temperature, repeats=args.repeats,
                                   probe=probe_rows, time_split=args.split, order=order,
                                   seed=args.seed, cache_size=capacity[task])
                    if family.name == "nemotron" and (lora is not None
                                                      or model.config.lora_rank):
                        summary["lora"] = bool(model.config.lora_rank)  # the adapter is on
                    runs.append(summary)
    out = dict(runs[0]) if len(runs) == 1 else {"model": name, "family": family.name,
                                                 "runs": runs}
    out["figure5"] = figures.time_decomposition(runs)
    if any("lora" in r for r in runs):  # a checkpoint with an adapter, or --lora given
        out["lora_accounting"] = accounting.lora_table(runs)
    out["reproducibility"] = record
    print(report(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if args.plot:
        plot(out, args.plot)
    if args.profile:
        widths = {s: widths[s] or config.block_size for s in schedules}
        profile(first, next(iter(prompt_sets.values()))[0].text, schedules, widths, args.profile)
        print(f"profile written to {args.profile}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
