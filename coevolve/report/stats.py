"""Intervals across seeds: Student-t for a mean, percentile bootstrap for a paired mean."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scipy import stats as scipy_stats

BOOTSTRAP_RESAMPLES = 10_000


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean with its t interval; with one value the interval is that value."""
    if not values:
        raise ValueError("no values")
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return Interval(mean, mean, mean, 1)
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    half = float(scipy_stats.t.ppf(0.5 + confidence / 2, n - 1)) * math.sqrt(variance / n)
    return Interval(mean, mean - half, mean + half, n)


def bootstrap_mean_interval(
    values: Sequence[float],
    confidence: float = 0.95,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Interval:
    """Mean with a percentile-bootstrap interval (resampling ``values`` with replacement)."""
    if not values:
        raise ValueError("no values")
    n = len(values)
    mean = sum(values) / n
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    tail = (1 - confidence) / 2
    low = means[math.floor(tail * (resamples - 1))]
    high = means[math.ceil((1 - tail) * (resamples - 1))]
    return Interval(mean, low, high, n)


def paired_differences(first: dict[int, float], second: dict[int, float]) -> list[float]:
    """``first[s] - second[s]`` for every seed ``s`` both have, in seed order."""
    return [first[s] - second[s] for s in sorted(first.keys() & second.keys())]


def paired_bootstrap_interval(
    differences_by_seed: Mapping[int, Sequence[float]],
    confidence: float = 0.95,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Interval:
    """Mean paired difference with a two-level percentile bootstrap.

    ``differences_by_seed[s]`` holds one difference per held-out task (the same task
    scored by both arms of seed ``s``). Each resample draws seeds with replacement, then
    tasks within each drawn seed with replacement, so the interval carries both the
    run-to-run and the task-sampling variation. One seed: a bootstrap over tasks only.
    """
    groups = [list(v) for _, v in sorted(differences_by_seed.items()) if v]
    if not groups:
        raise ValueError("no differences")
    pooled = [d for group in groups for d in group]
    mean = sum(pooled) / len(pooled)
    rng = random.Random(seed)
    means: list[float] = []
    for _ in range(resamples):
        drawn = [rng.choice(groups) for _ in groups]
        total, count = 0.0, 0
        for group in drawn:
            total += sum(rng.choices(group, k=len(group)))
            count += len(group)
        means.append(total / count)
    means.sort()
    tail = (1 - confidence) / 2
    low = means[math.floor(tail * (resamples - 1))]
    high = means[math.ceil((1 - tail) * (resamples - 1))]
    return Interval(mean, low, high, len(groups))
