"""`packed-ss bench`: the paper's measurements for chosen schedules on one task.

Batch size 1, one prompt at a time, as the paper measures: every program is compiled
before it is timed and each schedule is warmed up on the first prompt; Packed-SS is
compared with each baseline by paired bootstrap intervals over prompts. One invocation
can sweep widths, orders, the draft-only adapter and tasks, each combination a run.
What is measured, the flags and the saved JSON: docs/benchmarks.md.

This module is the command: `plan` parses and checks the command line, `measure`
decodes and times, `report` summarises, prints and plots.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..arguments import distributed, load_model, run_command
from . import plan as plan_lib, provenance, stats
from .measure import cache_size_for, chat_prompts, probe, profile, run
from .plan import Plan
from .report import plot, replot, report, results, summarize

# The names callers reach through this module besides `main`: the decode that `run`
# calls (`harness.api.decode`), the run's constants and helpers, the width parser and
# the run's table. `main` looks up `run`, `load_model` and `distributed` here, so a
# caller may replace them.
from .. import api  # noqa: F401
from .measure import (BATCHING, CHAT_TEMPLATE_KWARGS, PROBE_PROMPTS, SPLITS,  # noqa: F401
                      batches, sample_seed)
from .plan import parse_widths  # noqa: F401
from .report import markdown  # noqa: F401


def main(argv: list[str] | None = None, prog: str = "packed-ss bench") -> int:
    """`packed-ss bench`; every argument is checked before the model is loaded or anything
    is compiled, so a careless command line fails at once, not after the run."""
    return run_command(prog, _main, argv)


def _main(argv: list[str] | None, prog: str) -> int:
    args = plan_lib.parser(prog, __doc__.split("\n\n")[0]).parse_args(argv)
    if args.replot is not None:
        return replot(args.replot, args.plot)
    p = plan_lib.plan(args)
    # The provenance record lists the devices, which starts JAX: a multi-host run must
    # join its processes first.
    distributed(args)
    record = _record(argv, args, p)
    runs, first, prompt_sets = _run_all(args, p)
    out = results(runs, args.model or "embedded", p.family.name, record)
    print(report(out))
    if args.json:
        plan_lib.make_parent(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if args.plot:
        plot(out, args.plot)
    if args.profile:
        widths = {s: p.width_sets[0][s] or p.config.block_size for s in p.schedules}
        profile(first, next(iter(prompt_sets.values()))[0].text, p.schedules, widths,
                args.profile)
        print(f"profile written to {args.profile}", file=sys.stderr)
    return 0


def _record(argv, args, p: Plan) -> dict:
    """The reproducibility record: versions, device, model checksum, flags, files, seeds."""
    tokenizer = args.tokenizer
    if tokenizer is not None and Path(tokenizer).is_dir():  # the file that is read
        tokenizer = str(Path(tokenizer) / "tokenizer.json")
    record = provenance.record(argv if argv is not None else sys.argv[1:], vars(args),
                               args.model or "nld-tiny", p.model_dir,
                               {"base_config": args.base_config, "tokenizer": tokenizer,
                                **{f"data {t}": path for t, path in p.data.items()}})
    record["seeds"] = {"seed": args.seed, "decode": "seed + prompt * samples + sample",
                       "bootstrap": stats.BOOTSTRAP_SEED}
    return record


def _run_all(args, p: Plan) -> tuple[list[dict], object, dict]:
    """Every run: per adapter setting (a model each), task, width setting and order.
    Returns the runs' summaries, the first model and the prompts (chat-rendered with
    --chat)."""
    runs, first, prompt_sets = [], None, p.prompt_sets
    for lora in p.loras:
        model = load_model(args, lora=lora)
        if args.chat and first is None:  # the rendering needs the tokenizer
            prompt_sets = {t: chat_prompts(model, ps, t) for t, ps in prompt_sets.items()}
        capacity = {t: cache_size_for(model, ps, args.max_new_tokens)
                    for t, ps in prompt_sets.items()}
        if first is None:
            first = model
            plan_lib.check_widths_fit(p, min(capacity.values()))
        for task, prompts in prompt_sets.items():
            for ws in p.width_sets:
                for order in p.orders:
                    runs.append(_one_run(args, p, model, task, prompts, ws, order,
                                         capacity[task], lora))
    return runs, first, prompt_sets


def _one_run(args, p: Plan, model, task: str, prompts, ws: dict, order: str, capacity: int,
             lora) -> dict:
    """One run's summary: the widths probed (with --probe), every schedule measured."""
    # Orderless schedules (the reference, native) decode the same in every order: they
    # run with the first order only.
    schedules = p.schedules if order == p.orders[0] else \
        [s for s in p.schedules if s not in p.family.orderless]
    print(f"{args.model or 'embedded'}: {len(prompts)} {task} prompts"
          + (f" x {args.samples} samples" if args.samples > 1 else "")
          + f", schedules {schedules}, order {order}, temperature {args.temperature}"
          + ("" if lora is None else f", adapter {'on' if lora else 'off'}"), file=sys.stderr)
    kw = dict(temperature=args.temperature, seed=args.seed, max_new_tokens=args.max_new_tokens,
              repeats=args.repeats, capacity=capacity, order=order, samples=args.samples,
              batch_size=args.batch_size, batching=args.batching)
    widths, probe_rows = {s: ws[s] for s in schedules}, []
    if p.sizes:
        widths, probe_rows = probe(model, prompts, schedules, p.sizes, widths, **kw)
    per = run(model, prompts, schedules, widths, split=args.split, **kw)
    summary = summarize(args.model or "embedded", task, per, widths, p.config.block_size,
                        args.resamples, family=p.family.name, samples=args.samples,
                        batch_size=args.batch_size, mesh=args.mesh, batching=args.batching)
    summary.update(temperature=args.temperature, repeats=args.repeats, probe=probe_rows,
                   time_split=args.split, order=order, seed=args.seed, cache_size=capacity)
    if p.family.name == "nemotron" and (lora is not None or model.config.lora_rank):
        summary["lora"] = bool(model.config.lora_rank)  # the adapter is on
    return summary


if __name__ == "__main__":
    sys.exit(main())
