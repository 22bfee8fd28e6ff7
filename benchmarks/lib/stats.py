"""Statistics of repeated timings: quantiles, paired ratios over repeats, paired differences.

Repeats are paired by index: repeat ``i`` of one mode ran next to repeat ``i`` of the other (the benchmarks rotate
their order every repeat), so a ratio or difference per repeat cancels drift that hits both alike.
"""

from __future__ import annotations

import statistics


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs``, linear between the order statistics."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def paired(xs: list[float], ys: list[float]) -> dict | None:
    """Overhead of xs over ys in %, from per-repeat paired ratios (the lists are aligned by repeat)."""
    n = min(len(xs), len(ys))
    if n == 0:
        return None
    pct = [(x / y - 1) * 100 for x, y in zip(xs[:n], ys[:n])]
    r = lambda v: round(v, 3)  # noqa: E731
    return {"median": r(statistics.median(pct)), "min": r(min(pct)), "max": r(max(pct)), "q25": r(quantile(pct, .25)),
            "q75": r(quantile(pct, .75)), "n": n,
            # less sensitive to one slow run than a ratio of single runs
            "of_medians": r((statistics.median(xs[:n]) / statistics.median(ys[:n]) - 1) * 100),
            "of_minima": r((min(xs[:n]) / min(ys[:n]) - 1) * 100)}


def mean_by_repeat(runs: list[list[float]]) -> list[float]:
    """The per-repeat mean over ``runs`` (repeats aligned by index; as many as all of them have)."""
    return [statistics.mean(r[i] for r in runs) for i in range(min(map(len, runs)))]


def paired_difference(base: list[float], xs: list[float]) -> tuple[float, list[float]]:
    """Median and ``[min, max]`` of the per-repeat differences ``x - base`` (rounded to 3 places)."""
    diffs = [x - b for b, x in zip(base, xs)]
    return round(statistics.median(diffs), 3), [round(min(diffs), 3), round(max(diffs), 3)]
