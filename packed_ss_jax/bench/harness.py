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
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from .. import api, engine, families
from ..arguments import (Parser, UsageError, int_at_least, load_model, model_args, run_command,
                         seed as seed_arg, temperature as temperature_arg)
from . import stats, tasks, timing


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


def run(model, prompts, schedules, widths, *, capacity: int, temperature=0.0, seed=0,
        max_new_tokens=None, repeats=1, split="null", order="ltr", progress=True) -> dict:
    """Per schedule, per prompt: tokens, wall, NFE, model time, correctness.

    With `repeats` > 1 every prompt is decoded that many times by every schedule, in
    turn (so slow drift of the machine hits all schedules alike), and the fastest wall
    time is kept; the outputs of the repeats are identical (same seed). Unless `split`
    is None, each decode is also run with the model replaced (same repeats; see
    `timing`): by one whose forward costs nothing (`split="null"`: that decode's time,
    scaled to the real iteration count, is the non-model work) or by one that does every
    forward pass twice (`split="doubled"`: the extra wall time is the model's).
    """
    if not prompts:
        raise ValueError("no prompts to run")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    per = {s: {"tokens": [], "wall_s": [], "nfe": [], "iterations": [], "model_s": [],
               "correct": [], "hist": None} for s in schedules}
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")
    other = timing.Null(model) if split == "null" else timing.Doubled(model)

    family = families.of(model.config)

    def one(s, p, i, m=model):
        width = widths[s] or model.config.block_size
        return api.decode(m, p.text if p.ids is None else p.ids, schedule=s, **{family.width_name: width},
                         order=family.orders[0] if s in family.orderless else order,
                         max_new_tokens=max_new_tokens or p.max_new_tokens,
                         eos_id=-1 if p.stop_at_eos else None, temperature=temperature,
                         seed=seed + i, cache_size=capacity)

    for s in schedules:  # warm-up: compile, and run once, outside the measurements
        one(s, prompts[0], 0)
        if split:
            one(s, prompts[0], 0, other)
    t0 = time.monotonic()
    for i, p in enumerate(prompts):
        runs = {s: [] for s in schedules}
        replaced = {s: [] for s in schedules}
        for _ in range(repeats):
            for s in schedules:
                runs[s].append(one(s, p, i))
                if split:
                    replaced[s].append(one(s, p, i, other))
        for s in schedules:
            r = min(runs[s], key=lambda x: x.wall_s)
            d = per[s]
            d["tokens"].append(len(r.tokens))
            d["wall_s"].append(r.wall_s)
            d["nfe"].append(r.nfe)
            d["iterations"].append(r.iterations)
            d["hist"] = r.accept_hist if d["hist"] is None else d["hist"] + r.accept_hist
            if split:
                o = min(replaced[s], key=lambda x: x.wall_s)
                if split == "null":
                    non_model = o.wall_s * (r.iterations + 1) / (o.iterations + 1)
                    d["model_s"].append(r.wall_s - non_model)
                else:
                    d["model_s"].append(o.wall_s - r.wall_s)
            if p.score is not None:
                d["correct"].append(bool(p.score(r.text if r.text is not None else "")))
        if progress:
            sys.stderr.write(f"\rprompts {i + 1}/{len(prompts)} ({time.monotonic() - t0:.0f}s)")
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
            rows.append({"schedule": s, "width": B, "tokens": tok, "wall_s": wall,
                         "nfe": nfe, "tokens_per_nfe": tok / nfe, "throughput_tok_s": tok / wall})
            if best is None or tok / wall > best[1]:
                best = (B, tok / wall)
            if progress:
                sys.stderr.write(f"probe {s} {B}: {tok / wall:.1f} tok/s, "
                                 f"{tok / nfe:.2f} tok/NFE\n")
        chosen[s] = best[0]
    return chosen, rows


