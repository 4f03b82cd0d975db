"""The paper's figures from bench results: Figure 3/4 (ratios to Linear-SS and the
accuracy difference, per run) and Figure 5 (model vs non-model time, normalised per task
by Linear-SS's total and averaged over tasks). Everything here reads only the saved
results, so `packed-ss bench --replot results.json` draws the same figure without
decoding."""

from __future__ import annotations

from pathlib import Path

BASELINE = "linear"


def runs_of(results: dict) -> list[dict]:
    """The runs of a saved result: a sweep holds them under "runs", a single run is one."""
    if not isinstance(results, dict):
        raise ValueError(f"bench results must be a JSON object, got {type(results).__name__}")
    runs = results["runs"] if "runs" in results else [results]
    if not isinstance(runs, list) or not runs:
        raise ValueError("bench results hold no runs")
    for i, r in enumerate(runs):
        if not isinstance(r, dict):
            raise ValueError(f"run {i} is not a JSON object")
        missing = [k for k in ("model", "task", "n_prompts", "results") if k not in r]
        if missing:
            raise ValueError(f"run {i} lacks {missing}: not a packed-ss bench result")
    return runs


def run_label(run: dict) -> str:
    """What sets a run apart within a sweep: task, widths, order, adapter."""
    width_name = run.get("width_name", "block_size")
    widths = sorted({r.get(width_name) for r in run["results"].values()} - {None})
    symbol = "W" if width_name == "window" else "B"
    parts = [run["task"]]
    if widths:
        parts.append(f"{symbol}=" + "/".join(str(w) for w in widths))
    if run.get("family") == "setdlm":
        parts.append(run.get("order", "ltr"))
    if "lora" in run and run.get("family", "nemotron") == "nemotron":
        parts.append("adapter " + ("on" if run["lora"] else "off"))
    return ", ".join(parts)


def _group_key(run: dict) -> str:
    label = run_label(run)
    return label.split(", ", 1)[1] if ", " in label else ""


def time_decomposition(runs: list[dict], baseline: str = BASELINE) -> list[dict]:
    """Figure 5: for each run, every schedule's model and non-model time divided by the
    baseline's total wall time on that task; runs that differ only in task are averaged
    with equal weight per task (so long-output tasks do not dominate). Schedules missing
    from a task, and runs without the baseline or without a time split, are left out."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        res = run["results"]
        if baseline not in res or not run.get("time_split") or res[baseline]["wall_s"] <= 0:
            continue
        groups.setdefault(_group_key(run), []).append(run)
    out = []
    for key, members in groups.items():
        per_task = {}
        for run in members:
            total = run["results"][baseline]["wall_s"]
            per_task[run["task"]] = {
                s: {"model": r["model_time_s"] / total, "non_model": r["non_model_time_s"] / total}
                for s, r in run["results"].items()}
        names = [s for s in members[0]["results"] if all(s in t for t in per_task.values())]
        schedules = {}
        for s in names:
            m = sum(t[s]["model"] for t in per_task.values()) / len(per_task)
            nm = sum(t[s]["non_model"] for t in per_task.values()) / len(per_task)
            schedules[s] = {"model": m, "non_model": nm, "total": m + nm}
        out.append({"group": key, "tasks": list(per_task), "baseline": baseline,
                    "schedules": schedules, "per_task": per_task})
    return out


def decomposition_markdown(rows: list[dict]) -> str:
    out = ["time decomposition (Figure 5; each task's times / its Linear-SS total, tasks "
           "averaged with equal weight):",
           "| runs | tasks | schedule | model | non-model | total |", "|---|---|---|---|---|---|"]
    for g in rows:
        for s, v in g["schedules"].items():
            out.append(f"| {g['group'] or '-'} | {', '.join(g['tasks'])} | {s} | "
                       f"{v['model']:.3f} | {v['non_model']:.3f} | {v['total']:.3f} |")
    return "\n".join(out)


def check_writable_format(path: str) -> None:
    """matplotlib is installed and writes files with this extension (raises ValueError
    or ImportError naming the problem)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    ext = Path(path).suffix.lstrip(".").lower()
    formats = Figure().canvas.get_supported_filetypes()
    if ext and ext not in formats:
        raise ValueError(f"matplotlib cannot write {ext!r} files; use one of {sorted(formats)}")


