"""Intervals across seeds: Student-t for a mean, percentile bootstrap for a paired mean."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test on the discordant pairs (McNemar's exact form)."""
    return 1.0 if wins + losses == 0 else float(scipy_stats.binomtest(wins, wins + losses).pvalue)


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


@dataclass(frozen=True)
class PairedDelta:
    """``first - second`` over paired tasks: mean, bootstrap interval, two-sided p-value."""

    mean: float
    low: float
    high: float
    p: float
    n: int
    test: str


def paired_delta(
    first: Sequence[float],
    second: Sequence[float],
    *,
    binary: bool = False,
    confidence: float = 0.95,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> PairedDelta:
    """The paired difference of two policies scored on the same tasks.

    The interval is a percentile bootstrap over tasks. The p-value is the exact sign test
    on the discordant pairs for 0/1 measures (McNemar's exact test), else a paired
    permutation test (each task's two scores swapped at random).
    """
    if len(first) != len(second):
        raise ValueError(f"{len(first)} scores against {len(second)}: not paired")
    if not first:
        raise ValueError("no paired scores")
    differences = [a - b for a, b in zip(first, second, strict=True)]
    interval = bootstrap_mean_interval(differences, confidence, resamples, seed)
    p, test = paired_p_value(first, second, binary=binary, resamples=resamples, seed=seed)
    return PairedDelta(interval.mean, interval.low, interval.high, p, len(first), test)


def paired_p_value(
    first: Sequence[float],
    second: Sequence[float],
    *,
    binary: bool = False,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, str]:
    """Two-sided p-value of ``first - second`` over paired tasks, and the test's name."""
    differences = [a - b for a, b in zip(first, second, strict=True)]
    if binary:
        return differences_p_value(differences, binary=True), "exact sign test (McNemar)"
    if len(differences) == 1 or all(d == 0 for d in differences):
        # one task's two orders give the same |difference|: the exact p-value is 1
        return 1.0, "paired permutation"
    result = scipy_stats.permutation_test(
        (list(first), list(second)),
        _mean_difference,
        permutation_type="samples",
        vectorized=True,
        n_resamples=resamples,
        random_state=seed,
    )
    return min(float(result.pvalue), 1.0), "paired permutation"


def differences_p_value(
    differences: Sequence[float],
    *,
    binary: bool = False,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> float:
    """Two-sided p-value that paired ``differences`` (one per unit) center on 0.

    Binary measures: the exact sign test on the units whose difference is above or
    below 0 (ties dropped). Otherwise the sign-flip permutation test of the mean
    (exact when the units' 2^n sign patterns are no more than ``resamples``).
    """
    if binary:
        wins = sum(1 for d in differences if d > 0)
        losses = sum(1 for d in differences if d < 0)
        return min(sign_test(wins, losses), 1.0)
    if len(differences) <= 1 or all(d == 0 for d in differences):
        return 1.0
    result = scipy_stats.permutation_test(
        (list(differences),),
        _mean,
        permutation_type="samples",  # one sample: each unit's sign flipped at random
        vectorized=True,
        n_resamples=resamples,
        random_state=seed,
    )
    return min(float(result.pvalue), 1.0)


def _mean_difference(first: Any, second: Any, axis: int = -1) -> Any:
    return (first - second).mean(axis=axis)


def _mean(values: Any, axis: int = -1) -> Any:
    return values.mean(axis=axis)
