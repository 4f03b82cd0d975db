"""Row accounting of the draft-only adapter (App. F.2, Tables 4-5).

The adapter is a per-row switch: a call's `draft_rows` say which rows receive its update
("selected"). The model computes the update for every row of a call and keeps it only
on the selected rows (`model.Attention`: one dense product over all rows, then a
`where`), so with the adapter loaded every row of every call is "evaluated", verifier-
only calls (AR, Linear-SS verify) included. Both counts are read off the call layouts
the schedules run (`layouts`), so they follow the code rather than a table.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from ..nemotron import layouts
from ..options import DEFAULT_BRANCHES

# Nemotron-Labs-Diffusion ("branched" at its default number of branches, as the bench runs it)
ADAPTER_SCHEDULES = ("ar", "linear", "quadratic", "packed", "branched")


def iteration_calls(schedule: str, block_size: int) -> list[layouts.Call]:
    """The calls of one decoder iteration after the first call, as the schedule builds them."""
    B, mask = block_size, 0
    x, c, draft = jnp.int32(0), jnp.int32(0), jnp.zeros(B - 1, jnp.int32)
    calls = {"ar": lambda: [layouts.single(x, c)],
             "linear": lambda: [layouts.draft_block(x, c, B, mask), layouts.verify(x, draft, c)],
             "packed": lambda: [layouts.packed(x, draft, c, mask)],
             "quadratic": lambda: [layouts.quadratic(x, draft, c, mask)],
             "branched": lambda: [layouts.branched(
                 x, draft, jnp.int32(B - 1), c, mask, min(DEFAULT_BRANCHES, B))]}
    if schedule not in calls:
        raise ValueError(f"adapter accounting covers {ADAPTER_SCHEDULES}, not {schedule!r}")
    if block_size < 2:
        raise ValueError(f"block size must be >= 2, got {block_size}")
    return calls[schedule]()


@functools.lru_cache(maxsize=None)
def _counts(schedule: str, block_size: int) -> tuple[int, int, int, int]:
    calls = iteration_calls(schedule, block_size)
    rows = [int(call.tokens.shape[0]) for call in calls]
    selected = sum(int(np.asarray(call.draft_rows).sum()) for call in calls)
    return len(calls), sum(rows), max(rows), selected


def adapter_rows(schedule: str, block_size: int | None, adapter: bool) -> dict:
    """Per iteration: calls, input rows, rows selected for the adapter's update and rows
    for which the update is computed (both 0 without the adapter), and the most rows in
    one call."""
    calls, rows, most, selected = _counts(schedule, block_size or 2)
    return {"calls": calls, "rows": rows, "max_rows_per_call": most,
            "selected": selected if adapter else 0, "evaluated": rows if adapter else 0}


def lora_table(runs: list[dict]) -> list[dict]:
    """Tables 4-5 from bench runs (each `report.summarize`'s output, with its `lora`):
    per schedule and adapter setting, means per response (tokens, wall, model and
    non-model time), throughput, accuracy, and per iteration the model time and the rows
    selected / evaluated."""
    out = []
    for run in runs:
        if run.get("family", "nemotron") != "nemotron":
            continue
        n = run["n_prompts"] * run.get("samples", 1)
        for s, r in run["results"].items():
            if s not in ADAPTER_SCHEDULES:
                continue
            iters = sum(run["per_prompt"][s].get("iterations", [])) or None
            out.append({
                "task": run["task"], "schedule": s, "adapter": bool(run.get("lora")),
                "block_size": r.get("block_size"), "responses": n,
                "mean_tokens": r["tokens"] / n, "mean_wall_s": r["wall_s"] / n,
                "mean_model_s": r["model_time_s"] / n,
                "mean_non_model_s": r["non_model_time_s"] / n,
                "throughput_tok_s": r["throughput_tok_s"], "accuracy": r["accuracy"],
                "mean_iterations": None if iters is None else iters / n,
                "model_ms_per_iteration": None if iters is None
                else 1e3 * r["model_time_s"] / iters,
                **{f"{k}_per_iteration": v for k, v in
                   adapter_rows(s, r.get("block_size"), bool(run.get("lora"))).items()},
            })
    return out


def lora_markdown(rows: list[dict]) -> str:
    out = ["draft-only adapter accounting (App. F.2; means per response, rows per iteration "
           "after the first call):",
           "| task | schedule | B | adapter | tokens | wall (s) | model (s) | non-model (s) | "
           "throughput (tok/s) | accuracy | model ms / iteration | rows | selected | evaluated |",
           "|" + "---|" * 14]
    for r in rows:
        acc = "-" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}%"
        ms = r["model_ms_per_iteration"]
        per_it = "-" if ms is None else f"{ms:.3f}"
        out.append(f"| {r['task']} | {r['schedule']} | {r['block_size'] or '-'} | "
                   f"{'on' if r['adapter'] else 'off'} | {r['mean_tokens']:.1f} | "
                   f"{r['mean_wall_s']:.4f} | {r['mean_model_s']:.4f} | "
                   f"{r['mean_non_model_s']:.4f} | {r['throughput_tok_s']:.1f} | {acc} | "
                   f"{per_it} | {r['rows_per_iteration']} | {r['selected_per_iteration']} | "
                   f"{r['evaluated_per_iteration']} |")
    return "\n".join(out)