def probe_markdown(rows: list, chosen: dict, width_label: str = "B") -> str:
    out = [f"block-size probe (first {PROBE_PROMPTS} prompts; App. F.1):",
           f"| schedule | {width_label} | tokens/NFE | throughput (tok/s) | chosen |",
           "|---|---|---|---|---|"]
    for r in rows:
        mark = "yes" if chosen.get(r["schedule"]) == r["width"] else ""
        out.append(f"| {r['schedule']} | {r['width']} | {r['tokens_per_nfe']:.2f} | "
                   f"{r['throughput_tok_s']:.1f} | {mark} |")
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
              resamples: int = stats.RESAMPLES, family: str = "nemotron") -> dict:
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be an integer >= 1, got {resamples!r}")
    n = len(next(iter(per.values()))["tokens"])
    fam = families.FAMILIES[family]
    results = {}
    for s, d in per.items():
        tokens, wall, nfe = (np.asarray(d[k], float) for k in ("tokens", "wall_s", "nfe"))
        model_s = float(np.sum(d["model_s"]))
        results[s] = {
            fam.width_name: None if s == fam.reference else (widths[s] or config_width),
            "tokens": int(tokens.sum()), "mean_tokens": float(tokens.mean()),
            "wall_s": float(wall.sum()), "nfe": int(nfe.sum()),
            "tokens_per_nfe": float(tokens.sum() / nfe.sum()),
            "time_per_nfe_ms": float(1e3 * wall.sum() / nfe.sum()),
            "throughput_tok_s": float(tokens.sum() / wall.sum()),
            "model_time_s": model_s,
            "non_model_time_s": float(wall.sum() - model_s),
            "non_model_fraction": float(1 - model_s / wall.sum()),
            "accept_hist": [int(x) for x in d["hist"]],
            "accuracy": float(np.mean(d["correct"])) if d["correct"] else None,
        }
    idx = stats.resample_indices(n, resamples)
    paired, figure3 = {}, {}
    if "packed" in per:
        for s in per:
            if s != "packed":
                paired[f"packed_vs_{s}"] = stats.paired(per["packed"], per[s], idx)
    if "linear" in per:
        figure3 = {s: stats.ratio_to(per[s], per["linear"], idx) for s in per}
    return {"model": model_name, "family": family, "width_name": fam.width_name, "task": task,
            "n_prompts": n, "results": results,
            "paired": paired, "ratios_to_linear": figure3, "bootstrap_resamples": resamples,
            "warmup": "each schedule decoded the first prompt once before timing; "
                      "compilation is ahead of time and never inside wall_s",
            "wall_s_is": "per prompt, the fastest of `repeats` identical decodes",
            "per_prompt": {s: {k: d[k] for k in ("tokens", "wall_s", "nfe")} for s, d in per.items()}}


def markdown(summary: dict) -> str:
    family = families.FAMILIES[summary.get("family", "nemotron")]
    width_name, label = family.width_name, family.width_symbol
    rows = [f"| schedule | {label} | tokens | mean tokens | wall (s) | NFE | tokens/NFE "
            "| time/NFE (ms) | throughput (tok/s) | non-model time | accuracy |",
            "|" + "---|" * 11]
    for s, r in summary["results"].items():
        acc = "-" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}%"
        rows.append(f"| {s} | {r[width_name] or '-'} | {r['tokens']} | {r['mean_tokens']:.1f} | "
                    f"{r['wall_s']:.2f} | {r['nfe']} | {r['tokens_per_nfe']:.2f} | "
                    f"{r['time_per_nfe_ms']:.2f} | {r['throughput_tok_s']:.1f} | "
                    f"{100 * r['non_model_fraction']:.1f}% | {acc} |")
    if summary["paired"]:
        rows += ["", "| Packed-SS vs | throughput ratio [95% CI] | wall diff per prompt (s) [95% CI] |",
                 "|---|---|---|"]
        for name, p in summary["paired"].items():
            lo, hi = p["throughput_ratio_ci95"]
            dlo, dhi = p["wall_diff_ci95"]
            rows.append(f"| {name.removeprefix('packed_vs_')} | {p['throughput_ratio']:.3f} "
                        f"[{lo:.3f}, {hi:.3f}] | {p['wall_diff_s']:+.4f} [{dlo:+.4f}, {dhi:+.4f}] |")
    hist = ["", "accepted tokens per iteration (histogram, index = tokens):"]
    for s, r in summary["results"].items():
        hist.append(f"  {s}: {r['accept_hist']}")
    return "\n".join(rows + hist)


