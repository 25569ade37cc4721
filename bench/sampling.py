"""Benchmark of dynamic sampling: the share of uniform rollout groups, uniform vs dynamic.

A synthetic policy: every task has a fixed true success probability p (half of them never
solved, a fifth always solved, the rest in between) and a rollout group is ``group_size``
Bernoulli(p) rewards. ``simulate`` hands out jobs from a real PoolStore (DuckDB) in small
batches, as pool-store's job feed does, records each group through ``record_results`` and
reads the share of groups with all rewards equal back from the file with
``uniform_group_share``. ``run`` does this for both samplers on the same pool, with the
same number of groups and the same seed.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coevolve.bench import tables
from coevolve.services.pool_store.sampling import Sampler, SamplingConfig
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.messages import ORIGINS, Origin, RolloutResults, ScoreSample, Task

# pool-store's default mix, and origins in the pool in other proportions than the mix
MIX = {"seed": 0.5, "explored": 0.25, "synthesized": 0.25}
POOL_ORIGINS: dict[Origin, float] = {"seed": 0.6, "explored": 0.2, "synthesized": 0.2}
NEVER_SOLVED = 0.5
ALWAYS_SOLVED = 0.2
GROUP_SIZE = 8
BATCH = 4


def true_probabilities(count: int, rng: random.Random) -> list[float]:
    """Per task, the chance that one trajectory solves it."""
    never = round(count * NEVER_SOLVED)
    always = round(count * ALWAYS_SOLVED)
    between = [rng.uniform(0.05, 0.95) for _ in range(count - never - always)]
    probabilities = [0.0] * never + [1.0] * always + between
    rng.shuffle(probabilities)
    return probabilities


def pool_tasks(probabilities: list[float], rng: random.Random) -> dict[str, tuple[Task, float]]:
    """A task per probability, its origin drawn by ``POOL_ORIGINS``; by task id."""
    origins = rng.choices(
        list(POOL_ORIGINS), weights=list(POOL_ORIGINS.values()), k=len(probabilities)
    )
    tasks: dict[str, tuple[Task, float]] = {}
    for index, (origin, probability) in enumerate(zip(origins, probabilities, strict=True)):
        task = Task(
            id=f"sim-{index}",
            environment="bfcl",
            user_turns=[f"Move report_{index}.txt into the archive folder."],
            origin=origin,
        )
        tasks[task.id] = (task, probability)
    return tasks


@dataclass
class Simulation:
    """What one sampler did over a run of ``groups`` groups."""

    sampler: str
    groups: int
    uniform_share: float
    uniform_share_second_half: float
    drawn_by_origin: dict[str, int]
    retired: int

    def origin_shares(self) -> dict[str, float]:
        total = sum(self.drawn_by_origin.values())
        return {origin: self.drawn_by_origin.get(origin, 0) / total for origin in ORIGINS}


def simulate(
    store: PoolStore,
    success: dict[str, float],
    groups: int,
    seed: int,
    batch: int = BATCH,
    group_size: int = GROUP_SIZE,
) -> Simulation:
    """Draw ``groups`` jobs from ``store`` (``batch`` at a time), roll each out with the
    synthetic policy and record its group; ``success`` is each task's true probability."""
    rng = random.Random(seed)
    drawn: Counter[str] = Counter()
    half_recorded_at = 0.0
    recorded = 0
    while recorded < groups:
        tasks = store.sample_batch(min(batch, groups - recorded), MIX, seed=rng.getrandbits(32))
        if not tasks:
            raise RuntimeError("the pool has no active task left to sample")
        for task in tasks:
            if recorded == groups // 2:
                half_recorded_at = time.time()
            probability = success[task.id]
            samples = [
                ScoreSample(
                    task_id=task.id,
                    policy_version=0,
                    score=1.0 if rng.random() < probability else 0.0,
                    length=1,
                )
                for _ in range(group_size)
            ]
            group = RolloutResults(group_id=f"sim-group-{recorded}", samples=samples)
            assert store.record_results(group)
            drawn[task.origin] += 1
            recorded += 1
    overall = store.uniform_group_share()
    second_half = store.uniform_group_share(since=half_recorded_at)
    retired = sum(1 for task in store.list_tasks(limit=len(success)) if task.status != "active")
    assert overall.share is not None and second_half.share is not None
    return Simulation(
        sampler=store.sampling.sampler,
        groups=overall.groups,
        uniform_share=overall.share,
        uniform_share_second_half=second_half.share,
        drawn_by_origin=dict(drawn),
        retired=retired,
    )


def run_sampler(
    sampler: Sampler, tasks: dict[str, tuple[Task, float]], groups: int, seed: int
) -> Simulation:
    """A fresh pool of ``tasks`` and one simulation with ``sampler``."""
    with (
        tempfile.TemporaryDirectory(prefix="coevolve-bench-sampling-") as tmp,
        PoolStore(Path(tmp) / "pool.duckdb", sampling=SamplingConfig(sampler=sampler)) as store,
    ):
        store.add_tasks([task for task, _ in tasks.values()])
        success = {task_id: probability for task_id, (_, probability) in tasks.items()}
        return simulate(store, success, groups, seed)


def run(quick: bool) -> dict[str, Any]:
    task_count, groups, seed = (100, 400, 0) if quick else (400, 3000, 0)
    rng = random.Random(seed)
    tasks = pool_tasks(true_probabilities(task_count, rng), rng)
    results = {
        sampler: run_sampler(sampler, tasks, groups, seed) for sampler in ("uniform", "dynamic")
    }
    report: dict[str, Any] = {
        "tasks": task_count,
        "groups": groups,
        "group_size": GROUP_SIZE,
        "never_solved": NEVER_SOLVED,
        "always_solved": ALWAYS_SOLVED,
        "sampling": {
            name: {
                "uniform_share": round(result.uniform_share, 3),
                "uniform_share_second_half": round(result.uniform_share_second_half, 3),
                "origin_shares": {o: round(s, 3) for o, s in result.origin_shares().items()},
                "retired": result.retired,
            }
            for name, result in results.items()
        },
        "uniform_share_uniform": round(results["uniform"].uniform_share, 3),
        "uniform_share_dynamic": round(results["dynamic"].uniform_share, 3),
    }
    print_table(report)
    return report


def print_table(report: dict[str, Any]) -> None:
    tables.print_table(
        f"{report['tasks']} tasks ({report['never_solved']:.0%} never solved, "
        f"{report['always_solved']:.0%} always solved), {report['groups']} groups of "
        f"{report['group_size']}",
        ("sampler", "uniform groups", "2nd half", "retired", "origins drawn"),
        [
            (
                name,
                f"{row['uniform_share']:.3f}",
                f"{row['uniform_share_second_half']:.3f}",
                row["retired"],
                " ".join(f"{o}={s:.2f}" for o, s in row["origin_shares"].items()),
            )
            for name, row in report["sampling"].items()
        ],
        left=(0, 4),
    )
