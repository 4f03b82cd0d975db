"""The bench's results: each run's summary (what the JSON holds), the tables it prints,
the figures, and `--replot`, which redraws a saved run without decoding."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from .. import families
from ..arguments import UsageError
from . import accounting, figures, stats
from .measure import PROBE_PROMPTS, counts
from .plan import check_distinct, check_output_file, check_plot, make_parent


def summarize(model_name: str, task: str, per: dict, widths, config_width: int,
              resamples: int = stats.RESAMPLES, family: str = "nemotron",
              samples: int = 1, batch_size: int = 1, mesh: dict | None = None,
              batching: str = "continuous") -> dict:
    """The run's table: totals and rates per schedule (means per response), and Packed-SS
    against each baseline with paired bootstrap intervals over prompts (every response
    of a resampled prompt included; the wall difference is per response)."""
    counts(resamples=resamples, samples=samples)
    n = len(next(iter(per.values()))["tokens"])
    fam = families.FAMILIES[family]
    results = {s: _results_row(fam, s, d, widths, config_width, samples)
               for s, d in per.items()}
    idx = stats.resample_indices(n, resamples)
    scored = {s for s, d in per.items() if d["correct"]}
    paired = _paired(per, idx, scored, samples) if "packed" in per else {}
    figure3 = _ratios_to_linear(per, idx, scored) if "linear" in per else {}
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


def _results_row(fam, s: str, d: dict, widths, config_width: int, samples: int) -> dict:
    """One schedule's totals and rates (means per response)."""
    tokens, wall, nfe = (np.asarray(d[k], float) for k in ("tokens", "wall_s", "nfe"))
    model_s = float(np.sum(d["model_s"]))
    calls = float(np.sum(d["calls"])) if d.get("calls") else float(nfe.sum())
    return {
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


def _paired(per: dict, idx, scored: set, samples: int) -> dict:
    """Packed-SS against each other schedule: paired intervals, and the accuracy
    difference where both are scored (Table 11)."""
    paired = {}
    for s in per:
        if s != "packed":
            p = stats.paired(per["packed"], per[s], idx)
            p["wall_diff_s"] /= samples  # per prompt -> per response
            p["wall_diff_ci95"] = [x / samples for x in p["wall_diff_ci95"]]
            paired[f"packed_vs_{s}"] = p
            if {"packed", s} <= scored:
                acc = stats.paired_accuracy(per["packed"]["correct"], per[s]["correct"], idx)
                paired[f"packed_vs_{s}"].update(accuracy_diff_pp=acc["diff_pp"],
                                                accuracy_diff_ci95_pp=acc["ci95_pp"])
    return paired


def _ratios_to_linear(per: dict, idx, scored: set) -> dict:
    """Figures 3/4: every schedule's ratios to Linear-SS and its accuracy difference."""
    figure3 = {s: stats.ratio_to(per[s], per["linear"], idx) for s in per}
    for s in per:  # the accuracy-difference panel of Figures 3/4
        if {"linear", s} <= scored:
            acc = stats.paired_accuracy(per[s]["correct"], per["linear"]["correct"], idx)
            figure3[s]["accuracy_diff_pp"] = {"diff": acc["diff_pp"], "ci95": acc["ci95_pp"]}
    return figure3


def results(runs: list[dict], model_name: str, family: str, record: dict) -> dict:
    """What the bench writes: the one run's summary, or every run under "runs"; then
    Figure 5's numbers, the adapter accounting (where an adapter was on or --lora given)
    and the reproducibility record."""
    out = dict(runs[0]) if len(runs) == 1 else {"model": model_name, "family": family,
                                                 "runs": runs}
    out["figure5"] = figures.time_decomposition(runs)
    if any("lora" in r for r in runs):
        out["lora_accounting"] = accounting.lora_table(runs)
    out["reproducibility"] = record
    return out


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
            rows.append(f"| {name.removeprefix('packed_vs_')} | {p['throughput_ratio']:.3f} "
                        f"[{lo:.3f}, {hi:.3f}] | {p['wall_diff_s']:+.4f} [{dlo:+.4f}, {dhi:+.4f}] "
                        f"| {_accuracy_cell(p)} |")
    hist = ["", "accepted tokens per iteration (histogram, index = tokens):"]
    for s, r in summary["results"].items():
        hist.append(f"  {s}: {r['accept_hist']}")
    return "\n".join(rows + hist)


def _accuracy_cell(p: dict) -> str:
    """A paired accuracy difference and its interval, or '-' where it was not scored."""
    if "accuracy_diff_pp" not in p:
        return "-"
    alo, ahi = p["accuracy_diff_ci95_pp"]
    return f"{p['accuracy_diff_pp']:+.1f} [{alo:+.1f}, {ahi:+.1f}]"


def mesh_label(mesh: dict | None) -> str:
    """'data=2,model=4', or '-' for one device."""
    return ",".join(f"{k}={v}" for k, v in mesh.items()) if mesh else "-"


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
                cells = [f"{p['throughput_ratio']:.3f} [{lo:.3f}, {hi:.3f}]",
                         f"{p['wall_diff_s']:+.4f} [{dlo:+.4f}, {dhi:+.4f}]", _accuracy_cell(p)]
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


def plot(results: dict, path: str) -> None:
    """Figures 3/4 (a row per run) and Figure 5; see `figures.plot`."""
    figures.plot(results, str(make_parent(path)))


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