PANELS = [("throughput", "throughput"), ("tokens_per_nfe", "tokens / NFE"),
          ("time_per_nfe", "time / NFE")]


def plot(results: dict, path: str) -> None:
    """One row per run with Linear-SS: throughput, tokens/NFE and time/NFE as ratios to
    Linear-SS and the accuracy difference to it in points, 95% paired intervals (Figures
    3/4); a last row with the time decomposition (Figure 5)."""
    check_writable_format(path)
    import matplotlib.pyplot as plt

    runs = [r for r in runs_of(results) if r.get("ratios_to_linear")]
    if not runs:
        raise ValueError("no run in these results has Linear-SS, the figures' baseline")
    decomposition = results.get("figure5") or time_decomposition(runs)
    rows = len(runs) + bool(decomposition)
    fig, axes = plt.subplots(rows, 4, figsize=(14, 3.0 * rows), squeeze=False)
    for row, run in zip(axes, runs):
        _draw_run_row(row, run)
    if decomposition:
        _draw_decomposition(fig, axes, decomposition)
    first = runs[0]
    fig.suptitle(f"{first['model']} · " + ", ".join(dict.fromkeys(r["task"] for r in runs)))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_run_row(row, run: dict) -> None:
    """A run's row of Figures 3/4: the three ratio panels, then the accuracy difference."""
    ratios = run["ratios_to_linear"]
    names = list(ratios)
    colors = ["#c44" if s == "packed" else "#888" for s in names]
    for ax, (metric, title) in zip(row, PANELS):
        vals = [ratios[s][metric]["ratio"] for s in names]
        lo = [v - ratios[s][metric]["ci95"][0] for s, v in zip(names, vals)]
        hi = [ratios[s][metric]["ci95"][1] - v for s, v in zip(names, vals)]
        ax.bar(names, vals, yerr=[lo, hi], capsize=4, color=colors)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_title(f"{title} (ratio to Linear-SS)", fontsize=9)
    _draw_accuracy_panel(row[3], ratios, names)
    row[0].set_ylabel(f"{run_label(run)}\nn={run['n_prompts']}"
                      + (f" x {run['samples']}" if run.get("samples", 1) > 1 else ""),
                      fontsize=8)


def _draw_accuracy_panel(ax, ratios: dict, names: list[str]) -> None:
    """The accuracy difference to Linear-SS in points, of the schedules that were scored."""
    scored = [s for s in names if "accuracy_diff_pp" in ratios[s]]
    if scored:
        vals = [ratios[s]["accuracy_diff_pp"]["diff"] for s in scored]
        lo = [v - ratios[s]["accuracy_diff_pp"]["ci95"][0] for s, v in zip(scored, vals)]
        hi = [ratios[s]["accuracy_diff_pp"]["ci95"][1] - v for s, v in zip(scored, vals)]
        ax.bar(scored, vals, yerr=[lo, hi], capsize=4,
               color=["#c44" if s == "packed" else "#888" for s in scored])
        ax.axhline(0.0, color="k", lw=0.8, ls="--")
    else:
        # an unscored task, or a result saved without per-prompt correctness
        ax.text(0.5, 0.5, "N/A (no per-prompt accuracy)", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_title("Δ accuracy vs Linear-SS (points)", fontsize=9)


def _draw_decomposition(fig, axes, decomposition: list[dict]) -> None:
    """Figure 5 across the whole last row of `axes`: model and non-model time, stacked."""
    grid = axes[-1, 0].get_gridspec()
    for ax in axes[-1]:
        ax.remove()
    ax = fig.add_subplot(grid[-1, :])  # the whole last row
    labels, model, non_model = [], [], []
    for g in decomposition:
        for s, v in g["schedules"].items():
            labels.append(f"{s}\n{g['group']}".replace(", ", "\n")
                          if len(decomposition) > 1 else s)
            model.append(v["model"])
            non_model.append(v["non_model"])
    ax.bar(labels, model, color="#48c", label="model execution")
    ax.bar(labels, non_model, bottom=model, color="#e94", label="non-model decoder")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_title("time / Linear-SS total (tasks averaged)", fontsize=9)
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