def check_plot(path: str, schedules) -> None:
    """What --plot needs, checked before the run: Linear-SS (the ratios' baseline),
    matplotlib, and an image format it writes."""
    if "linear" not in schedules:
        raise UsageError("--plot needs linear among --schedules (ratios are to Linear-SS)")
    try:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
    ext = Path(path).suffix.lstrip(".").lower()
    formats = Figure().canvas.get_supported_filetypes()
    if ext and ext not in formats:
        raise UsageError(f"--plot {path}: matplotlib cannot write {ext!r} files; use one of "
                         f"{sorted(formats)}")


def plot(summary: dict, path: str) -> None:
    """Figure 3: throughput, tokens/NFE and time/NFE as ratios to Linear-SS, 95% error bars."""
    check_plot(path, list(summary["results"]))
    import matplotlib.pyplot as plt

    ratios = summary["ratios_to_linear"]
    names = list(ratios)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, (metric, title) in zip(axes, [("throughput", "throughput"),
                                          ("tokens_per_nfe", "tokens / NFE"),
                                          ("time_per_nfe", "time / NFE")]):
        vals = [ratios[s][metric]["ratio"] for s in names]
        lo = [v - ratios[s][metric]["ci95"][0] for s, v in zip(names, vals)]
        hi = [ratios[s][metric]["ci95"][1] - v for s, v in zip(names, vals)]
        ax.bar(names, vals, yerr=[lo, hi], capsize=4,
               color=["#888" if s != "packed" else "#c44" for s in names])
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_title(f"{title} (ratio to Linear-SS)")
    fig.suptitle(f"{summary['model']} · {summary['task']} · n={summary['n_prompts']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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


def _main(argv: list[str] | None, prog: str) -> int:
    p = Parser(prog=prog, description=__doc__.split("\n\n")[0])
    model_args(p)
    p.add_argument("--task", default="arithmetic",
                   choices=sorted(tasks.OFFLINE_TASKS) + sorted(tasks.FILE_TASKS),
                   help=f"one of {sorted(tasks.OFFLINE_TASKS) + sorted(tasks.FILE_TASKS)}")
    p.add_argument("--data", help="local task file in its public jsonl format (paper tasks)")
    p.add_argument("--chat", action="store_true",
                   help="render each prompt as a user message through the checkpoint's chat "
                        "template (WritingBench: enable_thinking=False; SetDLM GSM8K: "
                        "enable_thinking=True, as in the paper)")
    p.add_argument("--schedules", default=None,
                   help="comma-separated (default: every schedule of the model's family)")
    p.add_argument("--block-size", help="Nemotron-Labs-Diffusion: B for all, or per schedule: "
                                        "packed=32,linear=32,quadratic=8")
    p.add_argument("--window", help="SetDLM: W for all, or per schedule: packed=8,linear=8")
    p.add_argument("--order", default=None,
                   help="SetDLM: verification order of the speculative schedules, ltr "
                        "(default) or confidence")
    p.add_argument("--probe", metavar="SIZES",
                   help=f"choose each schedule's width as in App. F.1: the highest throughput "
                        f"on the first {PROBE_PROMPTS} prompts among these sizes, e.g. 4,8,16 "
                        f"(with --repeats as set; a size given by --block-size/--window wins)")
    p.add_argument("--repeats", type=int_at_least(1), default=1,
                   help="decode each prompt this many times per schedule and keep the fastest "
                        "wall time (less timing noise; tokens are identical)")
    p.add_argument("--split", choices=SPLITS, default="null",
                   help="how the model / non-model time split is measured: null (a decode whose "
                        "forward computes nothing) or doubled (every forward done twice)")
    p.add_argument("--limit", type=int_at_least(1), default=None,
                   help="first N prompts (offline tasks: 100)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=None,
                   help="override the task's output cap")
    p.add_argument("--temperature", type=temperature_arg, default=0.0)
    p.add_argument("--seed", type=seed_arg, default=0,
                   help="prompt i is decoded with seed + i")
    p.add_argument("--resamples", type=int_at_least(1), default=stats.RESAMPLES,
                   help=f"bootstrap resamples (at least 1; default {stats.RESAMPLES})")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write Figure 3 (ratios to Linear-SS) here (PNG)")
    p.add_argument("--profile", help="write a jax.profiler trace and optimised HLO here")
    args = p.parse_args(argv)

    # Everything that can be checked without the model's weights, before they are read:
    # the command line, the output paths, the task, and the config (for the family).
    if args.data is not None and args.task in tasks.OFFLINE_TASKS:
        raise UsageError(f"--data is for the file tasks {sorted(tasks.FILE_TASKS)}; "
                         f"task {args.task!r} is generated offline")
    for flag in ("--json", "--plot"):
        if getattr(args, flag[2:]):
            check_output_file(getattr(args, flag[2:]), flag)
    if args.profile:
        check_output_dir(args.profile, "--profile")
    check_distinct({"--json": args.json, "--plot": args.plot, "--profile": args.profile})
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
    if args.order is not None and args.order not in family.orders:
        raise UsageError(f"--order {args.order}: {family.title} models verify in order "
                         f"{', '.join(family.orders)}")
    if args.plot:
        check_plot(args.plot, schedules)
    try:
        widths = parse_widths(getattr(args, family.width_name), schedules, flag, family.min_width)
        sizes = parse_probe(args.probe, family.min_width) if args.probe else []
    except ValueError as e:
        raise UsageError(str(e)) from None
    if sizes and all(s == family.reference or widths[s] for s in schedules):
        raise UsageError(f"--probe: every schedule's width is already fixed by {flag} (or only "
                         f"{family.reference} is run); nothing to probe")
    prompts = tasks.load(args.task, args.data, args.limit)
    if args.seed + len(prompts) - 1 >= 2**32:
        raise UsageError(f"--seed {args.seed}: prompt i is decoded with seed + i, which must "
                         f"stay below 2**32 for all {len(prompts)} prompts")
    if args.resamples * len(prompts) > MAX_BOOTSTRAP_ENTRIES:
        raise UsageError(f"--resamples {args.resamples} x {len(prompts)} prompts is more "
                         f"bootstrap indices than fit in memory (at most "
                         f"{MAX_BOOTSTRAP_ENTRIES:,})")

    model = load_model(args)
    if args.chat:
        prompts = chat_prompts(model, prompts, args.task)
    capacity = cache_size_for(model, prompts, args.max_new_tokens)
    # Checked before anything is compiled: every width (and probed size) fits the cache.
    fixed = {s: widths[s] or config.block_size for s in schedules
             if s != family.reference and not (sizes and not widths[s])}  # probed: below
    used = {f"{s} {flag}={B}": B for s, B in fixed.items()}
    used.update({f"--probe {B}": B for B in sizes})
    too_big = [name for name, B in used.items() if B > capacity]
    if too_big:
        raise UsageError(f"widths larger than the task's cache ({capacity} slots): "
                         f"{', '.join(too_big)}")
    name = args.model or "embedded"
    order = args.order or family.orders[0]
    print(f"{name}: {len(prompts)} {args.task} prompts, schedules {schedules}, "
          f"temperature {args.temperature}", file=sys.stderr)
    kw = dict(temperature=args.temperature, seed=args.seed, max_new_tokens=args.max_new_tokens,
              repeats=args.repeats, capacity=capacity, order=order)
    probe_rows = []
    label = family.width_symbol
    if sizes:
        widths, probe_rows = probe(model, prompts, schedules, sizes, widths, **kw)
        print(probe_markdown(probe_rows, widths, label) + "\n")
    per = run(model, prompts, schedules, widths, split=args.split, **kw)
    summary = summarize(name, args.task, per, widths, config.block_size, args.resamples,
                        family=family.name)
    summary.update(temperature=args.temperature, repeats=args.repeats, probe=probe_rows,
                   time_split=args.split, order=order)
    print(markdown(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    if args.plot:
        plot(summary, args.plot)
    if args.profile:
        profile(model, prompts[0].text, schedules,
                {s: widths[s] or config.block_size for s in schedules}, args.profile)
        print(f"profile written to {args.profile}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
