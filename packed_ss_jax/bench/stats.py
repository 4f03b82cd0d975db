"""Paired percentile bootstrap over prompts (App. E.5).

Every resample draws prompt indices with replacement and uses the same indices for
every method; statistics are recomputed from the resampled prompts' totals.
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 20_000
BOOTSTRAP_SEED = 0


def resample_indices(n: int, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def throughput(tokens: np.ndarray, wall: np.ndarray, idx=None):
    """Total tokens / total wall, per resample when idx [R, n] is given."""
    if idx is None:
        return tokens.sum() / wall.sum()
    return tokens[idx].sum(axis=1) / wall[idx].sum(axis=1)


def percentile_ci(samples: np.ndarray, level: float = 0.95) -> list[float]:
    lo, hi = np.percentile(samples, [50 * (1 - level), 50 * (1 + level)])
    return [float(lo), float(hi)]


def paired(a: dict, b: dict, idx: np.ndarray) -> dict:
    """Method a against baseline b: throughput ratio and mean per-prompt wall difference.

    a, b: {"tokens": [n], "wall_s": [n], "nfe": [n]} per prompt.
    """
    ta, wa = np.asarray(a["tokens"], float), np.asarray(a["wall_s"], float)
    tb, wb = np.asarray(b["tokens"], float), np.asarray(b["wall_s"], float)
    ratio = throughput(ta, wa) / throughput(tb, wb)
    ratios = throughput(ta, wa, idx) / throughput(tb, wb, idx)
    diff = wa - wb
    diffs = diff[idx].mean(axis=1)
    return {"throughput_ratio": float(ratio), "throughput_ratio_ci95": percentile_ci(ratios),
            "wall_diff_s": float(diff.mean()), "wall_diff_ci95": percentile_ci(diffs)}


def ratio_to(a: dict, b: dict, idx: np.ndarray) -> dict:
    """Figure 3 ratios of a to b (throughput, tokens/NFE, time/NFE) with 95% intervals."""
    out = {}
    ta, wa, na = (np.asarray(a[k], float) for k in ("tokens", "wall_s", "nfe"))
    tb, wb, nb = (np.asarray(b[k], float) for k in ("tokens", "wall_s", "nfe"))
    metrics = {
        "throughput": (lambda t, w, n, i: throughput(t, w, i)),
        "tokens_per_nfe": (lambda t, w, n, i: (t.sum() / n.sum()) if i is None
                           else t[i].sum(1) / n[i].sum(1)),
        "time_per_nfe": (lambda t, w, n, i: (w.sum() / n.sum()) if i is None
                         else w[i].sum(1) / n[i].sum(1)),
    }
    for name, f in metrics.items():
        point = f(ta, wa, na, None) / f(tb, wb, nb, None)
        boot = f(ta, wa, na, idx) / f(tb, wb, nb, idx)
        out[name] = {"ratio": float(point), "ci95": percentile_ci(boot)}
    return out


def per_prompt_correct(correct) -> np.ndarray:
    """[n] the fraction of each prompt's responses that were correct. `correct` holds one
    entry per prompt: a bool / 0-1 number (one response) or a list of them (repeated
    samples, App. E.4)."""
    out = []
    for i, c in enumerate(correct):
        c = np.atleast_1d(np.asarray(c, float))
        if c.size == 0 or not np.all((c >= 0) & (c <= 1)):
            raise ValueError(f"prompt {i}: correctness must be one or more values in [0, 1], "
                             f"got {c.tolist()}")
        out.append(c.mean())
    return np.asarray(out, float)


def pass_at_1(correct) -> float:
    """pass@1 with repeated sampling (App. E.4): per prompt, the mean correctness over its
    samples; then the mean over prompts (every prompt weighs the same)."""
    return float(per_prompt_correct(correct).mean())


def paired_accuracy(a, b, idx: np.ndarray) -> dict:
    """Accuracy of method a minus baseline b in percentage points (Table 11), with the
    paired percentile interval: every resample takes the same prompts for both methods,
    all repeated responses of a sampled prompt included (App. E.5)."""
    ca, cb = per_prompt_correct(a), per_prompt_correct(b)
    if ca.shape != cb.shape:
        raise ValueError(f"paired accuracy needs the same prompts: {ca.size} vs {cb.size}")
    diff = 100 * (ca - cb)
    return {"diff_pp": float(diff.mean()), "ci95_pp": percentile_ci(diff[idx].mean(axis=1))}
