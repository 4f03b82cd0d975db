"""Paired percentile bootstrap over prompts (App. E.5).

Every resample draws prompt indices with replacement and uses the same indices for
every method; statistics are recomputed from the resampled prompts' totals.
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 20_000


def resample_indices(n: int, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
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
