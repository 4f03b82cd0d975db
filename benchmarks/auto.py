"""`schedule="auto"` against every fixed candidate it chooses from, on this device: for
each embedded model, at batch 1 (prompts decoded one at a time) and batch 8 (prompts
decoded eight per call), tokens per second of every candidate (schedule, width, k) and
of `auto`, over `--rounds` rounds, the median round reported. Within a round the
settings take turns call by call: each call's prompts are decoded by every setting, in
an order that rotates from call to call; `auto` against the best fixed candidate is the
median of their ratios round by round (and, beside it, the ratio of their medians). Every output is checked against
the reference schedule's (greedy: token for token).

`auto` is calibrated first, on a quiet machine, in an empty folder (the cost model's
forwards, then each candidate decoding `--calibration` held-out prompts of the task,
drawn apart from the measured ones); its calibration time is reported, and so are the
choices it made. Each `--load` then measures every setting again: "quiet", and "loaded"
with a CPU-bound process beside it (started and stopped here), which the calibration
never saw: `auto` must learn it from its own decodes. For every decode through `auto`
its predicted tokens/s is kept beside what it made, so that the table shows how close
the predictions come after the first 20 requests.

    python -m benchmarks.auto --json benchmarks/results/auto_cpu.json
    python -m benchmarks.auto --models nld-tiny --width 4 --schedules packed --prompts 2 \
        --calibration 2 --rounds 1 --max-new-tokens 8 --batches 2   # a check
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import packed_ss_jax as ps
from packed_ss_jax.arguments import int_at_least, ints_at_least
from packed_ss_jax.engine import Engine
from packed_ss_jax.planner import Planner, default_candidates
from packed_ss_jax.training import corpus

AUTO = "auto"
LOADS = ("quiet", "loaded")
LEARNED = 20   # requests after which auto's predictions are compared with what it made


def _arguments(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.auto",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="nld-tiny,setdlm-tiny")
    p.add_argument("--batches", type=ints_at_least(1), default="1,8")
    p.add_argument("--prompts", type=int_at_least(1), default=16,
                   help="held-out arithmetic prompts measured")
    p.add_argument("--calibration", type=int_at_least(1), default=8,
                   help="held-out arithmetic prompts (another seed) auto calibrates on")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=128)
    p.add_argument("--rounds", type=int_at_least(1), default=3)
    p.add_argument("--width", type=int_at_least(1), default=None,
                   help="only the candidates of this width (B or W; default: every one)")
    p.add_argument("--schedules", default=None,
                   help="only the candidates of these schedules, comma-separated (the "
                        "reference always; default: every one)")
    p.add_argument("--load", default="quiet,loaded",
                   help="quiet: nothing beside the benchmark; loaded: a CPU-bound process "
                        "beside it (default both, in that order)")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def _decode(model, group, options: dict, max_new: int, predictions=None):
    """One call: the prompts of `group` decoded at once (one alone: a plain decode).
    Returns (results, decoder seconds). `predictions`: a list that gets the call's
    predicted and observed tokens/s (auto)."""
    out = ps.decode(model, group if len(group) > 1 else group[0],
                    options=ps.DecodeOptions(max_new_tokens=max_new, **options))
    out = out if len(group) > 1 else [out]
    if predictions is not None and out[0].wall_s > 0 and any(r.tokens for r in out):
        predictions.append({"label": out[0].auto["label"], "requests": len(out),
                            "explored": out[0].auto["explored"],
                            "predicted": out[0].auto["predicted_tokens_per_s"],
                            "observed": sum(len(r.tokens) for r in out) / out[0].wall_s})
    return out, out[0].wall_s


class _Load:
    """A CPU-bound process beside the benchmark while the `with` lasts: one core's worth
    (a busy loop), half of a 2-core machine."""

    def __enter__(self):
        self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc):
        self.process.kill()
        self.process.wait()


def _candidates(family, args):
    """The candidates asked for (None: auto's defaults)."""
    if args.width is None and args.schedules is None:
        return None
    keep = None if args.schedules is None else set(args.schedules.split(",")) | {
        family.reference}
    return [c for c in default_candidates(family, args.width)
            if keep is None or c.schedule in keep]


def measure_model(name: str, args) -> dict:
    model = ps.load(name)
    engine = Engine.of(model)
    family = engine.family
    prompts = [p.prompt for p in corpus.arithmetic_test(args.prompts)]
    calibration = [p.prompt for p in corpus.arithmetic_test(args.calibration, seed=1)]
    with tempfile.TemporaryDirectory() as folder:
        planner = Planner(engine, directory=folder,
                          candidates=_candidates(family, args)).attach()
        t0 = time.perf_counter()
        planner.calibrate(calibration)
        calibration_s = time.perf_counter() - t0
    print(f"{name}: calibrated in {calibration_s:.1f} s (cost model "
          f"{planner.cost.calibration_s:.1f} s; spread {planner.cost.spread:.0%})",
          file=sys.stderr, flush=True)
    settings = {c.label(family): c.options(family) for c in planner.candidates}
    settings[AUTO] = {"schedule": AUTO}
    want = [_decode(model, [p], {"schedule": family.reference}, args.max_new_tokens)[0][0]
            .tokens for p in prompts]
    rows = []
    for load in args.load.split(","):
        if load not in LOADS:
            raise SystemExit(f"unknown --load {load!r}; expected some of {', '.join(LOADS)}")
        with (_Load() if load == "loaded" else contextlib.nullcontext()):
            rows += [_measure_batch(name, family, model, prompts, want, settings, batch,
                                    load, args) for batch in args.batches]
    return {"model": name, "calibration_s": calibration_s,
            "cost_calibration_s": planner.cost.calibration_s,
            "cost_spread": planner.cost.spread, "cost_load": planner.cost.load,
            "candidates": len(planner.candidates), "rows": rows,
            "acceptance": [{**r, "candidate": r["candidate"].label(family)}
                           for r in planner.acceptance.table()],
            "feedback": [{**r, "candidate": r["candidate"].label(family)}
                         for r in planner.feedback.table()]}


def _measure_batch(name, family, model, prompts, want, settings, batch, load, args) -> dict:
    """Every setting's tokens/s per round. Settings take turns call by call (each call's
    prompts decoded by every setting, in an order that rotates from call to call), so that
    a slow second of the machine falls on all of them alike rather than on one setting's
    whole round."""
    tokens = collections.defaultdict(lambda: collections.defaultdict(int))
    seconds = collections.defaultdict(lambda: collections.defaultdict(float))
    choices = collections.Counter()
    predictions: list[dict] = []
    labels = list(settings)
    groups = [list(range(i, min(i + batch, len(prompts))))
              for i in range(0, len(prompts), batch)]
    turn = 0
    for rnd in range(args.rounds + 1):   # round 0 compiles and is not counted
        for group in groups:
            shift = turn % len(labels)
            turn += 1
            for label in labels[shift:] + labels[:shift]:
                results, wall = _decode(model, [prompts[i] for i in group], settings[label],
                                        args.max_new_tokens,
                                        predictions if label == AUTO else None)
                if [r.tokens for r in results] != [want[i] for i in group]:
                    raise SystemExit(f"{name} {label} batch {batch}: tokens differ from "
                                     f"{family.reference}'s")
                if label == AUTO:
                    choices[results[0].auto["label"]] += 1
                tokens[rnd][label] += sum(len(r.tokens) for r in results)
                seconds[rnd][label] += wall
        print(f"{name} {load} batch {batch}: round {rnd} done", file=sys.stderr, flush=True)
    speeds = {label: [tokens[r][label] / seconds[r][label] for r in range(1, args.rounds + 1)]
              for label in labels}
    median = {k: statistics.median(v) for k, v in speeds.items()}
    best = max((k for k in median if k != AUTO), key=median.get)
    # auto against the best in each round, whose calls took turns with it: the slow
    # seconds of the machine fall on both alike, as they do not on two medians
    paired = [a / b for a, b in zip(speeds[AUTO], speeds[best])]
    row = {"model": name, "load": load, "batch": batch, "tokens_per_s": median,
           "rounds": speeds, "best_fixed": best,
           "auto_vs_best": statistics.median(paired), "auto_vs_best_by_round": paired,
           "auto_median_vs_best_median": median[AUTO] / median[best],
           "auto_choices": dict(choices), "predictions": predictions,
           **prediction_errors(predictions)}
    print(f"{name} {load} batch {batch}: auto {median[AUTO]:.0f} tokens/s, best fixed {best} "
          f"{median[best]:.0f} ({row['auto_vs_best']:.3f}x, the median of the rounds "
          f"{min(paired):.3f}-{max(paired):.3f}); auto chose {dict(choices)}",
          file=sys.stderr, flush=True)
    return row


def prediction_errors(predictions: list[dict]) -> dict:
    """How far auto's predicted tokens/s were from what its calls made, once it had
    decoded LEARNED requests in this setting: the median and the largest |predicted /
    observed - 1| of the calls that chose (explored calls left out)."""
    seen, errors = 0, []
    for p in predictions:
        if seen >= LEARNED and not p["explored"]:
            errors.append(abs(p["predicted"] / p["observed"] - 1))
        seen += p["requests"]
    return {"error_after": statistics.median(errors) if errors else None,
            "error_after_max": max(errors) if errors else None, "calls_after": len(errors)}


def markdown(runs: list[dict]) -> str:
    out = []
    for run in runs:
        out.append(f"\n{run['model']}: auto calibrated in {run['calibration_s']:.1f} s "
                   f"(cost model {run['cost_calibration_s']:.1f} s, its timings' widest "
                   f"spread {run['cost_spread']:.0%}; {run['candidates']} candidates)\n")
        heads = [f"{r['load']} batch {r['batch']}" for r in run["rows"]]
        out.append("| setting | " + " | ".join(f"{h} tokens/s" for h in heads) + " |")
        out.append("|---|" + "---|" * len(heads))
        for label in run["rows"][0]["tokens_per_s"]:
            cells = [f"{r['tokens_per_s'][label]:.0f}" for r in run["rows"]]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append(f"\n| {run['model']} | best fixed | auto / best: median of rounds | "
                   "rounds | of the medians | auto chose | "
                   f"auto calls | predicted / observed, call 1 | after {LEARNED} requests: "
                   "median error | max error |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in run["rows"]:
            first = r["predictions"][0]
            after = ("-" if r["error_after"] is None else f"{r['error_after']:.0%}",
                     "-" if r["error_after_max"] is None else f"{r['error_after_max']:.0%}")
            out.append(f"| {r['load']} batch {r['batch']} | {r['best_fixed']} | "
                       f"{r['auto_vs_best']:.3f} | {min(r['auto_vs_best_by_round']):.2f}-"
                       f"{max(r['auto_vs_best_by_round']):.2f} | "
                       f"{r['auto_median_vs_best_median']:.3f} | {r['auto_choices']} | "
                       f"{len(r['predictions'])} | "
                       f"{first['predicted'] / first['observed']:.2f} | {after[0]} | "
                       f"{after[1]} |")
    return "\n".join(out)


def main(argv=None) -> int:
    args = _arguments(argv)
    os.environ.setdefault("PACKED_SS_MAX_PROGRAMS", "96")   # every candidate stays compiled
    runs = [measure_model(m, args) for m in args.models.split(",")]
    print(markdown(runs))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
