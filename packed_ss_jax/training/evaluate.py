"""Measured quality and acceptance of a trained model (what the model card reports).

Accuracy: greedy AR exact-answer accuracy on held-out arithmetic problems (the
`#### N` line of the continuation against the generator's answer). Acceptance:
generated tokens per NFE of every schedule, on the same arithmetic prompts and on
held-out code and prose prompts, plus a check that every schedule reproduces the AR
greedy tokens.

SetDLM models (`evaluate` dispatches on the config's family): the reference is the
serial schedule (one MASK query per call), and every other schedule runs at each
window W of `SETDLM_WINDOWS`, in LTR order (where it must return the serial tokens) and,
for the speculative schedules, in confidence order (App. E.6), whose conditionals
differ, so its accuracy is reported and its agreement with the serial tokens counted.
"""

from __future__ import annotations

import sys
import time

from .. import families
from ..api import decode
from ..loading import load
from . import corpus

SCHEDULES = families.FAMILIES["nemotron"].schedules
MAX_NEW_ARITH = 96  # longest solution + EOS is 80 tokens (checked by the tests)


SETDLM_SCHEDULES = tuple(s for s in families.FAMILIES["setdlm"].schedules
                         if s != families.FAMILIES["setdlm"].reference)
SETDLM_WINDOWS = (4, 8, 16)
SETDLM_CACHE = 256  # positions: the longest prompt plus MAX_NEW_ARITH, with room to spare


def _prompt_sets(n_arith, n_other, max_new_arith, max_new_other):
    return {
        "arithmetic": ([p.prompt for p in corpus.arithmetic_test(n_arith)], max_new_arith, True),
        "code": (corpus.code_prompts(n_other), max_new_other, False),
        "prose": (corpus.prose_prompts(n_other), max_new_other, False),
    }


def _add(st: dict, r) -> None:
    st["tokens"] += len(r.tokens)
    st["nfe"] += r.nfe
    st["wall_s"] += r.wall_s


def _rates(st: dict) -> None:
    st["tokens_per_nfe"] = st["tokens"] / max(st["nfe"], 1)
    st["tokens_per_s"] = st["tokens"] / st["wall_s"] if st["wall_s"] else float("nan")


def _progress(on: bool, name="", done=0, total=0, t0=0.0, end=False) -> None:
    if not on:
        return
    sys.stderr.write("\n" if end else
                     f"\r{name}: {done}/{total} ({time.monotonic() - t0:.0f}s)")
    sys.stderr.flush()


def evaluate(model, n_arith: int = 200, n_other: int = 10, block_size: int | None = None,
             max_new_arith: int = MAX_NEW_ARITH, max_new_other: int = 48, schedules=SCHEDULES,
             progress: bool = True) -> dict:
    if not hasattr(model, "params"):
        model = load(model)
    if model.config.family == "setdlm":
        return evaluate_setdlm(model, n_arith, n_other, max_new_arith=max_new_arith,
                               max_new_other=max_new_other, progress=progress)
    B = block_size or model.config.block_size
    sets = _prompt_sets(n_arith, n_other, max_new_arith, max_new_other)
    answers = [p.answer for p in corpus.arithmetic_test(n_arith)]
    report = {"block_size": B, "sets": {}}
    t0 = time.monotonic()
    for name, (prompts, max_new, use_eos) in sets.items():
        if not prompts:
            continue
        stats = {s: {"tokens": 0, "nfe": 0, "wall_s": 0.0, "mismatch": 0} for s in schedules}
        correct = 0
        for i, prompt in enumerate(prompts):
            ref = None
            for s in schedules:
                r = decode(model, prompt, schedule=s, block_size=B, max_new_tokens=max_new,
                              eos_id=-1 if use_eos else None)
                st = stats[s]
                _add(st, r)
                if ref is None:
                    ref = r
                    if name == "arithmetic" and corpus.parse_answer(r.text or "") == answers[i]:
                        correct += 1
                elif r.tokens != ref.tokens:
                    st["mismatch"] += 1
            _progress(progress, name, i + 1, len(prompts), t0)
        _progress(progress, end=True)
        for st in stats.values():
            _rates(st)
        entry = {"n": len(prompts), "schedules": stats}
        if name == "arithmetic":
            entry["accuracy"] = correct / len(prompts)
        report["sets"][name] = entry
    return report


def setdlm_runs(windows=SETDLM_WINDOWS, schedules=SETDLM_SCHEDULES) -> list[tuple[str, int, str]]:
    """(schedule, W, order) of every run besides the serial reference."""
    runs = [(s, W, "ltr") for W in windows for s in schedules]
    return runs + [(s, W, "confidence") for W in windows for s in schedules
                   if s not in ("native", "serial")]


def run_key(schedule: str, window: int, order: str) -> str:
    return f"{schedule} W={window} {order}"


