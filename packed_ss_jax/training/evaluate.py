"""Measured quality and acceptance of a trained model (what the model card reports).

Accuracy: greedy AR exact-answer accuracy on held-out arithmetic problems (the
`#### N` line of the continuation against the generator's answer). Acceptance:
generated tokens per NFE of every schedule, on the same arithmetic prompts and on
held-out code and prose prompts, plus a check that every schedule reproduces the AR
greedy tokens.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from . import corpus

SCHEDULES = ("ar", "linear", "quadratic", "packed")
MAX_NEW_ARITH = 96  # longest solution + EOS is 80 tokens (checked by the tests)


def evaluate(model, n_arith: int = 200, n_other: int = 10, block_size: int | None = None,
             max_new_arith: int = MAX_NEW_ARITH, max_new_other: int = 48, schedules=SCHEDULES,
             progress: bool = True) -> dict:
    import packed_ss_jax as ps

    if not hasattr(model, "params"):
        model = ps.load(model)
    B = block_size or model.config.block_size
    sets = {
        "arithmetic": ([p.prompt for p in corpus.arithmetic_test(n_arith)], max_new_arith, True),
        "code": (corpus.code_prompts(n_other), max_new_other, False),
        "prose": (corpus.prose_prompts(n_other), max_new_other, False),
    }
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
                r = ps.decode(model, prompt, schedule=s, block_size=B, max_new_tokens=max_new,
                              eos_id=-1 if use_eos else None)
                st = stats[s]
                st["tokens"] += len(r.tokens)
                st["nfe"] += r.nfe
                st["wall_s"] += r.wall_s
                if ref is None:
                    ref = r
                    if name == "arithmetic" and corpus.parse_answer(r.text or "") == answers[i]:
                        correct += 1
                elif r.tokens != ref.tokens:
                    st["mismatch"] += 1
            if progress:
                sys.stderr.write(f"\r{name}: {i + 1}/{len(prompts)} "
                                 f"({time.monotonic() - t0:.0f}s)")
                sys.stderr.flush()
        if progress:
            sys.stderr.write("\n")
        for st in stats.values():
            st["tokens_per_nfe"] = st["tokens"] / max(st["nfe"], 1)
            st["tokens_per_s"] = st["tokens"] / st["wall_s"] if st["wall_s"] else float("nan")
        entry = {"n": len(prompts), "schedules": stats}
        if name == "arithmetic":
            entry["accuracy"] = correct / len(prompts)
        report["sets"][name] = entry
    return report


def print_report(report: dict) -> None:
    B = report["block_size"]
    print(f"| prompts | n | AR accuracy | " + " | ".join(
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
