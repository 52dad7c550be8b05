"""Bootstrap intervals over questions, and paired comparisons of two methods on the same questions.

    lo, hi = bootstrap_interval(values, statistic=mean)            # 95% percentile interval of the mean
    c = paired_comparison(speedups_a, speedups_b)                   # {qid: value} each, the same questions
    c["ratio"], c["interval"], c["wins"], c["questions"]            # mean(a) / mean(b), its interval, a > b count

Why a bootstrap over questions: the questions are the sampling unit of a benchmark like MT-Bench (a run
repeats the same questions; a different question set is what would move the figure), and per-question
speedups are skewed (one extraction question can reach 3x where the rest sit near 1.2x), so a normal
interval would be wrong. Resampling questions with replacement and recomputing the statistic gives the
spread a different draw of questions would give. A paired comparison resamples the same question
indices for both methods, so what they have in common (a hard question, machine drift within a question:
the methods run back to back) cancels in the ratio.

Everything here is deterministic for a given seed: the resampling indices come from a seeded numpy generator.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

DEFAULT_RESAMPLES = 10_000
DEFAULT_LEVEL = 0.95


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _indices(n: int, resamples: int, seed: int) -> np.ndarray:
    """[resamples, n] question indices drawn with replacement."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def _percentiles(stats, level: float) -> tuple[float, float]:
    """The (1 - level) / 2 and (1 + level) / 2 quantiles of the resampled statistics (linear interpolation)."""
    if not 0 < level < 1:
        raise ValueError(f"level={level}: an interval level is between 0 and 1 (e.g. 0.95)")
    lo, hi = np.percentile(np.asarray(stats, dtype=float), [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def bootstrap_interval(values: Sequence[float], statistic: Callable[[list[float]], float] = mean,
                       resamples: int = DEFAULT_RESAMPLES, level: float = DEFAULT_LEVEL,
                       seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of statistic(values); None with fewer than 2 values (no spread to
    resample)."""
    values = np.asarray([float(v) for v in values])
    if len(values) < 2:
        return None
    draws = values[_indices(len(values), resamples, seed)]          # [resamples, n]
    stats = draws.mean(axis=1) if statistic is mean else [statistic(list(row)) for row in draws]
    return _percentiles(stats, level)


def bootstrap_ratio_interval(numerators: Sequence[float], denominators: Sequence[float],
                             resamples: int = DEFAULT_RESAMPLES, level: float = DEFAULT_LEVEL,
                             seed: int = 0) -> tuple[float, float] | None:
    """Interval of sum(numerators) / sum(denominators), the pairs (one per question) resampled together: a pooled
    figure such as tokens per step (accepted length) or tokens per second over all questions."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators but {len(denominators)} denominators: one pair per question")
    return bootstrap_columns({"num": numerators, "den": denominators},
                             lambda c: c["num"].sum(-1) / c["den"].sum(-1), resamples, level, seed)


def bootstrap_columns(columns: dict[str, Sequence[float]], statistic: Callable[[dict[str, np.ndarray]], np.ndarray],
                      resamples: int = DEFAULT_RESAMPLES, level: float = DEFAULT_LEVEL,
                      seed: int = 0) -> tuple[float, float] | None:
    """Interval of a statistic of several per-question columns resampled together. statistic gets
    {name: [resamples, n] array} and returns [resamples] values, e.g. the pooled speedup
    (sum of tokens / sum of time of a method) / (the same of the baseline)."""
    cols = {k: np.asarray(v, dtype=float) for k, v in columns.items()}
    lengths = {len(v) for v in cols.values()}
    if len(lengths) != 1:
        raise ValueError(f"columns of different lengths {sorted(lengths)}: one value per question in each")
    n = lengths.pop()
    if n < 2:
        return None
    idx = _indices(n, resamples, seed)
    stats = np.asarray(statistic({k: v[idx] for k, v in cols.items()}), dtype=float)
    return _percentiles(stats[np.isfinite(stats)], level)


def interval_of_mean(values: Sequence[float], **kw) -> dict:
    """{"mean", "ci": [lo, hi] or None, "n"} of per-question values."""
    values = [float(v) for v in values]
    if not values:
        return {"mean": None, "ci": None, "n": 0}
    ci = bootstrap_interval(values, **kw)
    return {"mean": mean(values), "ci": None if ci is None else [ci[0], ci[1]], "n": len(values)}


def paired_comparison(a: dict, b: dict, resamples: int = DEFAULT_RESAMPLES, level: float = DEFAULT_LEVEL,
                      seed: int = 0) -> dict:
    """A against B on the questions both have. a, b: {question id: value} (e.g. per-question speedups).

    ratio = mean(a) / mean(b) over the shared questions; its percentile interval from resampling those
    questions (the same draw for both); wins = questions where a > b (ties count for neither);
    mean_of_ratios = the mean over questions of a / b, the Spec-Bench way of averaging."""
    shared = sorted(set(a) & set(b))
    out = {"questions": len(shared), "ratio": None, "interval": None, "wins": None, "losses": None,
           "mean_of_ratios": None, "level": level}
    if not shared:
        return out
    va, vb = [float(a[q]) for q in shared], [float(b[q]) for q in shared]
    out["ratio"] = mean(va) / mean(vb) if mean(vb) else None
    out["wins"] = sum(x > y for x, y in zip(va, vb))
    out["losses"] = sum(x < y for x, y in zip(va, vb))
    out["mean_of_ratios"] = mean([x / y for x, y in zip(va, vb) if y]) if all(vb) else None
    ci = bootstrap_ratio_interval(va, vb, resamples=resamples, level=level, seed=seed)
    out["interval"] = None if ci is None else [ci[0], ci[1]]
    return out


def verdict(comparison: dict) -> str:
    """"A ahead" / "B ahead" when the interval of the ratio lies above / below 1, else "no clear difference"."""
    ci = comparison.get("interval")
    if not ci:
        return "too few questions"
    if ci[0] > 1:
        return "A ahead"
    if ci[1] < 1:
        return "B ahead"
    return "no clear difference"
