"""The bench's command line and its plan: the parser, and every check that needs no
weights, made before the model is loaded or anything is compiled, so that a careless
command line fails at once, not after the run.

`plan(args)` turns the parsed arguments into a `Plan`: the tasks and their prompts, the
family and its schedules, the width settings of a sweep (or the sizes to probe), the
verification orders and the adapter settings.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from .. import families
from ..arguments import (Parser, UsageError, int_at_least, model_args, seed as seed_arg,
                         temperature as temperature_arg)
from . import figures, stats, tasks
from .measure import BATCHING, PROBE_PROMPTS, SPLITS

LORA_SETTINGS = {"on": True, "off": False}
MAX_BOOTSTRAP_ENTRIES = 200_000_000  # resamples x prompts indices (8 bytes each) in memory


def all_tasks() -> list[str]:
    return sorted(tasks.OFFLINE_TASKS) + sorted(tasks.FILE_TASKS)


def parser(prog: str, description: str) -> Parser:
    """`packed-ss bench`'s arguments: the model's, then the task, the schedules and their
    widths, the decoding and timing, and the outputs."""
    p = Parser(prog=prog, description=description)
    model_args(p)
    _task_args(p)
    _schedule_args(p)
    _decoding_args(p)
    _output_args(p)
    return p


def _task_args(p: Parser) -> None:
    p.add_argument("--task", default="arithmetic",
                   help=f"one of {all_tasks()}, or several comma-separated (Figure 5 averages "
                        f"the time split over them)")
    p.add_argument("--data", help="local task file in its public jsonl format (paper tasks); "
                                  "with several file tasks TASK=PATH,TASK=PATH")
    p.add_argument("--chat", action="store_true",
                   help="render each prompt as a user message through the checkpoint's chat "
                        "template (WritingBench: enable_thinking=False; SetDLM GSM8K: "
                        "enable_thinking=True, as in the paper)")


def _schedule_args(p: Parser) -> None:
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


def _decoding_args(p: Parser) -> None:
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


def _output_args(p: Parser) -> None:
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write Figures 3/4 (ratios to Linear-SS, accuracy "
                                  "difference) and 5 (time split) here (PNG)")
    p.add_argument("--replot", metavar="RESULTS_JSON",
                   help="draw --plot from a saved --json run, without decoding")
    p.add_argument("--profile", help="write a jax.profiler trace and optimised HLO here")


@dataclasses.dataclass
class Plan:
    """A bench invocation, checked: every run is (adapter, task, widths, order)."""

    task_names: list[str]
    data: dict[str, str | None]     # a file task's file
    config: Any                     # the model's config (read, not the weights)
    family: Any
    schedules: list[str]
    flag: str                       # the family's width flag: --block-size or --window
    orders: list[str]
    loras: list[bool | None]        # None: the checkpoint as it is
    width_sets: list[dict]          # one {schedule: width or None} per run of a sweep
    sizes: list[int]                # --probe's sizes
    prompt_sets: dict[str, list]    # task -> prompts
    model_dir: Any


def plan(args) -> Plan:
    """Everything that can be checked without the model's weights, before they are read:
    the command line, the output paths, the task, and the config (for the family)."""
    task_names = parse_names(args.task, "--task", all_tasks())
    data = parse_data(args.data, task_names)
    _check_outputs(args)
    if args.samples > 1 and args.temperature == 0:
        raise UsageError(f"--samples {args.samples}: greedy decoding (--temperature 0) gives "
                         f"the same response every time; sample with --temperature > 0")
    from .. import loading

    config = loading.read_config(args.model, dtype=args.dtype, base_config=args.base_config)
    family = families.of(config)
    schedules = _schedules(args, family)
    flag = _width_flag(args, family)
    orders, loras = _orders(args, family), _loras(args, family)
    _check_sampled(args, family, schedules, orders)
    if args.plot:
        check_plot(args.plot, schedules)
    width_sets, sizes = _widths(args, family, schedules, flag)
    prompt_sets = {t: tasks.load(t, data[t], args.limit) for t in task_names}
    _check_prompt_counts(args, prompt_sets)
    return Plan(task_names, data, config, family, schedules, flag, orders, loras, width_sets,
                sizes, prompt_sets, loading.resolve(args.model))


def _check_outputs(args) -> None:
    for flag in ("--json", "--plot"):
        if getattr(args, flag[2:]):
            check_output_file(getattr(args, flag[2:]), flag)
    if args.profile:
        check_output_dir(args.profile, "--profile")
    check_distinct({"--json": args.json, "--plot": args.plot, "--profile": args.profile})


def _schedules(args, family) -> list[str]:
    names = family.schedules if args.schedules is None else \
        [s.strip() for s in args.schedules.split(",") if s.strip()]
    schedules = list(dict.fromkeys(names))
    bad = [s for s in schedules if s not in family.schedules]
    if bad or not schedules:
        raise UsageError(f"--schedules: {'unknown ' + str(bad) if bad else 'none given'}; "
                         f"{family.title} models decode with {list(family.schedules)}")
    return schedules


def _width_flag(args, family) -> str:
    """The family's width flag; the other family's, given, is refused."""
    flag = "--" + family.width_name.replace("_", "-")
    other = [f for f in ("--block-size", "--window")
             if f != flag and getattr(args, f[2:].replace("-", "_"))]
    if other:
        raise UsageError(f"{other[0]} is for other model families; this {family.title} model "
                         f"takes {flag}")
    return flag


def _orders(args, family) -> list[str]:
    if args.order is None:
        return [family.orders[0]]
    try:
        return parse_names(args.order, "--order", family.orders)
    except UsageError:
        raise UsageError(f"--order {args.order}: {family.title} models verify in order "
                         f"{', '.join(family.orders)}") from None


def _loras(args, family) -> list[bool | None]:
    if args.lora is None:
        return [None]
    if family.name != "nemotron":
        raise UsageError(f"--lora: {family.title} checkpoints have no draft-only adapter")
    return [LORA_SETTINGS[x] for x in parse_names(args.lora, "--lora", LORA_SETTINGS)]


def _check_sampled(args, family, schedules, orders) -> None:
    """Sampling (--temperature > 0) only with the family's sampled schedules and order."""
    if args.temperature > 0:
        greedy_only = [s for s in schedules if s not in family.sampled] + \
            [o for o in orders if o != family.orders[0]]
        if greedy_only:
            raise UsageError(f"{family.title} models sample (--temperature > 0) with "
                             f"{list(family.sampled)} in {family.orders[0]} order only; drop "
                             f"{greedy_only}")