def evaluate_setdlm(model, n_arith: int = 200, n_other: int = 10, windows=SETDLM_WINDOWS,
                    schedules=SETDLM_SCHEDULES, max_new_arith: int = MAX_NEW_ARITH,
                    max_new_other: int = 48, cache_size: int = SETDLM_CACHE,
                    progress: bool = True) -> dict:
    """Serial accuracy, and per (schedule, W, order): tokens, NFE, tokens/NFE, outputs that
    differ from the serial tokens and (arithmetic) the accuracy of its own outputs."""
    sets = _prompt_sets(n_arith, n_other, max_new_arith, max_new_other)
    answers = [p.answer for p in corpus.arithmetic_test(n_arith)]
    runs = [("serial", 1, "ltr")] + setdlm_runs(windows, schedules)
    report = {"family": "setdlm", "windows": list(windows), "sets": {}}
    t0 = time.monotonic()
    for name, (prompts, max_new, use_eos) in sets.items():
        if not prompts:
            continue
        stats = {run_key(*r): {"tokens": 0, "nfe": 0, "wall_s": 0.0, "mismatch": 0, "correct": 0}
                 for r in runs}
        for i, prompt in enumerate(prompts):
            ref = None
            for schedule, W, order in runs:
                r = decode(model, prompt, schedule=schedule, window=W, order=order,
                           max_new_tokens=max_new, eos_id=-1 if use_eos else None,
                           cache_size=cache_size)
                st = stats[run_key(schedule, W, order)]
                _add(st, r)
                if name == "arithmetic" and corpus.parse_answer(r.text or "") == answers[i]:
                    st["correct"] += 1
                if ref is None:
                    ref = r
                elif r.tokens != ref.tokens:
                    st["mismatch"] += 1
            _progress(progress, name, i + 1, len(prompts), t0)
        _progress(progress, end=True)
        for st in stats.values():
            _rates(st)
            if name == "arithmetic":
                st["accuracy"] = st["correct"] / len(prompts)
            else:
                del st["correct"]
        entry = {"n": len(prompts), "max_new": max_new, "runs": stats}
        if name == "arithmetic":
            entry["accuracy"] = stats[run_key("serial", 1, "ltr")]["accuracy"]
        report["sets"][name] = entry
    return report


def print_report(report: dict) -> None:
    if report.get("family") == "setdlm":
        return print_setdlm_report(report)
    B = report["block_size"]
    print("| prompts | n | AR accuracy | " + " | ".join(
        f"{s} tok/NFE" + ("" if s == "ar" else f" (B={B})") for s in SCHEDULES) + " |")
    print("|" + "---|" * (3 + len(SCHEDULES)))
    for name, e in report["sets"].items():
        acc = f"{100 * e['accuracy']:.1f}%" if "accuracy" in e else "-"
        cells = [f"{e['schedules'][s]['tokens_per_nfe']:.2f}" for s in SCHEDULES
                 if s in e["schedules"]]
        print(f"| {name} | {e['n']} | {acc} | " + " | ".join(cells) + " |")
    bad = {(n, s): st["mismatch"] for n, e in report["sets"].items()
           for s, st in e["schedules"].items() if st["mismatch"]}
    print(f"schedules differing from AR greedy: {bad or 'none'}")


def print_setdlm_report(report: dict) -> None:
    """One table per prompt set: tokens/NFE per (schedule, order) and window."""
    windows = report["windows"]
    for name, e in report["sets"].items():
        runs = e["runs"]
        acc = f", serial accuracy {100 * e['accuracy']:.1f}%" if "accuracy" in e else ""
        print(f"\n{name}: {e['n']} held-out prompts, up to {e['max_new']} new tokens{acc}")
        print("| schedule | order | " + " | ".join(f"W={W} tok/NFE" for W in windows) + " |")
        print("|---|---|" + "---|" * len(windows))
        serial = runs[run_key("serial", 1, "ltr")]
        print("| serial | ltr | " + " | ".join(f"{serial['tokens_per_nfe']:.2f}"
                                                for _ in windows) + " |")
        for order in ("ltr", "confidence"):
            for s in SETDLM_SCHEDULES:
                keys = [run_key(s, W, order) for W in windows]
                if not all(k in runs for k in keys):
                    continue
                cells = []
                for k in keys:
                    st = runs[k]
                    cell = f"{st['tokens_per_nfe']:.2f}"
                    if order == "confidence" and "accuracy" in st:
                        cell += f" ({100 * st['accuracy']:.0f}%)"
                    cells.append(cell)
                print(f"| {s} | {order} | " + " | ".join(cells) + " |")
        def differing(keep):
            return {k: st["mismatch"] for k, st in runs.items() if st["mismatch"] and keep(k)}

        exact = differing(lambda k: k.endswith("ltr") and not k.startswith("native"))
        print(f"LTR speculative runs differing from the serial greedy output: {exact or 'none'}")
        print("native (threshold decoding, not exact) outputs differing from serial: "
              f"{differing(lambda k: k.startswith('native')) or 'none'}")
        print("confidence-order outputs differing from serial (other conditionals): "
              f"{differing(lambda k: k.endswith('confidence')) or 'none'}")
