"""`packed-ss bench`: the paper's measurements for chosen schedules on one task.

Batch size 1, one prompt at a time (optionally several times, keeping the fastest).
Per schedule: tokens (total, mean), decoder wall time, NFE, tokens/NFE, time/NFE,
throughput (total tokens / total wall), the split of wall time into model execution and
non-model decoder work, the accepted-length histogram and task accuracy. Packed-SS is
compared with each baseline by paired bootstrap intervals over prompts (same resampled
indices for every method). Compilation is excluded: every program is compiled before
it is timed (AOT), and each schedule is warmed up on the first prompt. Block sizes are
given, or chosen per schedule by the paper's throughput probe on the first prompts
(App. F.1).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from packed_ss_jax import cli
from packed_ss_jax.cli import Parser, UsageError, run_command

from . import stats, tasks, timing

SCHEDULES = ("ar", "linear", "quadratic", "packed")


def _size(text: str, spec: str) -> int:
    text = text.strip()
    if not text.isdigit() or int(text) < 2:
        raise ValueError(f"--block-size: block sizes must be integers >= 2, got {spec!r}")
    return int(text)


def parse_block_sizes(spec: str | None, schedules) -> dict[str, int | None]:
    """'16' for all, or 'packed=32,linear=32,quadratic=8'; every size an integer >= 2."""
    out = {s: None for s in schedules}
    if not spec:
        return out
    if "=" not in spec:
        size = _size(spec, spec)
        return {s: size for s in schedules}
    for part in filter(None, (x.strip() for x in spec.split(","))):
        name, eq, value = (x.strip() for x in part.partition("="))
        if not eq:
            raise ValueError(f"--block-size: {part!r} is not SCHEDULE=SIZE (in {spec!r})")
        if name not in out:
            raise ValueError(f"--block-size names {name!r}, which is not among --schedules")
        out[name] = _size(value, spec)
    return out


def parse_probe(spec: str) -> list[int]:
    """'4,8,16' -> [4, 8, 16]; every size an integer >= 2."""
    parts = [x.strip() for x in spec.split(",") if x.strip()]
    if not parts or not all(x.isdigit() and int(x) >= 2 for x in parts):
        raise ValueError(f"--probe: block sizes must be integers >= 2, got {spec!r}")
    return list(dict.fromkeys(int(x) for x in parts))


SPLITS = ("null", "doubled")


def run(model, prompts, schedules, block_sizes, *, capacity: int, temperature=0.0, seed=0,
        max_new_tokens=None, repeats=1, split="null", progress=True) -> dict:
    """Per schedule, per prompt: tokens, wall, NFE, model time, correctness.

    With `repeats` > 1 every prompt is decoded that many times by every schedule, in
    turn (so slow drift of the machine hits all schedules alike), and the fastest wall
    time is kept; the outputs of the repeats are identical (same seed). Unless `split`
    is None, each decode is also run with the model replaced (same repeats; see
    `timing`): by one whose forward costs nothing (`split="null"`: that decode's time,
    scaled to the real iteration count, is the non-model work) or by one that does every
    forward pass twice (`split="doubled"`: the extra wall time is the model's).
    """
    import packed_ss_jax as ps

    if not prompts:
        raise ValueError("no prompts to run")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    per = {s: {"tokens": [], "wall_s": [], "nfe": [], "iterations": [], "model_s": [],
               "correct": [], "hist": None} for s in schedules}
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")
    other = timing.Null(model) if split == "null" else timing.Doubled(model)

    def one(s, p, i, m=model):
        B = block_sizes[s] or model.config.block_size
        return ps.decode(m, p.text, schedule=s, block_size=B,
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
    """App. F.1's block-size probe: every speculative schedule whose B is not `fixed`
    decodes the first PROBE_PROMPTS prompts at each size in `sizes` (with the run's cache
    size and repeats, so it times the programs the run will use); the size with the
    highest throughput (tokens / wall) is chosen. Returns ({schedule: B}, table rows)."""
    chosen, rows = dict(fixed), []
    for s in schedules:
        if s == "ar" or fixed.get(s):
            continue
        best = None
        for B in sizes:
            d = run(model, prompts[:PROBE_PROMPTS], [s], {s: B}, split=None,
                    progress=False, **kw)[s]
            tok, wall, nfe = sum(d["tokens"]), sum(d["wall_s"]), sum(d["nfe"])
            rows.append({"schedule": s, "block_size": B, "tokens": tok, "wall_s": wall,
                         "nfe": nfe, "tokens_per_nfe": tok / nfe, "throughput_tok_s": tok / wall})
            if best is None or tok / wall > best[1]:
                best = (B, tok / wall)
            if progress:
                sys.stderr.write(f"probe {s} B={B}: {tok / wall:.1f} tok/s, "
                                 f"{tok / nfe:.2f} tok/NFE\n")
        chosen[s] = best[0]
    return chosen, rows


def probe_markdown(rows: list, chosen: dict) -> str:
    out = [f"block-size probe (first {PROBE_PROMPTS} prompts; App. F.1):",
           "| schedule | B | tokens/NFE | throughput (tok/s) | chosen |", "|---|---|---|---|---|"]
    for r in rows:
        mark = "yes" if chosen.get(r["schedule"]) == r["block_size"] else ""
        out.append(f"| {r['schedule']} | {r['block_size']} | {r['tokens_per_nfe']:.2f} | "
                   f"{r['throughput_tok_s']:.1f} | {mark} |")
    return "\n".join(out)


def cache_size_for(model, prompts, max_new_tokens=None) -> int:
    """One cache size for the whole task: the longest prompt plus its output cap, rounded
    up to a power of two (every call attends over the whole buffer, so size it to the task)."""
    need = 0
    for p in prompts:
        n = len(model.tokenizer.encode(p.text).ids) if model.tokenizer is not None else len(p.text)
        need = max(need, n + (max_new_tokens or p.max_new_tokens))
    size = 64
    while size < need:
        size *= 2
    return size


def summarize(model_name: str, task: str, per: dict, block_sizes, config_block: int,
              resamples: int = stats.RESAMPLES) -> dict:
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be an integer >= 1, got {resamples!r}")
    n = len(next(iter(per.values()))["tokens"])
    results = {}
    for s, d in per.items():
        tokens, wall, nfe = (np.asarray(d[k], float) for k in ("tokens", "wall_s", "nfe"))
        model_s = float(np.sum(d["model_s"]))
        results[s] = {
            "block_size": None if s == "ar" else (block_sizes[s] or config_block),
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
    return {"model": model_name, "task": task, "n_prompts": n, "results": results,
            "paired": paired, "ratios_to_linear": figure3, "bootstrap_resamples": resamples,
            "warmup": "each schedule decoded the first prompt once before timing; "
                      "compilation is ahead of time and never inside wall_s",
            "wall_s_is": "per prompt, the fastest of `repeats` identical decodes",
            "per_prompt": {s: {k: d[k] for k in ("tokens", "wall_s", "nfe")} for s, d in per.items()}}


def markdown(summary: dict) -> str:
    rows = ["| schedule | B | tokens | mean tokens | wall (s) | NFE | tokens/NFE | time/NFE (ms) "
            "| throughput (tok/s) | non-model time | accuracy |",
            "|" + "---|" * 11]
    for s, r in summary["results"].items():
        acc = "-" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}%"
        rows.append(f"| {s} | {r['block_size'] or '-'} | {r['tokens']} | {r['mean_tokens']:.1f} | "
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


def profile(model, prompt, schedules, block_sizes, out_dir: str, max_new: int = 32) -> None:
    """A jax.profiler trace of a few decode iterations per schedule, and each schedule's
    optimised HLO (the whole compiled decode program: first call plus while_loop step)."""
    import jax

    import packed_ss_jax as ps
    from packed_ss_jax import engine

    out = Path(out_dir)
    (out / "hlo").mkdir(parents=True, exist_ok=True)
    for s in schedules:
        ps.decode(model, prompt, schedule=s, block_size=block_sizes[s], max_new_tokens=max_new)
    with jax.profiler.trace(str(out / "trace")):
        for s in schedules:
            with jax.profiler.TraceAnnotation(f"decode {s}"):
                ps.decode(model, prompt, schedule=s, block_size=block_sizes[s],
                          max_new_tokens=max_new)
    for key, exe in engine._compiled.items():
        if not (len(key) == 2 and key[0] == model.key and isinstance(key[1], engine.Program)):
            continue
        program = key[1]
        name = f"{program.schedule}_B{program.block_size}_bucket{program.bucket}.hlo.txt"
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
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--task", default="arithmetic",
                   choices=sorted(tasks.OFFLINE_TASKS) + sorted(tasks.FILE_TASKS),
                   help=f"one of {sorted(tasks.OFFLINE_TASKS) + sorted(tasks.FILE_TASKS)}")
    p.add_argument("--data", help="local task file in its public jsonl format (paper tasks)")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--block-size", help="B for all, or per schedule: packed=32,linear=32,quadratic=8")
    p.add_argument("--probe", metavar="SIZES",
                   help=f"choose each schedule's B as in App. F.1: the highest throughput on the "
                        f"first {PROBE_PROMPTS} prompts among these sizes, e.g. 4,8,16 (with "
                        f"--repeats as set; a size given by --block-size wins)")
    p.add_argument("--repeats", type=cli.int_at_least(1), default=1,
                   help="decode each prompt this many times per schedule and keep the fastest "
                        "wall time (less timing noise; tokens are identical)")
    p.add_argument("--split", choices=SPLITS, default="null",
                   help="how the model / non-model time split is measured: null (a decode whose "
                        "forward computes nothing) or doubled (every forward done twice)")
    p.add_argument("--limit", type=cli.int_at_least(1), default=None,
                   help="first N prompts (offline tasks: 100)")
    p.add_argument("--max-new-tokens", type=cli.int_at_least(1), default=None,
                   help="override the task's output cap")
    p.add_argument("--temperature", type=cli.temperature, default=0.0)
    p.add_argument("--seed", type=cli.seed, default=0,
                   help="prompt i is decoded with seed + i")
    p.add_argument("--resamples", type=cli.int_at_least(1), default=stats.RESAMPLES,
                   help=f"bootstrap resamples (at least 1; default {stats.RESAMPLES})")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write Figure 3 (ratios to Linear-SS) here (PNG)")
    p.add_argument("--profile", help="write a jax.profiler trace and optimised HLO here")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args(argv)

    # Everything that can be checked without the model, before it is loaded.
    schedules = list(dict.fromkeys(s.strip() for s in args.schedules.split(",") if s.strip()))
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad or not schedules:
        p.error(f"--schedules: unknown {bad}; choose from {list(SCHEDULES)}" if bad else
                f"--schedules: none given; choose from {list(SCHEDULES)}")
    try:
        block_sizes = parse_block_sizes(args.block_size, schedules)
        sizes = parse_probe(args.probe) if args.probe else []
    except ValueError as e:
        raise UsageError(str(e)) from None
    if sizes and all(s == "ar" or block_sizes[s] for s in schedules):
        raise UsageError("--probe: every schedule's block size is already fixed by "
                         "--block-size (or only ar is run); nothing to probe")
    if args.data is not None and args.task in tasks.OFFLINE_TASKS:
        raise UsageError(f"--data is for the file tasks {sorted(tasks.FILE_TASKS)}; "
                         f"task {args.task!r} is generated offline")
    if args.json:
        check_output_file(args.json, "--json")
    if args.plot:
        check_output_file(args.plot, "--plot")
        check_plot(args.plot, schedules)
    if args.profile:
        check_output_dir(args.profile, "--profile")
    check_distinct({"--json": args.json, "--plot": args.plot, "--profile": args.profile})
    prompts = tasks.load(args.task, args.data, args.limit)
    if args.seed + len(prompts) - 1 >= 2**32:
        raise UsageError(f"--seed {args.seed}: prompt i is decoded with seed + i, which must "
                         f"stay below 2**32 for all {len(prompts)} prompts")
    if args.resamples * len(prompts) > MAX_BOOTSTRAP_ENTRIES:
        raise UsageError(f"--resamples {args.resamples} x {len(prompts)} prompts is more "
                         f"bootstrap indices than fit in memory (at most "
                         f"{MAX_BOOTSTRAP_ENTRIES:,})")

    import packed_ss_jax as ps

    model = ps.load(args.model, dtype=args.dtype) if args.model else ps.load(dtype=args.dtype)
    if model.config.family != "nemotron":
        raise UsageError(f"bench decodes with block sizes (Nemotron-Labs-Diffusion); "
                         f"{args.model} is a {model.config.family} checkpoint")
    capacity = cache_size_for(model, prompts, args.max_new_tokens)
    # Checked before anything is compiled: every block (and probed size) fits the cache.
    fixed = {s: block_sizes[s] or model.config.block_size for s in schedules
             if s != "ar" and not (sizes and not block_sizes[s])}  # probed ones: below
    used = {f"{s} B={B}": B for s, B in fixed.items()}
    used.update({f"--probe {B}": B for B in sizes})
    too_big = [name for name, B in used.items() if B > capacity]
    if too_big:
        raise UsageError(f"block sizes larger than the task's cache ({capacity} slots): "
                         f"{', '.join(too_big)}")
    name = args.model or "embedded"
    print(f"{name}: {len(prompts)} {args.task} prompts, schedules {schedules}, "
          f"temperature {args.temperature}", file=sys.stderr)
    kw = dict(temperature=args.temperature, seed=args.seed, max_new_tokens=args.max_new_tokens,
              repeats=args.repeats, capacity=capacity)
    probe_rows = []
    if sizes:
        block_sizes, probe_rows = probe(model, prompts, schedules, sizes, block_sizes, **kw)
        print(probe_markdown(probe_rows, block_sizes) + "\n")
    per = run(model, prompts, schedules, block_sizes, split=args.split, **kw)
    summary = summarize(name, args.task, per, block_sizes, model.config.block_size, args.resamples)
    summary.update(temperature=args.temperature, repeats=args.repeats, probe=probe_rows,
                   time_split=args.split)
    print(markdown(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    if args.plot:
        plot(summary, args.plot)
    if args.profile:
        profile(model, prompts[0].text, schedules,
                {s: block_sizes[s] or model.config.block_size for s in schedules}, args.profile)
        print(f"profile written to {args.profile}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