def _widths(args, family, schedules, flag) -> tuple[list[dict], list[int]]:
    """The width settings (one per run of a sweep) and --probe's sizes."""
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
    return width_sets, sizes


def _check_prompt_counts(args, prompt_sets: dict) -> None:
    """The seeds and the bootstrap indices that the largest task needs must fit."""
    most = max(len(v) for v in prompt_sets.values())
    if args.seed + most * args.samples - 1 >= 2**32:
        raise UsageError(f"--seed {args.seed}: sample j of prompt i is decoded with seed + i * "
                         f"samples + j, which must stay below 2**32 for all {most} prompts "
                         f"x {args.samples} samples")
    if args.resamples * most > MAX_BOOTSTRAP_ENTRIES:
        raise UsageError(f"--resamples {args.resamples} x {most} prompts is more "
                         f"bootstrap indices than fit in memory (at most "
                         f"{MAX_BOOTSTRAP_ENTRIES:,})")


def check_widths_fit(p: Plan, room: int) -> None:
    """Every width (and probed size) fits the task's cache of `room` positions; checked once
    the first model is loaded (the prompts' lengths need its tokenizer), before anything
    is compiled."""
    used = {}
    for ws in p.width_sets:
        used.update({f"{s} {p.flag}={ws[s] or p.config.block_size}": ws[s] or p.config.block_size
                     for s in p.schedules if s != p.family.reference
                     and not (p.sizes and not ws[s])})
    used.update({f"--probe {B}": B for B in p.sizes})
    too_big = [n for n, B in used.items() if B > room]
    if too_big:
        raise UsageError(f"widths larger than the task's cache ({room} positions): "
                         f"{', '.join(too_big)}")


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


def parse_width_sweep(spec: str | None, schedules, flag: str, minimum: int) -> list[dict]:
    """'8' or 'packed=32,linear=8': one width setting; '8,16' (sizes only): one setting per
    size, each for every schedule (a sweep, e.g. Tables 8-10's W = 8 and 16)."""
    if spec and "=" not in spec and "," in spec:
        sizes = [_size(x, spec, flag, minimum) for x in spec.split(",") if x.strip()]
        if not sizes:
            raise ValueError(f"{flag}: no sizes in {spec!r}")
        return [{s: B for s in schedules} for B in dict.fromkeys(sizes)]
    return [parse_widths(spec, schedules, flag, minimum)]


def parse_probe(spec: str, minimum: int = 2) -> list[int]:
    """'4,8,16' -> [4, 8, 16]; every size an integer >= minimum."""
    parts = [x.strip() for x in spec.split(",") if x.strip()]
    if not parts or not all(x.isdigit() and int(x) >= minimum for x in parts):
        raise ValueError(f"--probe: sizes must be integers >= {minimum}, got {spec!r}")
    return list(dict.fromkeys(int(x) for x in parts))


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


def check_output_file(path: str, flag: str) -> None:
    """Refuses an output file that could not be written, before the run (creates nothing;
    its missing folders are made when it is written: `make_parent`)."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file name")
    existing = p.parent
    while not existing.exists():  # the folders that make_parent would create
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")


def make_parent(path: str) -> Path:
    """`path`, its folder made if missing (an output file checked by check_output_file)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


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
